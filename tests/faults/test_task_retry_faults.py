"""Retries from inside a locked task: the attempt keeps its lock until it has fully
unwound, the retried attempt never overlaps it, and the contention budget counts one
episode of contention at a time.

Overlap is a matter of processes: those tests run real ``celery worker`` subprocesses
(prefork); the budget is bookkeeping, tested on the in-process worker.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery_helpers import needs_inprocess_eta
from task_env import TaskEnv, new_app, running
from worker_harness import Harness, assert_disjoint, open_harness, spans, wait_for

from celery_dlock import LockedTask, LockNotAcquired, RedisLock, signals
from celery_dlock.task.contention import CONTENTION_HEADER

RESULT_TIMEOUT = 60


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


# -- item 1: code after self.retry() runs locked, retries never overlap ------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fallback_and_finally_after_retry_run_locked_and_never_overlap(
        harness: Harness) -> None:
    """``max_retries=1``: attempt 0 retries (its ``finally`` sleeps 0.3 s), attempt 1
    exceeds the limit (its ``except MaxRetriesExceededError`` fallback and ``finally``
    sleep 0.3 s each); another call on the same key is sent with it (whichever runs
    first, none may overlap another)."""
    h = harness
    h.start_workers(count=1, concurrency=3)
    key, cleanup = "fallback", 0.3
    res = h.app.tasks["pf.retry_unwind"].delay(key, cleanup)
    other = h.app.tasks["pf.unwind_other"].delay(key, 0.05)
    assert res.get(timeout=RESULT_TIMEOUT) == "fallback"
    assert other.get(timeout=RESULT_TIMEOUT) == "other"
    runs = h.records("runs", key)
    print(f"\nretry unwind: runs {[(x['kind'], x['retries']) for x in runs]} "
          f"spans {spans(runs)}")
    kinds = sorted((x["kind"], x["retries"]) for x in runs)
    assert kinds == [("attempt", 0), ("attempt", 1), ("fallback", 1), ("other", 0)]
    assert all(x["owned"] for x in runs), f"code ran without its lock: {runs}"
    # One interval per attempt: from its start to the end of its finally block.
    attempts = [x for x in runs if x["kind"] in ("attempt", "other")]
    assert_disjoint(attempts)
    wait_for(lambda: h.lock_keys_left() == [], 5, what="the lock to be released")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_autoretry_attempts_run_locked_and_never_overlap(harness: Harness) -> None:
    h = harness
    h.start_workers(count=1, concurrency=3)
    key = "auto"
    res = h.app.tasks["pf.autoretry_unwind"].delay(key, 0.3)
    other = h.app.tasks["pf.unwind_other"].delay(key, 0.05)
    with pytest.raises(Exception, match="attempt 1"):
        res.get(timeout=RESULT_TIMEOUT)
    assert other.get(timeout=RESULT_TIMEOUT) == "other"
    runs = h.records("runs", key)
    print(f"\nautoretry unwind: spans {spans(runs)}")
    assert sorted((x["kind"], x["retries"]) for x in runs) == [
        ("attempt", 0), ("attempt", 1), ("other", 0)]
    assert all(x["owned"] for x in runs), runs
    assert_disjoint(runs)


# -- item 14: the contention budget counts one episode ----------------------------------


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[TaskEnv]:
    """One in-process worker for the module (two at once in a process share Celery's
    worker state)."""
    e = new_app(redis_url, dlock_retry_backoff=0.3, dlock_retry_backoff_max=0.3)

    @e.app.task(base=LockedTask, shared=False, bind=True, lock_key="b:{x}",
                lock_retry_max=3, max_retries=3)
    def budgeted(self: Any, x: str) -> int:
        e.log(kind="budgeted", x=x, retries=self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=1.0)
        return int(self.request.retries)

    e.tasks["budgeted"] = budgeted

    for policy in ("skip", "raise"):
        def body(self: Any, x: str) -> int:
            e.log(kind="start", x=x, retries=self.request.retries, t=time.time(),
                  contention=getattr(self.request, CONTENTION_HEADER, None))
            if self.request.retries == 0:
                try:
                    raise self.retry(countdown=0)
                finally:
                    time.sleep(0.5)  # the retry arrives meanwhile
                    e.log(kind="unwound", x=x, t=time.time(), owned=self.lock.owned())
            return int(self.request.retries)

        e.tasks[policy] = e.app.task(base=LockedTask, shared=False, bind=True,
                                     name=f"unwinding_{policy}", lock_key="u:{x}",
                                     on_contention=policy, max_retries=1)(body)
    with running(e, concurrency=3):
        yield e


def _contentions(seen: list[dict[str, Any]], task_id: str) -> int:
    return sum(1 for kw in seen if kw.get("task_id") == task_id)


@needs_inprocess_eta
def test_contention_budget_resets_once_the_body_has_ran(env: TaskEnv) -> None:
    x = uuid.uuid4().hex[:8]
    seen: list[dict[str, Any]] = []

    def on_contended(sender: Any, **kw: Any) -> None:
        if kw.get("name") == f"b:{x}":
            seen.append(kw)

    signals.lock_contended.connect(on_contended, weak=False)
    holder = RedisLock(env.r, f"b:{x}", prefix=env.prefix, owner="test-holder")
    try:
        assert holder.acquire(blocking=False)
        res = env.tasks["budgeted"].delay(x)
        assert wait_for(lambda: _contentions(seen, res.id) >= 2, 20,
                        what="two contentions")
        holder.release()
        # The body runs once and retries in 1 s: take the lock back before that.
        assert wait_for(lambda: env.events(kind="budgeted", x=x, retries=0), 20,
                        what="the body to run")
        assert holder.acquire(blocking=True, timeout=5)
        first_episode = _contentions(seen, res.id)
        assert wait_for(lambda: _contentions(seen, res.id) >= first_episode + 2, 20,
                        what="two more contentions")
        holder.release()
        try:
            got = res.get(timeout=RESULT_TIMEOUT)
        except LockNotAcquired as exc:
            pytest.fail(f"the budget of 3 spanned two episodes: {exc}")
    finally:
        signals.lock_contended.disconnect(on_contended)
        if holder.depth:
            holder.release()
    assert got == 1
    print(f"\ncontention budget: {_contentions(seen, res.id)} contentions over two "
          f"episodes with lock_retry_max=3")


@needs_inprocess_eta
def test_contention_budget_still_bounds_one_episode(env: TaskEnv) -> None:
    x = uuid.uuid4().hex[:8]
    holder = RedisLock(env.r, f"b:{x}", prefix=env.prefix, owner="test-holder")
    assert holder.acquire(blocking=False)
    try:
        with pytest.raises(LockNotAcquired, match="gave up after 3 contention retries"):
            env.tasks["budgeted"].delay(x).get(timeout=RESULT_TIMEOUT)
    finally:
        holder.release()


# -- a retry that finds its predecessor still unwinding ---------------------------------


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_retry_waits_for_its_predecessor_whatever_the_policy(env: TaskEnv,
                                                             policy: str) -> None:
    x = uuid.uuid4().hex[:8]
    assert env.tasks[policy].delay(x).get(timeout=RESULT_TIMEOUT) == 1
    (unwound,) = env.events(kind="unwound", x=x)
    assert unwound["owned"] is True
    (retried,) = env.events(kind="start", x=x, retries=1)
    assert retried["t"] >= unwound["t"]
    assert not retried["contention"], "waiting for the predecessor counted as contention"
