"""LockedTask on a real in-process worker (threads pool) and a real Redis.

Processes (fork, SIGKILL, time limits, shutdown) are covered by test_prefork.py; here
the worker runs in this process, which is enough for keys, policies, re-entry, retries,
signals and the lost-lock path.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Ignore, Reject
from celery_helpers import close_app, needs_inprocess_eta
from task_env import new_app

from celery_dlock import (
    BackendUnavailable,
    InvalidLockConfig,
    LockedTask,
    LockLost,
    LockNotAcquired,
    RedisLock,
    is_skipped,
    signals,
)

RESULT_TIMEOUT = 30


def _events(r: redis.Redis, key: str) -> list[Any]:
    return [json.loads(x) for x in r.lrange(key, 0, -1)]


def _wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[SimpleNamespace]:
    made = new_app(redis_url)
    app, r, prefix = made.app, made.r, made.prefix
    ev = f"{prefix}:events"

    def log(**fields: Any) -> None:
        r.rpush(ev, json.dumps(fields))

    def lock_count(key: str) -> int:
        return int(r.hget(f"{prefix}:{{{key}}}", "count") or 0)

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}")
    def interval(self, x, seconds=0.5, tag=""):
        start = time.time()
        log(kind="interval", x=x, tag=tag, start=start, fence=self.lock.fence,
            owned=self.lock.owned(), retries=self.request.retries,
            contention=getattr(self.request, "dlock_contention_retries", None))
        time.sleep(seconds)
        log(kind="end", x=x, tag=tag, start=start, end=time.time())
        return tag

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}",
              on_contention="skip")
    def skipper(self, x):
        log(kind="skipper-ran", x=x)
        return "ran"

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}",
              on_contention="raise")
    def raiser(self, x):
        log(kind="raiser-ran", x=x)
        return "ran"

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}",
              on_contention="wait",
              lock_wait=20)
    def waiter(self, x):
        return {"fence": self.lock.fence, "at": time.time()}

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}",
              max_retries=0)
    def patient(self, x):
        return {"retries": self.request.retries,
                "contention": getattr(self.request, "dlock_contention_retries", 0)}

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}",
              lock_retry_max=2)
    def bounded(self, x):
        return "ran"

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}")
    def nested(self, x, depth=2):
        log(kind="nested", depth=depth, count=lock_count(f"k:{x}"),
            fence=self.lock.fence if self.lock else None)
        if depth == 2:
            nested(x, depth=1)  # direct call: same attempt
        elif depth == 1:
            nested.apply(args=(x,), kwargs={"depth": 0}).get()  # eager: same attempt
            with RedisLock(r, f"k:{x}", prefix=prefix):  # a plain lock in the body
                log(kind="plain", count=lock_count(f"k:{x}"))
        return depth

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}",
              default_retry_delay=0.1)
    def retrier(self, x):
        log(kind="retrier", retries=self.request.retries, count=lock_count(f"k:{x}"))
        if self.request.retries < 2:
            raise self.retry(countdown=0)
        return self.request.retries

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}",
              autoretry_for=(ValueError,), retry_kwargs={"max_retries": 2,
                                                         "countdown": 0})
    def autoretrier(self, x):
        log(kind="autoretrier", retries=self.request.retries)
        if self.request.retries < 2:
            raise ValueError("flaky")
        return "done"

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}")
    def ender(self, x, how):
        log(kind="ender", how=how)
        if how == "ignore":
            raise Ignore()
        if how == "reject":
            raise Reject("no", requeue=False)
        raise RuntimeError("boom")

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}",
              lock_ttl=0.6)
    def loses(self, x):
        # Someone deletes our lock and takes it: renewal must notice.
        r.delete(f"{prefix}:{{k:{x}}}")
        other = RedisLock(r, f"k:{x}", prefix=prefix, owner="thief", auto_renew=False,
                          ttl=30)
        other.acquire()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                self.lock.ensure_held()
            except LockLost:
                log(kind="lost-seen", owned=self.lock.owned())
                return "noticed"
            time.sleep(0.05)
        return "never noticed"

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}",
              lock_ttl=0.6,
              lock_lost_action="interrupt")
    def interrupted(self, x):
        r.delete(f"{prefix}:{{k:{x}}}")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.02)
        log(kind="not-interrupted")
        return "ran to the end"

    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False,
                      shutdown_timeout=20):
        tasks = SimpleNamespace(
            interval=interval, skipper=skipper, raiser=raiser, waiter=waiter,
            patient=patient, bounded=bounded, nested=nested, retrier=retrier,
            autoretrier=autoretrier, ender=ender, loses=loses, interrupted=interrupted)
        yield SimpleNamespace(app=app, r=r, prefix=prefix, ev=ev, log=log, tasks=tasks)
    close_app(app)
    r.close()


def _key(env: SimpleNamespace, x: str) -> str:
    return f"{env.prefix}:{{k:{x}}}"


def _hold(env: SimpleNamespace, x: str, **kwargs: Any) -> RedisLock:
    lock = RedisLock(env.r, f"k:{x}", prefix=env.prefix, owner="test-holder",
                     info={"task_id": "holder-task"}, **kwargs)
    assert lock.acquire(blocking=False)
    return lock


def _x() -> str:
    return uuid.uuid4().hex[:8]


# -- the attempt holds the lock -------------------------------------------------------

def test_body_holds_the_lock_and_releases_it(env):
    x = _x()
    assert env.tasks.interval.delay(x, 0.1, "a").get(timeout=RESULT_TIMEOUT) == "a"
    started = [e for e in _events(env.r, env.ev) if e.get("x") == x
               and e["kind"] == "interval"]
    assert started[0]["owned"] is True
    assert isinstance(started[0]["fence"], int)
    assert not env.r.exists(_key(env, x))


def test_task_declares_its_lock_name(env):
    assert env.tasks.interval.lock_name((5,), {}) == "k:5"
    assert env.tasks.interval.lock_name((), {"x": 5, "seconds": 2}) == "k:5"


@needs_inprocess_eta
def test_runs_of_one_key_never_overlap_and_all_run(env):
    x = _x()
    results = [env.tasks.interval.delay(x, 0.3, f"r{i}") for i in range(3)]
    got = sorted(res.get(timeout=RESULT_TIMEOUT) for res in results)
    assert got == ["r0", "r1", "r2"]
    runs = sorted((e["start"], e["end"]) for e in _events(env.r, env.ev)
                  if e.get("x") == x and e["kind"] == "end")
    assert len(runs) == 3
    for (_, end), (start, _) in itertools.pairwise(runs):
        assert start >= end


def test_fences_increase_across_runs(env):
    x = _x()
    for tag in ("a", "b"):
        env.tasks.interval.delay(x, 0.0, tag).get(timeout=RESULT_TIMEOUT)
    fences = [e["fence"] for e in _events(env.r, env.ev)
              if e.get("x") == x and e["kind"] == "interval"]
    assert len(fences) == 2 and fences[1] > fences[0]


def test_redelivery_of_the_same_task_id_is_contention_not_reentry(env):
    # A second delivery contends (it does not re-enter the first one's hold) and,
    # finding its own task id holding the lock, is a duplicate: it never runs.
    # More in test_task_redelivery.py.
    x = _x()
    task_id = str(uuid.uuid4())
    first = env.tasks.interval.apply_async((x, 0.8, "first"), task_id=task_id)
    assert _wait_for(lambda: env.r.exists(_key(env, x)))
    env.tasks.interval.apply_async((x, 0.1, "second"), task_id=task_id)
    assert first.get(timeout=RESULT_TIMEOUT) == "first"
    time.sleep(0.5)
    tags = [e["tag"] for e in _events(env.r, env.ev)
            if e.get("x") == x and e["kind"] == "interval"]
    assert tags == ["first"], "the duplicate delivery ran the body"


def test_nested_calls_in_one_attempt_reenter(env):
    x = _x()
    assert env.tasks.nested.delay(x).get(timeout=RESULT_TIMEOUT) == 2
    events = _events(env.r, env.ev)
    counts = [e["count"] for e in events if e["kind"] == "nested"][-3:]
    assert counts == [1, 2, 3]
    fences = {e["fence"] for e in events if e["kind"] == "nested"}
    assert len(fences) == 1 and None not in fences
    assert [e["count"] for e in events if e["kind"] == "plain"][-1] == 3
    assert not env.r.exists(_key(env, x))


# -- contention policies --------------------------------------------------------------

def test_skip_returns_a_result_that_names_the_holder(env):
    x = _x()
    holder = _hold(env, x)
    try:
        result = env.tasks.skipper.delay(x).get(timeout=RESULT_TIMEOUT)
    finally:
        holder.release()
    assert is_skipped(result)
    assert result["lock"] == f"k:{x}"
    assert result["holder"]["owner"] == "test-holder"
    assert result["holder"]["task_id"] == "holder-task"
    assert result["reason"] == "lock held elsewhere"
    # what a person reads, not the scripts' bookkeeping; numbers as numbers
    assert not {"ops", "prev"} & set(result["holder"])
    assert isinstance(result["holder"]["pid"], int)
    assert isinstance(result["holder"]["fence"], int)
    assert not [e for e in _events(env.r, env.ev) if e["kind"] == "skipper-ran"
                and e["x"] == x]


def test_a_skip_is_one_log_line_that_names_the_lock_and_its_holder(env, caplog):
    x = _x()
    holder = _hold(env, x)
    try:
        with caplog.at_level("INFO", logger="celery_dlock"):
            result = env.tasks.skipper.apply_async((x,))
            result.get(timeout=RESULT_TIMEOUT)
    finally:
        holder.release()
    (line,) = [r.getMessage() for r in caplog.records
               if r.name.startswith("celery_dlock") and result.id in r.getMessage()]
    assert f"skipped: lock 'k:{x}' is held by task ?[holder-task]" in line, line


def test_skip_on_a_free_lock_runs_the_body(env):
    assert env.tasks.skipper.delay(_x()).get(timeout=RESULT_TIMEOUT) == "ran"


def test_raise_fails_with_lock_not_acquired_and_holder_info(env):
    x = _x()
    holder = _hold(env, x)
    try:
        with pytest.raises(LockNotAcquired) as info:
            env.tasks.raiser.delay(x).get(timeout=RESULT_TIMEOUT)
    finally:
        holder.release()
    assert "holder-task" in str(info.value)
    assert "ttl left" in str(info.value)


def test_wait_wakes_on_release(env):
    x = _x()
    holder = _hold(env, x)
    result = env.tasks.waiter.delay(x)
    time.sleep(0.5)  # the task is now blocked in line
    released_at = time.time()
    holder.release()
    got = result.get(timeout=RESULT_TIMEOUT)
    # Woken by the release, long before the 30 s ttl or the 20 s wait could end.
    assert got["at"] - released_at < 5.0
    assert got["fence"] > 0


@needs_inprocess_eta
def test_retry_does_not_consume_max_retries(env):
    x = _x()
    holder = _hold(env, x)
    result = env.tasks.patient.delay(x)
    time.sleep(0.6)
    holder.release()
    got = result.get(timeout=RESULT_TIMEOUT)
    assert got["retries"] == 0  # max_retries=0 and still it ran
    assert got["contention"] >= 1


@needs_inprocess_eta
def test_retry_gives_up_after_its_bound(env):
    x = _x()
    holder = _hold(env, x)
    try:
        with pytest.raises(LockNotAcquired, match="gave up after 2 contention retries"):
            env.tasks.bounded.delay(x).get(timeout=RESULT_TIMEOUT)
    finally:
        holder.release()


@needs_inprocess_eta
def test_each_contention_retry_is_one_log_line(env, caplog):
    """Celery logs each retry ("retry: Retry in ...s: LockNotAcquired(...)"); the lock
    adds no second INFO line of its own."""
    x = _x()
    holder = _hold(env, x)
    try:
        with caplog.at_level("DEBUG"):
            result = env.tasks.bounded.delay(x)
            with pytest.raises(LockNotAcquired):
                result.get(timeout=RESULT_TIMEOUT)
    finally:
        holder.release()
    lines = [r.getMessage() for r in caplog.records
             if r.levelno >= 20 and result.id in r.getMessage()
             and ("retry" in r.getMessage().lower() or "re-queued" in r.getMessage())]
    assert len(lines) == 2, lines  # lock_retry_max=2: two retries, a line each


# -- however the attempt ends, the lock is released -----------------------------------

def test_self_retry_releases_and_the_retry_runs(env):
    x = _x()
    assert env.tasks.retrier.delay(x).get(timeout=RESULT_TIMEOUT) == 2
    runs = [e for e in _events(env.r, env.ev) if e["kind"] == "retrier"][-3:]
    assert [e["retries"] for e in runs] == [0, 1, 2]
    assert all(e["count"] == 1 for e in runs)  # never re-entered a leaked hold
    assert not env.r.exists(_key(env, x))


def test_autoretry_releases_and_the_retry_runs(env):
    x = _x()
    assert env.tasks.autoretrier.delay(x).get(timeout=RESULT_TIMEOUT) == "done"
    assert not env.r.exists(_key(env, x))


@pytest.mark.parametrize("how", ["ignore", "reject", "error"])
def test_ignore_reject_and_errors_release(env, how):
    x = _x()
    result = env.tasks.ender.delay(x, how)
    if how == "error":
        with pytest.raises(RuntimeError):
            result.get(timeout=RESULT_TIMEOUT)
    assert _wait_for(lambda: any(e["kind"] == "ender" and e["how"] == how
                                 for e in _events(env.r, env.ev)))
    assert _wait_for(lambda: not env.r.exists(_key(env, x)))
    # and the next run of the key is not blocked
    assert env.tasks.skipper.delay(x).get(timeout=RESULT_TIMEOUT) == "ran"


# -- signals and the lost lock --------------------------------------------------------

def test_signals_report_acquire_contention_and_release(env):
    x = _x()
    seen: list[tuple[str, dict[str, Any]]] = []

    def record(name: str) -> Any:
        def receiver(sender: Any, **kw: Any) -> None:
            if kw.get("name") == f"k:{x}":
                seen.append((name, kw))
        return receiver

    receivers = {s: record(n) for s, n in ((signals.lock_acquired, "acquired"),
                                           (signals.lock_contended, "contended"),
                                           (signals.lock_released, "released"))}
    for sig, fn in receivers.items():
        sig.connect(fn, weak=False)
    try:
        env.tasks.interval.delay(x, 0.0, "s").get(timeout=RESULT_TIMEOUT)
        holder = _hold(env, x)
        env.tasks.skipper.delay(x).get(timeout=RESULT_TIMEOUT)
        holder.release()
    finally:
        for sig, fn in receivers.items():
            sig.disconnect(fn)
    names = [n for n, _ in seen]
    assert names[:2] == ["acquired", "released"]
    assert "contended" in names
    released = dict(seen)["released"]
    assert released["state"] == "SUCCESS" and released["held_for"] >= 0
    contended = dict(seen)["contended"]
    assert contended["policy"] == "skip"
    assert contended["holder"].owner == "test-holder"


def test_lost_lock_fires_the_signal_and_ensure_held_raises(env):
    x = _x()
    lost: list[dict[str, Any]] = []

    def on_lost(sender: Any, **kw: Any) -> None:
        if kw.get("name") == f"k:{x}":
            lost.append(kw)

    signals.lock_lost.connect(on_lost, weak=False)
    try:
        # The body noticed; the attempt still fails (lock_lost_action="fail").
        with pytest.raises(LockLost, match="was lost while the task ran"):
            env.tasks.loses.delay(x).get(timeout=RESULT_TIMEOUT)
    finally:
        signals.lock_lost.disconnect(on_lost)
    seen = [e for e in _events(env.r, env.ev) if e["kind"] == "lost-seen"][-1]
    assert seen["owned"] is False
    # the thief's hold is untouched: a lost lock is never re-created or released
    assert env.r.hget(_key(env, x), "owner") == b"thief"
    env.r.delete(_key(env, x))
    assert _wait_for(lambda: len(lost) == 1, timeout=5)
    assert lost[0]["reason"]


def test_lost_lock_interrupts_the_task_when_asked(env):
    x = _x()
    with pytest.raises(LockLost):
        env.tasks.interrupted.delay(x).get(timeout=RESULT_TIMEOUT)
    assert not [e for e in _events(env.r, env.ev) if e["kind"] == "not-interrupted"]


# -- declaration-time errors ----------------------------------------------------------

def _declare(**options: Any) -> Any:
    app = Celery("decl", set_as_current=False, broker="redis://127.0.0.1:1/0")

    def f(self, product_id, qty=1):
        return None

    task = app.task(base=LockedTask, shared=False, bind=True, **options)(f)
    app.finalize()
    return task.name  # evaluates the task


def test_unknown_template_field_fails_at_declaration():
    with pytest.raises(InvalidLockConfig, match="product"):
        _declare(lock_key="stock:{product}")


@pytest.mark.parametrize("options", [{"lock_ttl": 0}, {"lock_ttl": -1},
                                     {"on_contention": "sometimes"},
                                     {"lock_args": ("nope",)},
                                     {"lock_lost_action": "explode"}])
def test_bad_options_fail_at_declaration(options):
    with pytest.raises(InvalidLockConfig):
        _declare(**options)


# -- Redis unreachable ----------------------------------------------------------------

@pytest.fixture
def down_app(redis_url: str) -> Celery:
    app = Celery("down", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.dlock_url = "redis://127.0.0.1:1/0"
    app.conf.dlock_redis_options = {"socket_connect_timeout": 0.5}
    return app


def test_redis_down_fails_closed(down_app):
    ran: list[int] = []

    @down_app.task(base=LockedTask, shared=False, lock_key="k:{x}", on_contention="raise")
    def guarded(x):
        ran.append(x)

    with pytest.raises(BackendUnavailable):
        guarded.apply(args=(1,)).get()
    with pytest.raises(BackendUnavailable):
        guarded(2)
    assert ran == []


def test_redis_down_with_skip_policy_skips(down_app):
    @down_app.task(base=LockedTask, shared=False, lock_key="k:{x}", on_contention="skip")
    def guarded(x):
        return "ran"

    result = guarded(1)
    assert is_skipped(result) and result["reason"] == "lock store unavailable"


def test_redis_down_fail_open_runs_unlocked(down_app):
    down_app.conf.dlock_fail_open = True

    @down_app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}")
    def guarded(self, x):
        return ("ran", self.lock)

    assert guarded(1) == ("ran", None)
