"""LockedTask in real ``celery worker`` subprocesses with the prefork pool.

What only real worker processes show: locks taken in forked children and renewed by
their own heartbeat, children dying (SIGKILL, hard time limit, ``revoke(terminate=True)``)
with the main process freeing their locks, retries re-queued from a child, the same
message delivered twice, and a warm shutdown.

Each test gets its own queue and key prefix (see :mod:`prefork_app`), starts its own
workers (at most 2 x 4 processes) and always stops them; when a test fails, the tail of
each worker's log is written to the terminal.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult, ResultSet
from prefork_app import ENV_PREFIX, ENV_QUEUE, ENV_URL, data_prefix, make_app

from celery_dlock.lock import LockKeys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

REPO = Path(__file__).resolve().parents[1]

#: Seconds a worker gets to start (import, fork 4 children, connect).
START_TIMEOUT = 30.0
#: A dead child's lock must be free within this many seconds: far less than its ttl
#: (10 s) and than the prefork pool's own periodic check of its children (5 s); a
#: measured freeing takes tens of milliseconds.
PROMPT = 2.0


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.01,
             what: str = "condition") -> Any:
    """Poll until ``predicate()`` returns something truthy; return it (or fail)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Worker:
    """One ``celery worker`` subprocess (its own session, so its whole process group
    can be killed) with its log in a file."""

    def __init__(self, proc: subprocess.Popen[bytes], label: str, log: Path,
                 concurrency: int) -> None:
        self.proc = proc
        self.label = label  # the node name before the "@"
        self.log = log
        self.concurrency = concurrency

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def _exited(self) -> bool:
        """Whether the main process has exited (without reaping it: while it is a
        zombie its process group id cannot be reused)."""
        if self.proc.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.proc.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> float:
        """Send ``sig``; after ``timeout`` SIGKILL the whole group.  Returns how long
        the main process took to exit (inf when it had to be killed)."""
        started = time.monotonic()
        took = float("inf")
        if not self._exited():
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            deadline = started + timeout
            while time.monotonic() < deadline and not self._exited():
                time.sleep(0.02)
            if self._exited():
                took = time.monotonic() - started
        else:
            took = 0.0
        if self.proc.returncode is None:  # not reaped yet: the group id is still ours
            # Children left behind (or the main process itself, past the timeout).
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait(timeout=30)
        return took


class Harness:
    """Workers, the app to talk to them, and the test's Redis records."""

    def __init__(self, url: str, prefix: str, r: redis.Redis, tmp_path: Path) -> None:
        self.url = url
        self.prefix = prefix
        self.r = r
        self.tmp_path = tmp_path
        self.queue = f"q-{prefix}"
        self.dp = data_prefix(prefix)
        self.app = make_app(url, prefix, self.queue)
        self.run_id = uuid.uuid4().hex[:8]
        self.workers: list[Worker] = []

    # -- workers ----------------------------------------------------------------------

    def start_worker(self, concurrency: int = 4) -> Worker:
        label = f"w{len(self.workers) + 1}-{self.run_id}"
        log = self.tmp_path / f"{label}.log"
        env = dict(os.environ)
        env.update({
            ENV_URL: self.url,
            ENV_PREFIX: self.prefix,
            ENV_QUEUE: self.queue,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "PYTHONUNBUFFERED": "1",
        })
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.prefork_app", "worker",
                 "--pool=prefork", "-c", str(concurrency), "-Q", self.queue,
                 "-n", f"{label}@%h", "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "-l", "info"],
                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        worker = Worker(proc, label, log, concurrency)
        self.workers.append(worker)
        return worker

    def wait_ready(self, *workers: Worker) -> None:
        """Until each worker's consumer is up and all its children have started."""
        for worker in workers:
            def ready(worker: Worker = worker) -> bool:
                if worker._exited():
                    pytest.fail(f"worker {worker.label} exited while starting:\n"
                                f"{worker.log_text()[-3000:]}")
                nodes = [n.decode() for n in self.r.smembers(f"{self.dp}:ready")]
                node = next((n for n in nodes if n.startswith(worker.label + "@")), None)
                if node is None:
                    return False
                children = int(self.r.get(f"{self.dp}:children:{node}") or 0)
                return children >= worker.concurrency

            wait_for(ready, START_TIMEOUT, 0.05, f"worker {worker.label} to start")

    def start_workers(self, count: int = 1, concurrency: int = 4) -> list[Worker]:
        workers = [self.start_worker(concurrency) for _ in range(count)]
        self.wait_ready(*workers)
        return workers

    def close(self, failed: bool, report: Callable[[str], None]) -> None:
        for worker in self.workers:
            worker.stop(signal.SIGTERM, timeout=15.0)
        if failed:
            for worker in self.workers:
                tail = "\n".join(worker.log_text().splitlines()[-80:])
                report(f"----- worker {worker.label} log (tail) -----\n{tail}")
        # Results a failure's traceback keeps alive unsubscribe from the result store
        # when collected, maybe after the session's Redis has stopped: forget them.
        consumer = getattr(self.app.backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
            getattr(consumer, "subscribed_to", set()).clear()
        self.app.close()

    # -- locks and records --------------------------------------------------------------

    def lock_key(self, name: str) -> str:
        return LockKeys.for_name(self.prefix, name).lock

    def owner(self, name: str) -> str | None:
        value = self.r.hget(self.lock_key(name), "owner")
        return value.decode() if value is not None else None

    def records(self, kind: str, key: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.r.lrange(f"{self.dp}:{kind}:{key}", 0, -1)]

    def lock_keys_left(self) -> list[str]:
        """Lock keys under this test's prefix, except the fence counters (which never
        expire, by design)."""
        keys = [k.decode() for k in self.r.scan_iter(match=f"{self.prefix}:*",
                                                       count=1000)]
        return sorted(k for k in keys if not k.endswith(":fence"))

    def wait_owner_not(self, name: str, owner: str, timeout: float) -> float:
        """Poll (1 ms) until ``owner`` no longer holds the lock; the time.time() then."""
        key = self.lock_key(name)
        deadline = time.monotonic() + timeout
        while True:
            value = self.r.hget(key, "owner")
            if value is None or value.decode() != owner:
                return time.time()
            if time.monotonic() > deadline:
                pytest.fail(f"lock {name!r} still held by {owner} after {timeout}s")
            time.sleep(0.001)

    def hold_event(self, key: str, event: str, *, task_id: str | None = None,
                   not_pid: int | None = None) -> dict[str, Any] | None:
        for rec in self.records("hold", key):
            if rec["event"] != event:
                continue
            if task_id is not None and rec["task_id"] != task_id:
                continue
            if not_pid is not None and rec["pid"] == not_pid:
                continue
            return rec
        return None


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    failed_before = request.session.testsfailed
    h = Harness(redis_url, prefix, r, tmp_path)

    def report(text: str) -> None:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(text)
        else:
            print(text, file=sys.__stderr__)

    try:
        yield h
    finally:
        h.close(request.session.testsfailed > failed_before, report)


def spans(runs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) of each run in seconds from the first start, for the reader."""
    t0 = min((x["start"] for x in runs), default=0.0)
    return [(round(x["start"] - t0, 3), round(x["end"] - t0, 3)) for x in runs]


def assert_disjoint(runs: list[dict[str, Any]]) -> None:
    runs = sorted(runs, key=lambda x: x["start"])
    for before, after in itertools.pairwise(runs):
        assert before["end"] <= after["start"], (
            f"runs overlap: {before} and {after}")


def assert_held_throughout(h: Harness, name: str, key: str, owner: str,
                           task_id: str, pid_gone: int) -> None:
    """While the run of (``task_id``, not ``pid_gone``) has not ended, the lock stays
    with ``owner``: nothing (such as freeing a dead attempt's hold) takes it away."""
    samples = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        current = h.owner(name)
        ended = h.hold_event(key, "end", task_id=task_id, not_pid=pid_gone)
        if ended is not None:
            break
        assert current == owner, (
            f"the second attempt's hold was taken away while it ran: owner {current}")
        samples += 1
        time.sleep(0.005)
    else:
        pytest.fail("the second attempt never finished")
    assert samples > 10
    assert ended["owned"] is True and ended["lost"] is False, ended


# -- 1. inventory ----------------------------------------------------------------------


def test_inventory_no_oversell_with_lock_and_oversell_without(harness: Harness) -> None:
    h = harness
    h.start_workers(count=2, concurrency=4)
    buyers, stock = 400, 200
    plain = h.app.tasks["pf.buy_plain"]
    locked = h.app.tasks["pf.buy_locked"]

    outcome: dict[str, dict[str, int | float]] = {}
    for label, task, product in (("plain", plain, "p-plain"),
                                 ("locked", locked, "p-locked")):
        base = f"{h.dp}:inv:{product}"
        h.r.set(f"{base}:stock", stock)
        started = time.monotonic()
        results = ResultSet([task.delay(product) for _ in range(buyers)])
        bought = results.get(timeout=120, interval=0.05)
        outcome[label] = {
            "sold": int(h.r.get(f"{base}:sold") or 0),
            "left": int(h.r.get(f"{base}:stock") or 0),
            "bought": sum(1 for b in bought if b),
            "overlaps": int(h.r.get(f"{base}:overlaps") or 0),
            "seconds": round(time.monotonic() - started, 2),
        }
    print(f"\ninventory ({buyers} buyers, stock {stock}, 2 workers x 4 processes): "
          f"without lock {outcome['plain']}, with lock {outcome['locked']}")

    # The control must over-sell, or the run proves nothing about the lock.
    assert outcome["plain"]["overlaps"] > 0, outcome
    assert outcome["plain"]["sold"] > stock, outcome
    assert outcome["locked"] == {**outcome["locked"], "sold": stock, "left": 0,
                                 "bought": stock, "overlaps": 0}
    assert h.lock_keys_left() == []


# -- 2. a 1 s lock renewed for a 3.5 s run ---------------------------------------------


def test_renewal_in_child_keeps_short_ttl_lock_for_long_run(harness: Harness) -> None:
    h = harness
    h.start_workers(count=1, concurrency=4)
    interval = h.app.tasks["pf.interval"]
    key = "renew"
    results = [interval.delay(key, 3.5) for _ in range(3)]  # three messages, one key
    for res in results:
        res.get(timeout=60)
    runs = h.records("iv", key)
    print(f"\nruns of a 3.5 s task with lock_ttl=1 (start, end): {spans(runs)}")
    assert len(runs) == 3
    assert {x["task_id"] for x in runs} == {res.id for res in results}
    assert_disjoint(runs)
    for run in runs:
        assert run["end"] - run["start"] >= 3.5
        assert run["owned"] is True and run["lost"] is False, run
    fences = [x["fence"] for x in sorted(runs, key=lambda x: x["start"])]
    assert fences == sorted(fences) and len(set(fences)) == 3
    assert h.lock_keys_left() == []


# -- 3. SIGKILL of the child running a locked task -------------------------------------


def test_sigkill_of_child_frees_lock_promptly(harness: Harness) -> None:
    h = harness
    (worker,) = h.start_workers(count=1, concurrency=4)
    hold = h.app.tasks["pf.hold"]
    key, name = "kill", "hold:kill"
    ttl = 10.0

    a = hold.delay(key, 60)
    start_a = wait_for(lambda: h.hold_event(key, "start", task_id=a.id), 20,
                       what="the first task to start")
    pid_a, owner_a = start_a["pid"], start_a["owner"]
    holder = {k.decode(): v.decode() for k, v in h.r.hgetall(h.lock_key(name)).items()}
    assert holder["owner"] == owner_a and holder["task_id"] == a.id
    assert holder["pid"] == str(pid_a)

    # The second attempt is a redelivery of the same message (same task id), in another
    # child: freeing the dead attempt's hold must never free this one's.
    hold.apply_async((key, 2.0), task_id=a.id)
    queue = LockKeys.for_name(h.prefix, name).queue
    wait_for(lambda: h.r.zcard(queue) >= 1, 20, what="the second attempt to wait")

    pttl_ms = h.r.pttl(h.lock_key(name))
    killed = time.time()
    os.kill(pid_a, signal.SIGKILL)
    freed = h.wait_owner_not(name, owner_a, timeout=ttl + 5)
    start_b = wait_for(lambda: h.hold_event(key, "start", task_id=a.id, not_pid=pid_a),
                       ttl + 5, 0.002, "the second attempt to start")
    kill_to_free = freed - killed
    kill_to_start = start_b["time"] - killed
    print(f"\nSIGKILL -> lock freed: {kill_to_free * 1000:.0f} ms; -> second attempt "
          f"running: {kill_to_start * 1000:.0f} ms (ttl left was {pttl_ms} ms)")

    # Expiry could not free it before pttl_ms (>= 2/3 of the ttl): the main process did,
    # and without waiting for the pool's own check of its children (every 5 s).
    assert kill_to_free < min(PROMPT, pttl_ms / 1000 - 1.0)
    assert kill_to_start < min(PROMPT, pttl_ms / 1000 - 1.0)
    wait_for(lambda: "freed lock 'hold:kill'" in worker.log_text(), 5,
             what="the main process to log that it freed the lock")
    owner_b = start_b["owner"]
    assert owner_b and owner_b != owner_a
    assert_held_throughout(h, name, key, owner_b, a.id, pid_a)
    wait_for(lambda: h.lock_keys_left() == [], 5, what="the lock to be released")


# -- 4. hard time limit ----------------------------------------------------------------


def test_hard_time_limit_frees_lock_promptly(harness: Harness) -> None:
    h = harness
    h.start_workers(count=1, concurrency=4)
    key, name = "limit", "hold:limit"
    a = h.app.tasks["pf.hold_limited"].delay(key, 10)
    start_a = wait_for(lambda: h.hold_event(key, "start", task_id=a.id), 20,
                       what="the time-limited task to start")
    b = h.app.tasks["pf.hold"].delay(key, 0.5)
    freed = h.wait_owner_not(name, start_a["owner"], timeout=15)
    # The limit counts from when the child accepted the job, a little before the body
    # started: this slightly over-states the delay.
    limit_to_free = freed - (start_a["time"] + 1.0)
    start_b = wait_for(lambda: h.hold_event(key, "start", task_id=b.id), 15,
                       what="the second task to start")
    print(f"\nhard time limit (1 s) -> lock freed: ~{limit_to_free * 1000:.0f} ms; "
          f"-> second task running: "
          f"~{(start_b['time'] - start_a['time'] - 1.0) * 1000:.0f} ms")
    assert limit_to_free < PROMPT  # expiry: >= 6.7 s (ttl 10, renewed every 3.3 s)
    with pytest.raises(TimeLimitExceeded):
        a.get(timeout=10)
    assert b.get(timeout=15) >= 0.5
    assert h.hold_event(key, "end", task_id=a.id) is None  # the body never finished
    end_b = h.hold_event(key, "end", task_id=b.id)
    assert end_b is not None and end_b["owned"] is True
    assert h.lock_keys_left() == []


# -- 5. revoke(terminate=True, signal="SIGKILL") ---------------------------------------


def test_revoke_terminate_frees_lock_promptly(harness: Harness) -> None:
    h = harness
    h.start_workers(count=1, concurrency=4)
    hold = h.app.tasks["pf.hold"]
    key, name = "revoke", "hold:revoke"
    a = hold.delay(key, 60)
    start_a = wait_for(lambda: h.hold_event(key, "start", task_id=a.id), 20,
                       what="the task to start")
    b = hold.delay(key, 0.5)
    queue = LockKeys.for_name(h.prefix, name).queue
    wait_for(lambda: h.r.zcard(queue) >= 1, 20, what="the second task to wait")
    pttl_ms = h.r.pttl(h.lock_key(name))
    revoked = time.time()
    h.app.control.revoke(a.id, terminate=True, signal="SIGKILL")
    freed = h.wait_owner_not(name, start_a["owner"], timeout=15)
    print(f"\nrevoke(terminate=True, SIGKILL) -> lock freed: "
          f"{(freed - revoked) * 1000:.0f} ms (ttl left was {pttl_ms} ms)")
    assert freed - revoked < min(PROMPT, pttl_ms / 1000 - 1.0)
    assert b.get(timeout=15) >= 0.5
    assert wait_for(lambda: a.state == "REVOKED", 10, what="REVOKED state")
    assert h.hold_event(key, "end", task_id=a.id) is None
    assert h.lock_keys_left() == []


# -- 6. retries from inside a locked task ----------------------------------------------


@pytest.mark.parametrize("task_name,kind", [("pf.retrying", "retry"),
                                            ("pf.autoretrying", "autoretry")])
def test_retry_inside_locked_task_runs_and_does_not_leak(harness: Harness,
                                                         task_name: str,
                                                         kind: str) -> None:
    h = harness
    h.start_workers(count=1, concurrency=4)
    key, times = "r1", 3
    res = h.app.tasks[task_name].delay(key, times)
    assert res.get(timeout=60) == times
    # The lock is released before the result is stored: nothing may be left now.
    assert h.lock_keys_left() == []
    runs = h.records(kind, key)
    assert [x["retries"] for x in runs] == list(range(times + 1))
    assert all(x["task_id"] == res.id and x["owned"] for x in runs), runs
    fences = [x["fence"] for x in runs]
    assert fences == sorted(fences) and len(set(fences)) == len(fences), fences
    print(f"\n{task_name}: {times} retries, attempts took the lock with fences {fences}, "
          f"{(runs[-1]['time'] - runs[0]['time']) * 1000:.0f} ms first to last")


# -- 7. the same task id delivered twice -----------------------------------------------


def test_same_task_id_twice_never_overlaps(harness: Harness) -> None:
    h = harness
    h.start_workers(count=1, concurrency=4)
    interval = h.app.tasks["pf.interval"]
    key, task_id = "twice", str(uuid.uuid4())
    interval.apply_async((key, 2.0), task_id=task_id)
    interval.apply_async((key, 2.0), task_id=task_id)
    runs = wait_for(lambda: (x := h.records("iv", key)) and len(x) >= 2 and x, 30,
                    0.05, "both deliveries to run")
    time.sleep(0.5)
    runs = h.records("iv", key)
    print(f"\nsame task id twice: runs (start, end): {spans(runs)}")
    assert len(runs) == 2
    assert all(x["task_id"] == task_id and x["owned"] for x in runs), runs
    assert_disjoint(runs)
    assert runs[0]["fence"] != runs[1]["fence"]
    wait_for(lambda: h.lock_keys_left() == [], 5, what="the lock to be released")


# -- 8. warm shutdown ------------------------------------------------------------------


def test_warm_shutdown_finishes_task_and_leaves_no_lock(harness: Harness) -> None:
    h = harness
    (worker,) = h.start_workers(count=1, concurrency=4)
    key, name = "shutdown", "hold:shutdown"
    a = h.app.tasks["pf.hold"].delay(key, 3.0)
    wait_for(lambda: h.hold_event(key, "start", task_id=a.id), 20,
             what="the task to start")
    assert h.owner(name) is not None
    took = worker.stop(signal.SIGTERM, timeout=30.0)
    print(f"\nwarm shutdown with a 3 s locked task running: worker exited after "
          f"{took:.2f} s, code {worker.proc.returncode}")
    assert took != float("inf"), "the worker did not shut down within 30 s"
    end = h.hold_event(key, "end", task_id=a.id)
    assert end is not None and end["owned"] is True, "the task did not finish"
    assert AsyncResult(a.id, app=h.app).get(timeout=5) >= 3.0
    assert h.lock_keys_left() == []  # ttl is 10 s: only a release explains this
    assert worker.proc.returncode == 0

