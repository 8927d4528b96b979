"""Prometheus metrics moved by real locked tasks on an in-process worker (whose app
also records the event history, ``dlock_record_events``: the duplicates and parked
calls counted are recorded as events too)."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app, test_app
from dlock_helpers import wait_until
from prometheus_client import CollectorRegistry

from celery_dlock import LockedTask, LockLost, RedisLock, is_skipped, signals
from celery_dlock.ops import metrics
from celery_dlock.task.event_counts import counts_key, minute_counts
from celery_dlock.task.events import recent_events

RESULT_TIMEOUT = 30


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[SimpleNamespace]:
    tag = uuid.uuid4().hex[:8]
    prefix = f"dlm{tag}"
    registry = CollectorRegistry()
    installed = metrics.install(registry=registry)
    app = test_app(f"dlm{tag}", redis_url, queue=f"q-{tag}", prefix=prefix,
                   dlock_record_events=True)
    r = redis.Redis.from_url(redis_url, socket_timeout=30)
    gates: list[str] = []

    @app.task(base=LockedTask, bind=True, name=f"m{tag}.quick", lock_key="m:{x}")
    def quick(self: Any, x: str) -> str:
        time.sleep(0.05)
        return "done"

    @app.task(base=LockedTask, bind=True, name=f"m{tag}.gated", lock_key="m:{x}")
    def gated(self: Any, x: str) -> str:
        r.blpop([f"{prefix}-data:gate:{x}"], timeout=RESULT_TIMEOUT)
        return "done"

    @app.task(base=LockedTask, bind=True, name=f"m{tag}.skipper", lock_key="m:{x}",
              on_contention="skip")
    def skipper(self: Any, x: str) -> str:
        return "ran"

    @app.task(base=LockedTask, bind=True, name=f"m{tag}.loses", lock_key="m:{x}",
              lock_ttl=0.6)
    def loses(self: Any, x: str) -> str:
        r.delete(f"{prefix}:{{m:{x}}}")  # someone frees our lock behind our back
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                self.lock.ensure_held()
            except LockLost:
                return "noticed"
            time.sleep(0.02)
        return "never noticed"

    @app.task(base=LockedTask, bind=True, name=f"m{tag}.rated", lock_key="m:{x}",
              lock_rate="2/s", max_retries=0, shared=False)
    def rated(self: Any, x: str) -> str:
        return "ran"
    @app.task(base=LockedTask, bind=True, name=f"m{tag}.slots", lock_key="s:{x}",
              lock_limit=3, shared=False)
    def slots(self: Any, x: str, gate: str) -> str:
        r.blpop([f"{prefix}-data:gate:{gate}"], timeout=RESULT_TIMEOUT)
        return "done"

    def open_gate(x: str) -> None:
        r.rpush(f"{prefix}-data:gate:{x}", 1)

    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False,
                      shutdown_timeout=20):
        yield SimpleNamespace(
            registry=registry, metrics=installed, r=r, prefix=prefix, gates=gates,
            open_gate=open_gate,
            tasks=SimpleNamespace(quick=quick, gated=gated, skipper=skipper,
                                  loses=loses, rated=rated, slots=slots))
        for x in gates:
            open_gate(x)
    metrics.uninstall()
    close_app(app)
    r.close()


def sample(env: SimpleNamespace, name: str, **labels: str) -> float:
    value = env.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


def test_acquire_and_hold_histograms_and_the_held_gauge(env):
    task = env.tasks.quick.name
    before_acq = sample(env, "dlock_acquire_wait_seconds_count", task=task)
    before_hold = sample(env, "dlock_hold_seconds_count", task=task)
    before_sum = sample(env, "dlock_hold_seconds_sum", task=task)
    for _ in range(3):
        assert env.tasks.quick.delay(uuid.uuid4().hex).get(timeout=RESULT_TIMEOUT) == \
            "done"
    assert wait_until(lambda: sample(env, "dlock_hold_seconds_count", task=task)
                      == before_hold + 3)
    assert sample(env, "dlock_acquire_wait_seconds_count", task=task) == before_acq + 3
    assert sample(env, "dlock_hold_seconds_sum", task=task) - before_sum >= 0.15
    # acquiring a free lock is quick: every observation in the 1 s bucket
    assert sample(env, "dlock_acquire_wait_seconds_bucket", task=task, le="1.0") == \
        before_acq + 3
    assert sample(env, "dlock_held_locks", task=task) == 0


def test_held_gauge_counts_running_holders(env):
    task = env.tasks.gated.name
    xs = [uuid.uuid4().hex for _ in range(2)]
    env.gates.extend(xs)
    results = [env.tasks.gated.delay(x) for x in xs]
    assert wait_until(lambda: sample(env, "dlock_held_locks", task=task) == 2)
    for x in xs:
        env.open_gate(x)
    for result in results:
        assert result.get(timeout=RESULT_TIMEOUT) == "done"
    assert wait_until(lambda: sample(env, "dlock_held_locks", task=task) == 0)


def test_a_semaphore_task_shows_its_slots_held_and_its_limit(env):
    task = env.tasks.slots.name
    key = uuid.uuid4().hex  # one key: two calls hold two of its three slots at once
    gates = [uuid.uuid4().hex for _ in range(2)]
    env.gates.extend(gates)
    results = [env.tasks.slots.delay(key, g) for g in gates]
    assert wait_until(lambda: sample(env, "dlock_held_locks", task=task) == 2)
    assert sample(env, "dlock_lock_limit", task=task) == 3
    for g in gates:
        env.open_gate(g)
    for result in results:
        assert result.get(timeout=RESULT_TIMEOUT) == "done"
    assert wait_until(lambda: sample(env, "dlock_held_locks", task=task) == 0)


def test_contention_counter_by_task_and_policy(env):
    task = env.tasks.skipper.name
    x = uuid.uuid4().hex
    before = sample(env, "dlock_contention_total", task=task, policy="skip")
    holder = RedisLock(env.r, f"m:{x}", prefix=env.prefix, owner="test-holder")
    assert holder.acquire(blocking=False)
    try:
        for _ in range(2):
            assert is_skipped(env.tasks.skipper.delay(x).get(timeout=RESULT_TIMEOUT))
    finally:
        holder.release()
    assert sample(env, "dlock_contention_total", task=task, policy="skip") == before + 2
    assert env.tasks.skipper.delay(x).get(timeout=RESULT_TIMEOUT) == "ran"
    assert sample(env, "dlock_contention_total", task=task, policy="skip") == before + 2


def test_lost_counter(env):
    task = env.tasks.loses.name
    before = sample(env, "dlock_lost_total", task=task)
    with pytest.raises(LockLost):  # the attempt fails (lock_lost_action="fail")
        env.tasks.loses.delay(uuid.uuid4().hex).get(timeout=RESULT_TIMEOUT)
    assert wait_until(lambda: sample(env, "dlock_lost_total", task=task) == before + 1)
    assert wait_until(lambda: sample(env, "dlock_held_locks", task=task) == 0)


def test_install_is_idempotent_and_refuses_a_second_registry(env):
    assert metrics.install(registry=env.registry) is env.metrics
    with pytest.raises(ValueError, match="uninstall"):
        metrics.install(registry=CollectorRegistry())
    with pytest.raises(ValueError, match="uninstall"):
        metrics.install(registry=env.registry, namespace="other")


def test_missing_prometheus_client_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"celery-dlock\[prometheus\]"):
        metrics.install(registry=object())


def test_duplicate_counter_by_task_and_policy(env):
    from celery_dlock import AlreadyQueued

    task = env.tasks.gated.name
    x = uuid.uuid4().hex
    env.gates.append(x)
    opts = {"lock_mode": "until_finished"}
    before = {p: sample(env, "dlock_duplicates_total", task=task, policy=p)
              for p in ("return_existing", "drop", "raise")}
    first = env.tasks.gated.apply_async((x,), **opts)
    assert env.tasks.gated.apply_async((x,), **opts).id == first.id
    env.tasks.gated.apply_async((x,), on_duplicate="drop", **opts)
    env.tasks.gated.apply_async((x,), on_duplicate="drop", **opts)
    with pytest.raises(AlreadyQueued):
        env.tasks.gated.apply_async((x,), on_duplicate="raise", **opts)
    after = {p: sample(env, "dlock_duplicates_total", task=task, policy=p)
             for p in before}
    assert {p: after[p] - before[p] for p in before} == \
        {"return_existing": 1, "drop": 2, "raise": 1}
    # the history has each, naming the queued call and the mode
    events = [e for e in recent_events(env.r, env.prefix, 200)
              if e.kind == "duplicate" and e.key == f"m:{x}"]
    assert sorted(e.policy for e in events) == ["drop", "drop", "raise",
                                                "return_existing"]
    assert {e.holder_task_id for e in events} == {first.id}
    assert {e.detail for e in events} == {"lock_mode until_finished"}
    env.open_gate(x)
    assert first.get(timeout=RESULT_TIMEOUT) == "done"


def test_every_acquisition_and_event_is_counted_per_minute(env):
    """With dlock_record_events, each acquisition is counted in its minute's hash
    (not kept in the capped history), and so is each recorded event: the web page's
    chart reads these counts."""
    def totals() -> dict[str, int]:
        counts = minute_counts(env.r, env.prefix, time.time(), 60)
        return {kind: sum(values) for kind, values in counts.items()}

    before = totals()
    for _ in range(3):
        assert env.tasks.quick.delay(uuid.uuid4().hex).get(timeout=RESULT_TIMEOUT) == \
            "done"
    x = uuid.uuid4().hex
    env.gates.append(x)
    first = env.tasks.gated.apply_async((x,), lock_mode="until_finished")
    env.tasks.gated.apply_async((x,), lock_mode="until_finished", on_duplicate="drop")
    env.open_gate(x)
    assert first.get(timeout=RESULT_TIMEOUT) == "done"
    assert wait_until(lambda: totals()["acquired"] >= before["acquired"] + 4)
    after = totals()
    assert after["acquired"] == before["acquired"] + 4  # 3 quick, 1 gated
    assert after["duplicate"] == before["duplicate"] + 1
    assert env.r.ttl(counts_key(env.prefix, int(time.time() // 60))) > 3600


def test_parked_counter(env):
    """Every park is counted once.  3 calls of one name at once at 2/s (burst 1):
    the rate is asked with the lock held, so the later calls first wait their turn
    for the lock (contention retries) and are parked when they get it too soon:
    at least one is, and the counter moves by as many as the signal told."""
    task = env.tasks.rated.name
    x = uuid.uuid4().hex
    parked: list[Any] = []

    def on_parked(sender: Any = None, **kw: Any) -> None:
        if kw.get("name") == f"m:{x}":
            parked.append(kw)

    signals.lock_parked.connect(on_parked, weak=False)
    try:
        before = sample(env, "dlock_parked_total", task=task)
        results = [env.tasks.rated.delay(x) for _ in range(3)]
        assert [res.get(timeout=RESULT_TIMEOUT) for res in results] == ["ran"] * 3
    finally:
        signals.lock_parked.disconnect(on_parked)
    assert len(parked) >= 1
    assert sample(env, "dlock_parked_total", task=task) == before + len(parked)
    events = [e for e in recent_events(env.r, env.prefix, 200)
              if e.kind == "parked" and e.key == f"m:{x}"]
    assert len(events) == len(parked)
    assert all(e.detail and e.detail.startswith("lock_rate 2/s") for e in events)
