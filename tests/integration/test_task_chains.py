"""A skipped link ends its chain at once; an eager run is an attempt of its own.

Chains run on an in-process worker (threads pool), eager runs in the test's thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import chain
from celery_helpers import close_app
from task_env import TaskEnv, new_app, running

from celery_dlock import LockedTask, LockNotAcquired, RedisLock, is_skipped

RESULT_TIMEOUT = 15


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[TaskEnv]:
    e = new_app(redis_url)

    @e.app.task(base=LockedTask, shared=False, bind=True, lock_key="c:{x}",
                on_contention="skip")
    def locked(self: Any, x: str) -> str:
        e.log(kind="locked", x=x)
        return f"locked:{x}"

    @e.app.task(shared=False)
    def plain(value: Any, tag: str = "") -> str:
        e.log(kind="plain", tag=tag)
        return f"plain({value})"

    @e.app.task(base=LockedTask, shared=False, bind=True, lock_key="c:{x}",
                on_contention="raise")
    def raiser(self: Any, x: str) -> str:
        return f"raiser:{x}"

    e.tasks.update(locked=locked, plain=plain, raiser=raiser)
    with running(e):
        yield e


# -- item 3: a skip inside a chain ------------------------------------------------------


def test_skip_in_a_chain_ends_the_chain_at_once(env: TaskEnv) -> None:
    x = f"x{time.monotonic_ns()}"
    holder = env.hold(f"c:{x}")
    try:
        res = chain(env.tasks["locked"].s(x), env.tasks["plain"].s(tag=x)).apply_async()
        started = time.monotonic()
        got = res.get(timeout=RESULT_TIMEOUT)
        took = time.monotonic() - started
    finally:
        holder.release()
    print(f"\nskip in a chain: get() returned in {took:.2f} s: {got}")
    assert is_skipped(got), got
    assert got["lock"] == f"c:{x}" and got["holder"]["owner"] == "test-holder"
    assert res.parent.get(timeout=1) == got  # the skipped link's own result
    assert not env.events(kind="plain", tag=x), "a link after the skip ran"
    assert not env.events(kind="locked", x=x)
    assert took < 5.0


def test_skip_in_the_middle_of_a_chain(env: TaskEnv) -> None:
    x = f"m{time.monotonic_ns()}"
    holder = env.hold(f"c:{x}")
    plain = env.tasks["plain"]
    try:
        res = chain(plain.si("a", tag=f"{x}-1"), env.tasks["locked"].si(x),
                    plain.s(tag=f"{x}-3"), plain.s(tag=f"{x}-4")).apply_async()
        got = res.get(timeout=RESULT_TIMEOUT)
    finally:
        holder.release()
    assert is_skipped(got), got
    assert env.events(kind="plain", tag=f"{x}-1")
    assert not env.events(kind="plain", tag=f"{x}-3")
    assert not env.events(kind="plain", tag=f"{x}-4")
    assert res.parent.get(timeout=1) == got


def test_raise_in_a_chain_fails_the_chain_at_once(env: TaskEnv) -> None:
    x = f"r{time.monotonic_ns()}"
    holder = env.hold(f"c:{x}")
    try:
        res = chain(env.tasks["raiser"].s(x), env.tasks["plain"].s(tag=x)).apply_async()
        with pytest.raises(LockNotAcquired):
            res.get(timeout=RESULT_TIMEOUT)
    finally:
        holder.release()
    assert not env.events(kind="plain", tag=x)


def test_a_chain_whose_lock_is_free_runs_through(env: TaskEnv) -> None:
    x = f"f{time.monotonic_ns()}"
    res = chain(env.tasks["locked"].s(x), env.tasks["plain"].s(tag=x)).apply_async()
    assert res.get(timeout=RESULT_TIMEOUT) == f"plain(locked:{x})"


# -- item 12: eager runs ----------------------------------------------------------------


@pytest.fixture
def eager(redis_url: str) -> Iterator[TaskEnv]:
    e = new_app(redis_url, task_always_eager=True, task_eager_propagates=True)

    @e.app.task(base=LockedTask, shared=False, bind=True, lock_key="eager:{x}",
                on_contention="raise")
    def guarded(self: Any, x: str, depth: int = 0) -> int:
        e.log(kind="guarded", x=x, depth=depth,
              count=int(e.r.hget(e.lock_key(f"eager:{x}"), "count") or 0))
        if depth > 0:
            return int(guarded.delay(x, depth - 1).get(disable_sync_subtasks=False))
        return depth

    e.tasks["guarded"] = guarded
    yield e
    close_app(e.app)
    e.r.close()


def test_eager_run_from_plain_code_contends_with_the_callers_lock(eager: TaskEnv) -> None:
    with RedisLock(eager.r, "eager:x", prefix=eager.prefix), \
            pytest.raises(LockNotAcquired):
        eager.tasks["guarded"].delay("x")
    assert not eager.events(kind="guarded", x="x"), "the body re-entered the lock"
    assert eager.tasks["guarded"].delay("x").get() == 0  # free again: it runs


def test_eager_run_from_another_thread_contends_too(eager: TaskEnv) -> None:
    errors: list[BaseException] = []
    with RedisLock(eager.r, "eager:y", prefix=eager.prefix):
        def call() -> None:
            try:
                eager.tasks["guarded"].delay("y")
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=call)
        t.start()
        t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], LockNotAcquired)


def test_eager_calls_inside_a_running_attempt_reenter(eager: TaskEnv) -> None:
    assert eager.tasks["guarded"].delay("z", 2).get() == 0
    counts = [e["count"] for e in eager.events(kind="guarded", x="z")]
    assert counts == [1, 2, 3]
    assert not eager.r.exists(eager.lock_key("eager:z"))


def test_direct_call_from_plain_code_reenters_the_callers_lock(eager: TaskEnv) -> None:
    with RedisLock(eager.r, "eager:d", prefix=eager.prefix):
        assert eager.tasks["guarded"]("d") == 0
    assert [e["count"] for e in eager.events(kind="guarded", x="d")] == [2]
