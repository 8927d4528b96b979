"""``lock_limit=N`` on real prefork workers, on every store that keeps semaphores
(the ``semaphore_harness`` fixture): never more than N bodies of one key at once, N
reached, every call run; with the ``wait`` and ``retry`` policies."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import pytest
from celery.result import ResultSet
from worker_harness import Harness, wait_for

from celery_dlock import InvalidLockConfig
from celery_dlock.task.backend import backend_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture
def harness(semaphore_harness: Harness) -> Iterator[Harness]:
    yield semaphore_harness


@pytest.mark.parametrize("policy", ["wait", "retry"])
def test_twelve_calls_on_five_processes_run_three_at_a_time(harness: Harness,
                                                            policy: str) -> None:
    h = harness
    h.start_workers(count=1, concurrency=5)
    task = h.app.tasks[f"pf.slot_{policy}"]
    key = f"k-{policy}"
    fences = ResultSet([task.delay(key, 0.6) for _ in range(12)]).get(
        timeout=120, interval=0.05)
    base = f"{h.dp}:slots:{key}"
    assert int(h.r.get(f"{base}:peak") or 0) == 3, "never more than 3, and 3 reached"
    assert int(h.r.get(f"{base}:inside") or 0) == 0
    assert h.r.llen(f"{base}:runs") == 12
    assert len(set(fences)) == 12, "each hold has its own fence"
    assert list(backend_for(h.app).holds(h.prefix)) == []


def test_sigkill_of_a_slot_holder_frees_its_slot(harness: Harness) -> None:
    h = harness
    h.start_workers(count=1, concurrency=3)
    task = h.app.tasks["pf.slot_hold"]
    key = "k-kill"
    held = [task.delay(key, 30) for _ in range(2)]
    holding = f"{h.dp}:slots:{key}:holding"
    wait_for(lambda: h.r.llen(holding) == 2, 30, what="two slot holders")
    records = [json.loads(x) for x in h.r.lrange(holding, 0, -1)]
    victim = records[0]
    backend = backend_for(h.app)
    info = backend.read(h.prefix, f"slots:{key}")
    assert info is not None and info.slots == "2/2"
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    # Freed by the worker's main process (or, at the latest, by the ttl of 10 s).
    wait_for(lambda: (backend.read(h.prefix, f"slots:{key}") or info).slots == "1/2",
             10, what="the killed holder's slot to be freed")
    freed_after = time.monotonic() - killed_at
    print(f"\nSIGKILL of a slot holder -> slot freed: {freed_after * 1000:.0f} ms")
    third = task.delay(key, 0.1)
    wait_for(lambda: h.r.llen(holding) == 3, 30, what="a third holder")
    survivor = backend.read(h.prefix, f"slots:{key}")
    assert survivor is not None
    assert victim["task_id"] not in {x.task_id for x in survivor.holders}
    assert third.get(timeout=30)
    for result in held:
        result.revoke(terminate=True, signal="SIGKILL")


@pytest.mark.parametrize("mode", ["until_started", "queued_and_running"])
def test_a_limit_with_a_queue_marker_runs_calls_side_by_side(harness: Harness,
                                                              mode: str) -> None:
    """``lock_limit=3`` with a marker mode: while one call runs, a new call of the
    name is accepted (the marker gates the queue, the slots the runs) and runs beside
    it; ``until_finished`` (one call queued or running) cannot go with a limit and is
    refused where the call is made, not on the server as a key it cannot read."""
    h = harness
    h.start_workers(count=1, concurrency=3)
    task = h.app.tasks["pf.slot_wait"]
    key = f"k-marker-{mode}"
    base = f"{h.dp}:slots:{key}"
    first = task.apply_async((key, 2.0), lock_mode=mode)
    wait_for(lambda: int(h.r.get(f"{base}:inside") or 0) == 1, 30,
             what="the first call to run")
    second = task.apply_async((key, 0.5), lock_mode=mode)
    assert second.id != first.id, "accepted: a call of its own"
    assert isinstance(second.get(timeout=30), int)
    assert isinstance(first.get(timeout=30), int)
    assert int(h.r.get(f"{base}:peak") or 0) == 2, "the two ran side by side"
    with pytest.raises(InvalidLockConfig, match=r"until_finished.*lock_limit=3"):
        task.apply_async((key, 0.0), lock_mode="until_finished")
