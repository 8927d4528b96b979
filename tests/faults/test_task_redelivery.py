"""The same task id delivered again while its first run is alive, and the replacements
that share a task id on purpose (``self.replace()``).

A broker redelivery (``acks_late`` and a visibility timeout shorter than the task) is
produced for real on prefork workers; the same message sent twice stands in for it on
the in-process worker.  Either way the duplicate never runs the body and never writes
a state or result for the task id; the first run's result is what clients see.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu.transport.redis
import pytest
import redis
from celery import states
from celery_helpers import needs_inprocess_eta
from task_env import TaskEnv, new_app, running
from worker_harness import Harness, open_harness, wait_for

from celery_dlock import LockedTask, is_skipped

POLICIES = ("retry", "wait", "skip", "raise")
RESULT_TIMEOUT = 60


def _watch_states(app: Any, task_id: str, until: float) -> list[tuple[str, Any]]:
    """Every (state, result) the result store shows for ``task_id`` until ``until``."""
    seen: list[tuple[str, Any]] = []
    while time.monotonic() < until:
        meta = app.backend.get_task_meta(task_id)
        entry = (meta["status"], meta.get("result"))
        if not seen or seen[-1] != entry:
            seen.append(entry)
        time.sleep(0.05)
    return seen


def _only_the_first_result(seen: list[tuple[str, Any]], first: Any) -> None:
    for state, result in seen:
        assert state in (states.PENDING, states.STARTED, states.SUCCESS), seen
        if state == states.SUCCESS:
            assert result == first and not is_skipped(result), seen


# -- a real redelivery on prefork workers ------------------------------------------------


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    monkeypatch.setenv("DLOCK_PF_CONF", json.dumps({"broker_transport_options": {
        "polling_interval": 0.1,
        # Redeliver a message not acked within 1 s, checked every second.
        "visibility_timeout": 1,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # This test's own bookkeeping: no other test's messages are restored.
        "unacked_key": f"{prefix}-unacked",
        "unacked_index_key": f"{prefix}-unacked_index",
        "unacked_mutex_key": f"{prefix}-unacked_mutex",
    }}))
    stop = threading.Event()
    for h in open_harness(redis_url, r, prefix, tmp_path, request):
        restorer = None
        if not hasattr(kombu.transport.redis.Channel, "unacked_restore_interval"):
            restorer = threading.Thread(target=_restore_unacked, args=(h.app, stop),
                                        daemon=True)
            restorer.start()
        try:
            yield h
        finally:
            stop.set()
            if restorer is not None:
                restorer.join(10)


def _restore_unacked(app: Any, stop: threading.Event) -> None:
    """kombu before 5.7 has no ``unacked_restore_interval``: a worker restores unacked
    messages every 10 s, scanning on every 10th time only (about 100 s). Run kombu's
    own restore (``QoS.restore_visible``, on the same keys) every 0.5 s instead."""
    deadline = time.monotonic() + 300
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        while not stop.wait(0.5) and time.monotonic() < deadline:
            channel.qos.restore_visible(num=channel.unacked_restore_limit, interval=1)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("policy", POLICIES)
def test_redelivered_running_task_runs_once_and_keeps_its_result(
        harness: Harness, policy: str) -> None:
    h = harness
    (worker,) = h.start_workers(count=1, concurrency=2)
    key, seconds = f"rd-{policy}", 5.0
    res = h.app.tasks[f"pf.redelivered_{policy}"].delay(key, seconds)
    seen = _watch_states(h.app, res.id, time.monotonic() + seconds + 1.0)
    first = res.get(timeout=RESULT_TIMEOUT)
    received = worker.log_text().count(f"[{res.id}] received")
    starts = h.records("starts", key)
    print(f"\nredelivery ({policy}): message received {received} times, body started "
          f"{len(starts)} time(s), states seen {[s for s, _ in seen]}")
    assert received >= 2, "the broker never redelivered the message"
    assert len(starts) == 1, f"the body ran {len(starts)} times: {starts}"
    assert first == {"pid": starts[0]["pid"], "start": starts[0]["start"]}
    _only_the_first_result(seen, first)
    time.sleep(1.5)  # the duplicates still in flight are ignored too
    assert h.app.backend.get_task_meta(res.id)["result"] == first
    assert len(h.records("starts", key)) == 1
    wait_for(lambda: h.lock_keys_left() == [], 5, what="the lock to be released")


@needs_inprocess_eta
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_duplicate_of_a_run_that_died_recovers_the_task(harness: Harness) -> None:
    """The whole worker dies mid-run (no result, the hold is left to expire in 2 s); a
    redelivery arriving meanwhile finds the dead hold and re-queues itself silently;
    once the hold has expired it runs the task: the redelivery still recovers it."""
    h = harness
    (first_worker,) = h.start_workers(count=1, concurrency=1)
    key = "recover"
    task = h.app.tasks["pf.recoverable"]
    res = task.delay(key, 30.0)
    wait_for(lambda: h.records("starts", key), 20, what="the first run to start")
    os.killpg(first_worker.pid, signal.SIGKILL)  # main process and child: no result
    h.start_workers(count=1, concurrency=2)
    task.apply_async((key, 0.2), task_id=res.id)  # the broker's redelivery
    got = res.get(timeout=RESULT_TIMEOUT)
    starts = h.records("starts", key)
    print(f"\nrecovery: body started {len(starts)} times; the second "
          f"{starts[-1]['start'] - starts[0]['start']:.2f} s after the first")
    assert len(starts) == 2 and got["start"] == starts[1]["start"]
    assert h.app.backend.get_task_meta(res.id)["status"] == states.SUCCESS


# -- the same message twice, on the in-process worker ------------------------------------


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[TaskEnv]:
    e = new_app(redis_url)

    for policy in POLICIES:
        def body(self: Any, x: str, seconds: float, tag: str) -> str:
            e.log(kind="start", x=x, tag=tag, task_id=self.request.id)
            time.sleep(seconds)
            return tag

        e.tasks[policy] = e.app.task(
            base=LockedTask, shared=False, bind=True, name=f"dup_{policy}",
            lock_key="d:{x}", on_contention=policy, lock_wait=20)(body)

    def replacing_task(policy: str) -> Any:
        def replacing(self: Any, x: str, step: int) -> str:
            e.log(kind="replacing", x=x, step=step, start=time.time(),
                  owned=self.lock.owned(), task_id=self.request.id)
            if step == 0:
                try:
                    raise self.replace(self.si(x, 1))
                finally:
                    time.sleep(0.5)
                    e.log(kind="cleanup", x=x, end=time.time(), owned=self.lock.owned())
            return f"replacement of {x}"

        return e.app.task(base=LockedTask, shared=False, bind=True,
                          name=f"replacing_{policy}", lock_key="rp:{x}",
                          on_contention=policy, lock_wait=20)(replacing)

    for policy in POLICIES:
        e.tasks[f"replacing_{policy}"] = replacing_task(policy)

    @e.app.task(base=LockedTask, shared=False, bind=True, lock_key="fu:{x}",
                on_contention="wait", lock_wait=20)
    def follow_up(self: Any, x: str, step: int) -> str:
        e.log(kind="follow", x=x, step=step, start=time.time())
        if step == 0:
            self.apply_async((x, 1))
            time.sleep(0.5)
        e.log(kind="follow-end", x=x, step=step, end=time.time())
        return f"step {step}"

    e.tasks["follow_up"] = follow_up
    with running(e):
        yield e


@pytest.mark.parametrize("policy", POLICIES)
def test_same_message_twice_runs_the_body_once(env: TaskEnv, policy: str) -> None:
    x = uuid.uuid4().hex[:8]
    task = env.tasks[policy]
    task_id = str(uuid.uuid4())
    first = task.apply_async((x, 1.5, "first"), task_id=task_id)
    assert wait_for(lambda: env.events(kind="start", x=x), 10, what="the first run")
    task.apply_async((x, 0.1, "second"), task_id=task_id)
    seen = _watch_states(env.app, task_id, time.monotonic() + 2.0)
    assert first.get(timeout=RESULT_TIMEOUT) == "first"
    time.sleep(0.5)
    assert [e["tag"] for e in env.events(kind="start", x=x)] == ["first"]
    _only_the_first_result(seen, "first")
    assert env.app.backend.get_task_meta(task_id)["result"] == "first"
    assert not env.r.exists(env.lock_key(f"d:{x}"))


# -- self.replace() and follow-ups -------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_replacement_runs_once_after_the_replaced_attempt(env: TaskEnv,
                                                         policy: str) -> None:
    x = uuid.uuid4().hex[:8]
    res = env.tasks[f"replacing_{policy}"].delay(x, 0)
    got = res.get(timeout=RESULT_TIMEOUT)
    assert got == f"replacement of {x}", got
    runs = env.events(kind="replacing", x=x)
    assert [e["step"] for e in runs] == [0, 1]
    assert all(e["owned"] for e in runs)
    (cleanup,) = env.events(kind="cleanup", x=x)
    assert cleanup["owned"] is True
    assert runs[1]["start"] >= cleanup["end"], "the replacement overlapped the cleanup"
    assert all(e["task_id"] == res.id for e in runs)
    assert not env.r.exists(env.lock_key(f"rp:{x}"))


def test_follow_up_sent_from_the_body_waits_for_it(env: TaskEnv) -> None:
    x = uuid.uuid4().hex[:8]
    assert env.tasks["follow_up"].delay(x, 0).get(timeout=RESULT_TIMEOUT) == "step 0"
    assert wait_for(lambda: env.events(kind="follow-end", x=x, step=1), 20,
                    what="the follow-up")
    (parent_end,) = env.events(kind="follow-end", x=x, step=0)
    (child,) = env.events(kind="follow", x=x, step=1)
    assert child["start"] >= parent_end["end"]
