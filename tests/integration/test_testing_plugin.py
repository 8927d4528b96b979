"""``celery_dlock.testing``: the opt-in pytest plugin for users' tests.

First as a user has it: a small suite of a user's own (a conftest with
``pytest_plugins = ["celery_dlock.testing"]``, a module with a locked task, tests that
hold a key and assert a skip) run by ``pytester`` in a subprocess against the
session's Redis, passed in the environment.  Its tests that should pass pass, and
those that assert a wrong thing fail: the fixtures can fail a test.  Then each fixture
on its own.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app, test_app

from celery_dlock import (
    DroppedResult,
    LockedTask,
    LockLost,
    LockNotAcquired,
    RedisLock,
    is_skipped,
)
from celery_dlock.task.backend import backend_for
from celery_dlock.testing import EAGER_SETTINGS, Eager, EventLog, HeldLock, Holds

# The fixtures themselves come from tests/conftest.py, as a user's conftest loads them.
pytest_plugins = ["pytester"]

# -- a user's suite ---------------------------------------------------------------------

SHOP = '''
import os

from celery import Celery

from celery_dlock import LockedTask

app = Celery("shop", broker="memory://", set_as_current=False)
app.conf.dlock_url = os.environ["SHOP_REDIS_URL"]
app.conf.dlock_key_prefix = os.environ["SHOP_PREFIX"]


@app.task(base=LockedTask, bind=True, name="shop.reduce_stock",
          lock_key="stock:{product_id}")
def reduce_stock(self, product_id, qty=1):
    return {"product": product_id, "fence": self.lock.fence}
'''

SHOP_TESTS = '''
import pytest
import redis

from celery_dlock import LockNotAcquired, is_skipped
from shop import app, reduce_stock


def test_a_free_stock_runs_locked(dlock_eager, dlock_events):
    dlock_eager(app)
    assert reduce_stock.delay(42).get()["product"] == 42
    assert dlock_events.acquired("stock:42")
    assert dlock_events.released("stock:42", state="SUCCESS")
    assert not dlock_events.contended()


def test_a_held_stock_is_skipped(dlock_eager, dlock_hold, dlock_events):
    dlock_eager(app)
    with dlock_hold(app, "stock:42"):
        result = reduce_stock.apply_async((42,), on_contention="skip").get()
    assert is_skipped(result)
    assert result["holder"]["held_by"] == "dlock_hold"
    assert dlock_events.skipped("stock:42")
    assert not dlock_events.acquired("stock:42")


def test_a_held_stock_raises(dlock_eager, dlock_hold):
    dlock_eager(app)
    held = dlock_hold(reduce_stock, args=(7,))
    with pytest.raises(LockNotAcquired):
        reduce_stock.apply_async((7,), on_contention="raise")
    held.release()
    assert reduce_stock.delay(7).get()["product"] == 7


def test_fails_while_holding(dlock_hold):
    dlock_hold(app, "stock:99")
    raise RuntimeError("this test fails while it holds stock:99")


def test_the_failed_tests_hold_was_released(dlock_eager, dlock_hold):
    dlock_eager(app)
    assert reduce_stock.delay(99).get()["product"] == 99
    with dlock_hold(app, "stock:99"):
        pass


def test_a_wrong_expectation_fails(dlock_eager, dlock_hold, dlock_events):
    dlock_eager(app)
    with dlock_hold(app, "stock:5"):
        reduce_stock.apply_async((5,), on_contention="skip")
    assert dlock_events.acquired("stock:5")  # wrong: it was skipped


def test_a_redis_for_the_session(dlock_redis):
    assert redis.Redis.from_url(dlock_redis).ping()


def test_eager_settings_were_restored():
    assert app.conf.task_always_eager is False
    assert app.conf.get("dlock_enabled") is None
'''


@pytest.fixture
def user_suite(pytester: pytest.Pytester, redis_url: str, prefix: str,
               monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("SHOP_REDIS_URL", redis_url)
    monkeypatch.setenv("SHOP_PREFIX", prefix)
    monkeypatch.setenv("DLOCK_TEST_REDIS_URL", redis_url)  # dlock_redis: the same
    pytester.makeconftest('pytest_plugins = ["celery_dlock.testing"]\n')
    pytester.makepyfile(shop=SHOP, test_shop=SHOP_TESTS)
    return pytester


@pytest.mark.slow
def test_a_users_suite_passes_and_its_wrong_expectations_fail(
        user_suite: pytest.Pytester, r: redis.Redis, prefix: str) -> None:
    result = user_suite.runpytest_subprocess("-p", "no:cacheprovider", "-v",
                                             timeout=120)
    result.assert_outcomes(passed=6, failed=2)
    result.stdout.fnmatch_lines([
        "*test_fails_while_holding FAILED*",
        "*test_the_failed_tests_hold_was_released PASSED*",
        "*test_a_wrong_expectation_fails FAILED*",
    ])
    # The failing assert shows what was recorded: the skip, not an acquire.
    result.stdout.fnmatch_lines(["*contended 'stock:5' policy=skip*"])
    # No hold is left behind (a lock's hash is "<prefix>:{<name>}"; the fence
    # counters and the release markers beside it live on by design).
    left = [k.decode() for k in r.scan_iter(f"{prefix}:*")]
    assert left and [k for k in left if k.endswith("}")] == []


def test_dlock_redis_is_skipped_with_the_reason_when_there_is_no_server(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLOCK_TEST_REDIS_URL", raising=False)
    monkeypatch.setenv("DLOCK_REDIS_SERVER", "/nonexistent/redis-server")
    pytester.makeconftest('pytest_plugins = ["celery_dlock.testing"]\n')
    pytester.makepyfile(test_it="def test_it(dlock_redis):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs",
                                           timeout=60)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*dlock_redis: DLOCK_REDIS_SERVER=*not an executable*"])


def test_the_plugin_is_opt_in(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_it="def test_it(dlock_hold):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=60)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'dlock_hold' not found*"])
    plugins = importlib.metadata.entry_points(group="pytest11")
    assert not [p for p in plugins if p.value.startswith("celery_dlock")]


# -- each fixture on its own ------------------------------------------------------------

@pytest.fixture
def shop(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery("shop-direct", broker="memory://", set_as_current=False)
    app.conf.update(dlock_url=redis_url, dlock_key_prefix=prefix)

    @app.task(base=LockedTask, bind=True, shared=False, name="shop.buy",
              lock_key="stock:{sku}")
    def buy(self: Any, sku: Any, lose: bool = False) -> Any:
        if lose:  # an operator frees the lock while the body runs
            backend_for(self.app).force_release(prefix, self.lock.name)
            self.lock.ensure_held()
        return self.lock.fence if self.lock is not None else "unlocked"

    try:
        yield app
    finally:
        app.close()


def _key(prefix: str, name: str) -> str:
    return f"{prefix}:{{{name}}}"


def test_dlock_redis_answers(dlock_redis: str) -> None:
    client = redis.Redis.from_url(dlock_redis)
    try:
        assert client.ping()
    finally:
        client.close()


def test_dlock_hold_holds_the_name_on_the_apps_redis(
        shop: Celery, dlock_hold: Holds, r: redis.Redis, prefix: str) -> None:
    held = dlock_hold(shop, "stock:1")
    assert isinstance(held, HeldLock) and held.held and held.name == "stock:1"
    assert held.prefix == prefix and held.fence is not None
    owner = r.hget(_key(prefix, "stock:1"), "owner")
    assert owner is not None and owner.startswith(b"dlock_hold:")
    other = RedisLock(r, "stock:1", prefix=prefix, owner="someone-else")
    assert not other.acquire(blocking=False)
    held.release()
    held.release()  # nothing left: no error
    assert not held.held and held.fence is None and "released" in repr(held)
    assert other.acquire(blocking=False)
    other.release()


def test_dlock_hold_contends_with_the_calling_thread(
        shop: Celery, dlock_hold: Holds, dlock_eager: Eager) -> None:
    """Its owner is its own: a direct call from the test (the thread's owner) does
    not re-enter it."""
    dlock_eager(shop)
    with dlock_hold(shop, "stock:2"), pytest.raises(LockNotAcquired):
        shop.tasks["shop.buy"].apply_async((2,), on_contention="raise").get()
    with dlock_hold(shop, "stock:2"), pytest.raises(LockNotAcquired):
        shop.tasks["shop.buy"](2)


def test_dlock_hold_takes_the_tasks_prefix_and_call(
        redis_url: str, prefix: str, dlock_hold: Holds, r: redis.Redis) -> None:
    app = Celery("prefixed", broker="memory://", set_as_current=False)
    app.conf.update(dlock_url=redis_url, dlock_key_prefix=prefix)

    @app.task(base=LockedTask, shared=False, name="shop.ship",
              lock_key="ship:{order}", lock_prefix=f"{prefix}-own")
    def ship(order: int, express: bool = False) -> None:
        return None

    try:
        held = dlock_hold(ship, args=(3,))
        assert held.name == "ship:3" and held.prefix == f"{prefix}-own"
        assert r.exists(_key(f"{prefix}-own", "ship:3"))
        assert dlock_hold(ship, kwargs={"order": 4}).name == "ship:4"
        assert dlock_hold(ship, "ship:5", prefix=prefix).prefix == prefix
        assert dlock_hold(app, "ship:6").prefix == prefix  # the app's prefix
        with pytest.raises(TypeError, match="give the lock name"):
            dlock_hold(app)
    finally:
        app.close()


def test_dlock_hold_of_a_held_name_says_who_holds_it(
        shop: Celery, dlock_hold: Holds, r: redis.Redis, prefix: str) -> None:
    other = RedisLock(r, "stock:3", prefix=prefix, owner="someone-else")
    assert other.acquire(blocking=False)
    try:
        with pytest.raises(LockNotAcquired, match="someone-else"):
            dlock_hold(shop, "stock:3")
        started = time.monotonic()
        with pytest.raises(LockNotAcquired):
            dlock_hold(shop, "stock:3", timeout=0.3)
        assert time.monotonic() - started >= 0.25
    finally:
        other.release()
    assert dlock_hold(shop, "stock:3").held


def test_holds_are_released_whatever_state_they_are_in(
        shop: Celery, r: redis.Redis, prefix: str) -> None:
    holds = Holds(test="t")
    first, second, third = (holds(shop, f"stock:{n}") for n in (10, 11, 12))
    first.release()
    backend_for(shop).force_release(prefix, "stock:12")  # lost meanwhile
    assert [h.name for h in holds.held] == ["stock:11", "stock:12"]
    assert holds.release_all() == []
    assert not any(r.exists(_key(prefix, f"stock:{n}")) for n in (10, 11, 12))
    assert not second.held and not third.held and holds.held == []


def test_dlock_events_records_locks_skips_and_contention(
        shop: Celery, dlock_eager: Eager, dlock_hold: Holds,
        dlock_events: EventLog) -> None:
    dlock_eager(shop)
    buy = shop.tasks["shop.buy"]
    assert isinstance(buy.delay(1).get(), int)
    with dlock_hold(shop, "stock:1"):
        assert is_skipped(buy.apply_async((1,), on_contention="skip").get())
        with pytest.raises(LockNotAcquired):
            buy.apply_async((1,), on_contention="raise")
    acquired = dlock_events.acquired("stock:1")
    assert len(acquired) == 1 and acquired[0].task == "shop.buy"
    assert acquired[0].details["fence"] is not None
    assert [e.state for e in dlock_events.released("stock:1")] == ["SUCCESS"]
    assert [e.policy for e in dlock_events.contended("stock:1")] == ["skip", "raise"]
    assert len(dlock_events.skipped("stock:1")) == 1
    assert dlock_events.contended(policy="raise")[0].holder is not None
    assert dlock_events.names("contended") == ["stock:1"]
    assert dlock_events.acquired("stock:2") == [] and dlock_events.lost() == []
    assert [e.kind for e in dlock_events] == ["acquired", "released", "contended",
                                              "contended"]
    assert "policy=skip" in repr(dlock_events)
    with pytest.raises(ValueError, match="unknown event kind"):
        dlock_events.of("taken")
    dlock_events.clear()
    assert len(dlock_events) == 0 and repr(dlock_events) == "<dlock events: none>"


def test_dlock_events_records_a_lost_lock(shop: Celery, dlock_eager: Eager,
                                          dlock_events: EventLog) -> None:
    dlock_eager(shop)
    with pytest.raises(LockLost):
        shop.tasks["shop.buy"].delay(9, lose=True)
    assert len(dlock_events.lost("stock:9")) == 1
    assert dlock_events.lost("stock:9")[0].details["reason"]
    assert dlock_events.released("stock:9", state="FAILURE")


def test_dlock_events_records_duplicates(redis_url: str, prefix: str,
                                         r: redis.Redis, dlock_events: EventLog) -> None:
    app = test_app(f"dup{prefix}", redis_url, queue=f"q-{prefix}", prefix=prefix)

    @app.task(base=LockedTask, shared=False, name="shop.report",
              lock_key="report:{month}", lock_mode="until_started")
    def report(month: str) -> None:
        return None

    try:
        first = report.delay("2026-11")  # queued: no worker takes it
        assert report.delay("2026-11").id == first.id  # return_existing
        assert isinstance(report.apply_async(("2026-11",), on_duplicate="drop"),
                          DroppedResult)
        assert [e.policy for e in dlock_events.duplicates("report:2026-11")] == [
            "return_existing", "drop"]
        dropped = dlock_events.dropped("report:2026-11")
        assert len(dropped) == 1 and dropped[0].details["existing"] == first.id
        assert dlock_events.duplicates(policy="raise") == []
    finally:
        r.delete(f"q-{prefix}")
        close_app(app)


@pytest.mark.slow
def test_dlock_events_waits_for_a_worker_thread_and_disconnects(
        shop: Celery) -> None:
    shop.conf.update(result_backend="cache+memory://")
    with EventLog() as log:
        with start_worker(shop, pool="threads", concurrency=2,
                          perform_ping_check=False, shutdown_timeout=10):
            shop.tasks["shop.buy"].delay(4)
            released = log.wait_for("released", "stock:4", timeout=20)
        assert released.state == "SUCCESS" and log.acquired("stock:4")
        expected = r"(?s)no lost 'stock:4' event.*acquired"  # what was recorded
        with pytest.raises(AssertionError, match=expected):
            log.wait_for("lost", "stock:4", timeout=0.1)
    count = len(log)
    shop.conf.update(task_always_eager=True)
    shop.tasks["shop.buy"].delay(5)  # after disconnecting: not recorded
    assert len(log) == count


def test_dlock_eager_sets_and_restores_settings(shop: Celery) -> None:
    shop.conf.task_eager_propagates = False  # the app's own value comes back
    eager = Eager()
    assert eager(shop, task_store_eager_result=True) is shop
    for key, value in EAGER_SETTINGS.items():
        assert shop.conf[key] == value
    assert shop.conf.task_store_eager_result is True
    eager.restore()
    assert shop.conf.task_eager_propagates is False
    assert shop.conf.task_always_eager is False
    assert shop.conf.get("dlock_enabled") is None
    assert shop.conf.task_store_eager_result is False
    with pytest.raises(TypeError, match="not a Celery app"):
        eager(object())


def test_dlock_eager_turns_real_locks_on(shop: Celery, dlock_eager: Eager,
                                         dlock_hold: Holds) -> None:
    shop.conf.dlock_enabled = False  # as a unit-test configuration would have it
    buy = shop.tasks["shop.buy"]
    assert buy(1) == "unlocked"
    dlock_eager(shop)
    with dlock_hold(shop, "stock:1"):
        with pytest.raises(LockNotAcquired):  # retry cannot re-queue an eager run
            buy.delay(1)
        assert is_skipped(buy.apply_async((1,), on_contention="skip").get())
    assert isinstance(buy.delay(1).get(), int)
    assert shop.conf.dlock_enabled is True


def test_after_dlock_eager_the_apps_value_is_back(shop: Celery) -> None:
    shop.conf.dlock_enabled = False
    eager = Eager()
    eager(shop)
    eager.restore()
    assert shop.conf.dlock_enabled is False


def test_dlock_eager_settings_never_reach_the_next_test(shop: Celery,
                                                       dlock_hold: Holds) -> None:
    """The settings a task read (and cached) under one test's ``dlock_eager`` are
    read again after it: the next test sees the app's own, and a test's own apply
    even to a task that ran before it."""
    buy = shop.tasks["shop.buy"]
    assert isinstance(buy(7), int)  # ran once: read the defaults (retry)
    first = Eager()  # one test ...
    first(shop, dlock_on_contention="skip")
    with dlock_hold(shop, "stock:7"):
        assert is_skipped(buy.delay(7).get())  # the test's policy, not the cached one
    first.restore()
    second = Eager()  # ... and the next
    second(shop)
    try:
        with dlock_hold(shop, "stock:7"), pytest.raises(LockNotAcquired):
            buy.delay(7)  # the default again: retry, which an eager run cannot
        assert buy.dlock_settings()["on_contention"] == "retry"
    finally:
        second.restore()


def test_dlock_hold_takes_a_slot_of_a_limited_task(
        redis_url: str, prefix: str, dlock_hold: Holds, dlock_eager: Eager,
        r: redis.Redis) -> None:
    app = Celery("limited", broker="memory://", set_as_current=False)
    app.conf.update(dlock_url=redis_url, dlock_key_prefix=prefix)

    @app.task(base=LockedTask, bind=True, shared=False, name="shop.pack",
              lock_key="pack:{line}", lock_limit=2)
    def pack(self: Any, line: int) -> Any:
        return self.lock.fence

    try:
        dlock_eager(app)
        first = dlock_hold(pack, args=(1,))
        assert r.type(_key(prefix, "pack:1")) == b"zset"  # a slot, as the task takes
        assert isinstance(pack.apply_async((1,), on_contention="raise").get(), int)
        second = dlock_hold(pack, args=(1,))  # both slots held now
        with pytest.raises(LockNotAcquired):
            pack.apply_async((1,), on_contention="raise").get()
        with pytest.raises(LockNotAcquired):  # a third slot there is not
            dlock_hold(pack, args=(1,))
        second.release()
        assert isinstance(pack.apply_async((1,), on_contention="raise").get(), int)
        first.release()
        assert not r.exists(_key(prefix, "pack:1"))
        plain = dlock_hold(app, "pack:9")  # by name on the app: its limit, 1
        assert r.type(_key(prefix, "pack:9")) == b"hash" and plain.held
    finally:
        app.close()
