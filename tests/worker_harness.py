"""Real ``celery worker`` subprocesses for tests: start, wait until ready, stop.

Each :class:`Harness` has its own queue and key prefix (see :mod:`prefork_app`), starts
its own workers and always stops them; when a test fails, the tail of each worker's log
is written to the terminal.
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
from celery_helpers import close_lock_clients
from dlock_helpers import release_marker
from prefork_app import ENV_NODE, ENV_PREFIX, ENV_QUEUE, ENV_URL, data_prefix, make_app

from celery_dlock.backends.redis.keyspace import LockKeys

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

    def start_worker(self, concurrency: int = 4, pool: str = "prefork") -> Worker:
        label = f"w{len(self.workers) + 1}-{self.run_id}"
        log = self.tmp_path / f"{label}.log"
        env = dict(os.environ)
        env.update({
            ENV_URL: self.url,
            ENV_PREFIX: self.prefix,
            ENV_QUEUE: self.queue,
            ENV_NODE: f"{label}@%h",
            "PYTHONPATH": os.pathsep.join(
                [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "PYTHONUNBUFFERED": "1",
        })
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.prefork_app", "worker",
                 f"--pool={pool}", "-c", str(concurrency), "-Q", self.queue,
                 "-n", env[ENV_NODE], "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "-l", "info"],
                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        # Only prefork children announce themselves (worker_process_init).
        worker = Worker(proc, label, log, concurrency if pool == "prefork" else 0)
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

    def start_workers(self, count: int = 1, concurrency: int = 4,
                      pool: str = "prefork") -> list[Worker]:
        workers = [self.start_worker(concurrency, pool) for _ in range(count)]
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
        close_lock_clients(self.app)
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
        expire, by design) and a semaphore's release markers (short-lived, so that a
        re-sent release is recognised; each must carry its TTL): a lock's release
        leaves nothing else behind."""
        keys = [k.decode() for k in self.r.scan_iter(match=f"{self.prefix}:*",
                                                       count=1000)]
        left = []
        for k in keys:
            if k.endswith(":fence"):
                continue
            if release_marker(k):
                assert 0 < self.r.pttl(k) <= 60_000, f"release marker {k} has no TTL"
                continue
            left.append(k)
        return sorted(left)

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


def open_harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
                 request: pytest.FixtureRequest) -> Iterator[Harness]:
    """The body of a ``harness`` fixture: yields a Harness, closes it afterwards."""
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
