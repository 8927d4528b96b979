"""The queue-marker scripts under faults, on real servers: a reply lost and the call
re-sent, Redis restarted between the claim and the publish, a stalled server; and
the interleavings of a replace with the starts of the calls it involves, which run on
each store that keeps queue markers (Redis, PostgreSQL, MySQL: the ``markers``
fixture).  The faults themselves (a proxy dropping an ``EVALSHA`` reply, a server of
the test's own stalled or restarted) are Redis's.

redis-py re-sends a command whose reply it did not get: a re-sent claim gets its
first reply (the send's operation id), so a call is never taken for a duplicate of
itself; a claim whose reply never came is taken back, also when a stalled server runs
it after the take-back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.backoff
import redis.retry
from celery.signals import before_task_publish
from celery_helpers import test_app
from kombu.exceptions import EncodeError
from marker_stores import MarkerCase
from proxy import FaultProxy
from worker_harness import Harness, open_harness, wait_for

from celery_dlock import BackendUnavailable, LockedTask, RedisLock
from celery_dlock.backends.redis.marker_scripts import CLAIM, CONFIRM, HAND_OVER, UNDO
from celery_dlock.backends.redis.markers import RedisMarkers
from celery_dlock.ops.embedded import EmbeddedRedis
from celery_dlock.task import signals, takeback
from celery_dlock.task.attempt import Attempt, attempts
from celery_dlock.task.markers import (
    CLAIMED,
    MARKER_HEADER,
    PENDING,
    QUEUED,
    REPLACED,
    MarkerRecord,
    MarkerStore,
)
from celery_dlock.task.takeback import EVERY as TAKE_BACK_EVERY

pytestmark = pytest.mark.slow


def claim(m: MarkerStore, prefix: str, name: str, task_id: str, op: str, *,
          replace: bool = False, ttl: float = 60.0,
          running_counts: bool = True) -> tuple[int, str, float | None]:
    """A send's claim; by default as ``until_finished`` makes it (a running call is
    a duplicate), ``running_counts=False`` as ``until_started`` and
    ``queued_and_running`` do."""
    return m.claim(prefix, name, task_id, ttl, running_counts=running_counts,
                   replace=replace, requeue=False, op=op)


def start(m: MarkerStore, prefix: str, name: str, task_id: str, *,
          running_counts: bool = True) -> str | None:
    """A call's hand-over at its start (the mode as for :func:`claim`)."""
    return m.hand_over(prefix, name, task_id, remove=True, replaced_check=True,
                       running_counts=running_counts)


# -- a replace and the starts of the calls it involves (no fault) -----------------------

#: The marker modes by whether a running call is a duplicate of a new one.
RUNNING_COUNTS = {"until_finished": True, "until_started": False,
                  "queued_and_running": False}


@pytest.mark.parametrize("mode", RUNNING_COUNTS)
def test_a_dead_processs_call_is_kept_live_only_if_it_had_started(
        markers: MarkerCase, prefix: str, mode: str) -> None:
    """The worker process running a call died, and its message will come back
    (what the worker's main process writes then).  A call still queued under its
    marker, or replaced, keeps what that says: a replaced one is still superseded
    at its redelivery.  A call that had started is kept live: a send of its task id
    is that call; in ``until_finished`` so is a new call of the name; in the other
    modes a new call is queued, and the redelivery still runs."""
    m, counts = markers.store, RUNNING_COUNTS[mode]

    def keep(task_id: str) -> bool:
        return m.keep_for_redelivery(prefix, "n", task_id, 60.0, running_counts=counts)

    assert claim(m, prefix, "n", "queued", "op1", running_counts=counts)[0] == CLAIMED
    assert keep("queued") is False  # not started: its marker says it is queued
    assert claim(m, prefix, "n", "new", "op2", replace=True,
                 running_counts=counts)[:2] == (REPLACED, "queued")
    assert m.confirm(prefix, "n", "new") is True
    assert keep("queued") is False  # replaced: it stays so
    assert start(m, prefix, "n", "queued", running_counts=counts) == "new"
    assert start(m, prefix, "n", "new", running_counts=counts) is None  # it runs
    assert keep("new") is True  # started, then its process died
    code, other, _ = claim(m, prefix, "n", "new", "op3", running_counts=counts)
    assert (code, other) == (QUEUED, "new")  # its task id sent again: that call
    code, other, _ = claim(m, prefix, "n", "later", "op4", running_counts=counts)
    if counts:
        assert (code, other) == (QUEUED, "new")  # the name is still taken
    else:
        assert code == CLAIMED  # queued beside the call coming back
    # The redelivery (its record as first sent: not started) runs, never superseded.
    assert start(m, prefix, "n", "new", running_counts=counts) is None
    # (from here the lock it takes says it runs) and a later call stays queued
    assert m.read(prefix, "n") is None if counts else \
        (m.read(prefix, "n") or ("",))[0] == "later"


@pytest.mark.parametrize("mode", RUNNING_COUNTS)
def test_the_replaced_call_starting_before_the_confirm_takes_the_replace_back(
        markers: MarkerCase, prefix: str, mode: str) -> None:
    """old is queued, new replaces it, and old starts before new's publish is
    confirmed: old runs, and new's caller revokes nothing.  In ``until_finished`` a
    running call is a duplicate: new never runs.  In the other modes new stays queued
    under the marker and runs after old, as a call sent just after old started
    would: the latest call is never lost to an earlier one."""
    m, counts = markers.store, RUNNING_COUNTS[mode]
    assert claim(m, prefix, "n", "old", "op1", running_counts=counts)[0] == CLAIMED
    assert claim(m, prefix, "n", "new", "op2", replace=True,
                 running_counts=counts)[:2] == (REPLACED, "old")
    assert start(m, prefix, "n", "old", running_counts=counts) is None  # it runs
    assert m.confirm(prefix, "n", "new") is False  # the caller revokes nothing
    if counts:
        assert start(m, prefix, "n", "new", running_counts=counts) is not None
        assert m.read(prefix, "n") is None
    else:
        assert (m.read(prefix, "n") or ("",))[0] == "new"  # queued: a new call
        assert start(m, prefix, "n", "new", running_counts=counts) is None  # runs
        assert m.read(prefix, "n") is None


@pytest.mark.parametrize("order", ("new starts first", "a later claim first"))
def test_a_take_back_that_leaves_the_replacing_call_queued_is_known_to_its_confirm(
        markers: MarkerCase, prefix: str, order: str) -> None:
    """(until_started, queued_and_running) old took new's replace back; new's confirm
    comes late: after new itself started (which deletes the claim record) or after a
    later claim rewrote the record.  It still revokes nothing: old is running, and a
    revoke would make workers discard old's retry."""
    m = markers.store
    claim(m, prefix, "n", "old", "op1", running_counts=False)
    claim(m, prefix, "n", "new", "op2", replace=True, running_counts=False)
    assert start(m, prefix, "n", "old", running_counts=False) is None
    if order == "new starts first":
        assert start(m, prefix, "n", "new", running_counts=False) is None
    else:
        assert claim(m, prefix, "n", "later", "op3", replace=True,
                     running_counts=False)[:2] == (REPLACED, "new")
    assert m.confirm(prefix, "n", "new") is False


def test_the_replacing_call_starting_before_the_confirm_confirms_it(
        markers: MarkerCase, prefix: str) -> None:
    m = markers.store
    claim(m, prefix, "n", "old", "op1")
    claim(m, prefix, "n", "new", "op2", replace=True)
    assert start(m, prefix, "n", "new") is None
    assert m.confirm(prefix, "n", "new") is True
    assert start(m, prefix, "n", "old") is not None


@pytest.mark.parametrize("mode", RUNNING_COUNTS)
def test_a_replace_sent_while_a_worker_takes_the_queued_call_at_once(
        redis_url: str, mode: str) -> None:
    """Two sends of one name back to back, the second a replace, to a worker that is
    idle: the first is often taken and started before the replace is confirmed (the
    order above), else it is revoked, or it has even ended.  Either way, in
    ``until_started`` and ``queued_and_running`` the latest call runs.  In
    ``until_finished`` a running call is a duplicate: the second runs, gets the
    first's outcome (sent while the first ran), or ends revoked (the first started
    before the replace was confirmed); never both lost.  (Workers with their locks
    on Redis: the store-level orders above run on every store.)"""
    from celery.exceptions import TaskRevokedError
    from task_env import new_app, running

    env = new_app(redis_url)

    @env.app.task(base=LockedTask, shared=False, lock_key="rp:{key}", lock_mode=mode,
                  on_duplicate="replace")
    def latest(key: str, n: int) -> int:
        return n

    def outcome(result: Any) -> int | None:
        try:
            return int(result.get(timeout=30))
        except TaskRevokedError:
            return None

    with running(env, concurrency=2):
        pairs = [(latest.delay(f"k{i}", 1), latest.delay(f"k{i}", 2)) for i in range(6)]
        got = [(outcome(first), outcome(second)) for first, second in pairs]
    if RUNNING_COUNTS[mode]:
        assert all(first in (1, None) and second in (1, 2, None)
                   and (first, second) != (None, None) for first, second in got), got
    else:
        assert all(second == 2 and first in (1, None) for first, second in got), got


@pytest.mark.parametrize("mid", ("stands", "taken back"))
def test_a_replace_waits_for_a_replace_whose_publish_is_not_settled(
        markers: MarkerCase, prefix: str, mid: str) -> None:
    """old queued; mid replaces it, its publish not settled yet: a replace by new
    waits (nothing written), then replaces whichever call is queued by then: mid if
    its publish went through, old (with its time) if it failed."""
    m = markers.store
    claim(m, prefix, "n", "old", "op1", ttl=30)
    time.sleep(0.2)
    claim(m, prefix, "n", "mid", "op2", replace=True, ttl=60)
    assert claim(m, prefix, "n", "new", "op3", replace=True)[:2] == (PENDING, "mid")
    assert (m.read(prefix, "n") or ("",))[0] == "mid"
    if mid == "stands":
        assert m.confirm(prefix, "n", "mid") is True
    else:
        assert m.undo(prefix, "n", "mid", "op2", 60) is True
        task_id, left = m.read(prefix, "n") or ("", None)
        assert task_id == "old" and left is not None and 25 < left <= 29.9
    queued = "mid" if mid == "stands" else "old"
    assert claim(m, prefix, "n", "new", "op4", replace=True)[:2] == (REPLACED, queued)
    assert m.undo(prefix, "n", "new", "op4", 60) is True  # new's publish fails
    assert start(m, prefix, "n", "new") is not None
    assert start(m, prefix, "n", queued) is None  # the call queued before runs


def test_a_replaced_call_re_queued_before_its_start_stays_replaced(
        markers: MarkerCase, prefix: str) -> None:
    """Its revoke lost, the replaced call is delivered, meets contention and is
    re-queued (as a contention retry or a rate park re-queues): it takes no marker,
    and its entry among the replaced calls covers its new message: past the time
    its first message had (1 s here), its start still finds it replaced."""
    m = markers.store
    claim(m, prefix, "n", "old", "op1", ttl=1)
    claim(m, prefix, "n", "new", "op2", replace=True, ttl=1)
    assert m.confirm(prefix, "n", "new") is True
    assert start(m, prefix, "n", "new") is None  # the marker goes
    code, _, _ = m.claim(prefix, "n", "old", 600, running_counts=True, replace=False,
                         requeue=True, op="op3")
    assert code == QUEUED and m.read(prefix, "n") is None
    time.sleep(1.3)  # past the replaced entry's first time (1 s)
    assert m.read(prefix, "n") is None
    assert start(m, prefix, "n", "old") is not None


def test_a_claim_taken_back_before_it_ran_does_nothing_when_it_runs(
        markers: MarkerCase, prefix: str) -> None:
    m = markers.store
    assert m.undo(prefix, "n", "late", "op1", 60) is False
    assert claim(m, prefix, "n", "late", "op1")[0] == QUEUED  # it wrote nothing
    assert m.read(prefix, "n") is None
    assert claim(m, prefix, "n", "next", "op2")[0] == CLAIMED


# -- a lost reply, re-sent -------------------------------------------------------------

def _proxied(proxy: FaultProxy) -> redis.Redis:
    return redis.Redis.from_url(proxy.url, socket_timeout=1.0, socket_connect_timeout=1.0,
                                retry=redis.retry.Retry(redis.backoff.NoBackoff(), 2))


#: operation -> (what runs before it, directly; the operation; what it must answer;
#: the marker after it).
Step = Callable[[MarkerStore, str], Any]
RESENT: dict[str, tuple[Any, Step, Step, Any, str | None]] = {
    "claim": (CLAIM, lambda m, p: None,
              lambda m, p: claim(m, p, "n", "a", "op1")[:2], (CLAIMED, ""), "a"),
    "replace": (CLAIM, lambda m, p: claim(m, p, "n", "old", "op1"),
                lambda m, p: claim(m, p, "n", "new", "op2", replace=True)[:2],
                (REPLACED, "old"), "new"),
    "hand over": (HAND_OVER, lambda m, p: claim(m, p, "n", "a", "op1"),
                  lambda m, p: start(m, p, "n", "a"), None, None),
    "take back at start": (
        HAND_OVER, lambda m, p: (claim(m, p, "n", "old", "op1"),
                                 claim(m, p, "n", "new", "op2", replace=True)),
        lambda m, p: (start(m, p, "n", "old"), m.confirm(p, "n", "new")),
        (None, False), None),
    "confirm": (CONFIRM, lambda m, p: (claim(m, p, "n", "old", "op1"),
                                       claim(m, p, "n", "new", "op2", replace=True)),
                lambda m, p: (m.confirm(p, "n", "new"), start(m, p, "n", "old")),
                (True, "new"), "new"),
    "undo": (UNDO, lambda m, p: (claim(m, p, "n", "old", "op1"),
                                 claim(m, p, "n", "new", "op2", replace=True)),
             lambda m, p: (m.undo(p, "n", "new", "op2", 60), start(m, p, "n", "new")),
             (True, "old"), "old"),
}


@pytest.mark.parametrize("operation", sorted(RESENT))
def test_a_resent_marker_script_answers_as_the_first_run(
        own_server: EmbeddedRedis, proxy: FaultProxy, prefix: str,
        operation: str) -> None:
    """(Redis only: the proxy drops the reply of the script's ``EVALSHA``, and
    redis-py sends it again.)"""
    script, before, step, expected, after = RESENT[operation]
    direct = redis.Redis.from_url(own_server.url, socket_timeout=10)
    for each in (CLAIM, CONFIRM, HAND_OVER, UNDO):
        direct.script_load(each.source)  # EVALSHA: what the proxy matches on
    before(RedisMarkers(direct), prefix)
    matched = proxy.drop_reply(script.sha.encode())
    client = _proxied(proxy)
    try:
        assert step(RedisMarkers(client), prefix) == expected
    finally:
        client.close()
    assert matched.is_set(), "the reply was never dropped"
    read = RedisMarkers(direct).read(prefix, "n")
    assert (read[0] if read else None) == after
    direct.close()


# -- the send: a lost reply, a stalled server, a restart before the publish --------------

@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


def _producer(redis_url: str, prefix: str, queue: str,
              client: Callable[[], redis.Redis]) -> Any:
    """An app that sends on the suite's broker and keeps its markers where ``client``
    says; its task is the workers' ``pf.mode`` (tests/prefork_mode_tasks.py)."""
    app = test_app("marker-faults", redis_url, queue=queue, prefix=prefix,
                   dlock_client=client)

    @app.task(shared=False, name="pf.mode", base=LockedTask, lock_key="mode:{key}",
              lock_ttl=3, lock_mode="until_finished")
    def mode(key: str, seconds: float, tag: str) -> str:
        raise AssertionError("runs on the workers")

    return app


def _queued(r: redis.Redis, queue: str) -> list[str]:
    return [json.loads(raw)["headers"]["id"] for raw in r.lrange(queue, 0, -1)]


def test_a_send_whose_claim_reply_was_lost_is_sent_once(
        redis_url: str, r: redis.Redis, own_server: EmbeddedRedis, proxy: FaultProxy,
        prefix: str) -> None:
    queue = f"q-{prefix}"
    direct = redis.Redis.from_url(own_server.url)
    direct.script_load(CLAIM.source)
    app = _producer(redis_url, prefix, queue, lambda: _proxied(proxy))
    matched = proxy.drop_reply(CLAIM.sha.encode())
    sent = app.tasks["pf.mode"].apply_async(("k", 0.0, "a"), task_id="report-d1")
    assert matched.is_set()
    assert sent.id == "report-d1" and _queued(r, queue) == ["report-d1"]
    again = app.tasks["pf.mode"].apply_async(("k", 0.0, "b"), task_id="report-d1")
    assert again.id == "report-d1" and _queued(r, queue) == ["report-d1"]
    app.close()
    direct.close()


def test_a_re_queue_is_published_when_its_claim_finds_redis_gone(
        redis_url: str, r: redis.Redis, prefix: str) -> None:
    """A retry (or contention re-queue, rate park) of an accepted call carries its own
    marker record: with the lock's Redis unreachable it is published all the same,
    never lost; a new call is refused (BackendUnavailable), nothing published."""
    queue = f"q-{prefix}"
    app = _producer(redis_url, prefix, queue, lambda: redis.Redis.from_url(
        "redis://127.0.0.1:1/0", socket_connect_timeout=0.5,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0)))
    task = app.tasks["pf.mode"]
    args = ("k", 0.0, "a")
    record = MarkerRecord(task.lock_name(args, {}), prefix, "until_finished",
                          "return_existing", "retried").header()
    sent = task.apply_async(args, task_id="retried", headers={MARKER_HEADER: record})
    assert sent.id == "retried" and _queued(r, queue) == ["retried"]
    with pytest.raises(BackendUnavailable):
        task.apply_async(args, task_id="new")
    assert _queued(r, queue) == ["retried"]
    app.close()


@pytest.mark.parametrize("mode", ["until_finished", "until_started"])
@pytest.mark.parametrize("hold", ["stands", "lost", "none here"])
def test_a_started_calls_retry_asks_again_while_its_hold_stands(
        redis_url: str, r: redis.Redis, own_server: EmbeddedRedis, proxy: FaultProxy,
        prefix: str, hold: str, mode: str) -> None:
    """The ``self.retry()`` of a started call whose claim finds the store gone (2 s):
    while the body's hold stands, the claim is asked again and the retry published
    once it went through.  So, after the hold's release, a call of the name
    (``until_finished``: it takes the name again) or a send of the call's task id
    (``until_started``: its task id waits for its retry) is a duplicate of the retry.
    When the hold is found lost meanwhile, or no body of the call runs here, the
    retry is published at once without its record, and that send is accepted (the
    limit docs/modes.md states)."""
    queue = f"q-{prefix}"
    app = _producer(redis_url, prefix, queue, lambda: redis.Redis.from_url(
        proxy.url, socket_timeout=0.4, socket_connect_timeout=0.4,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0)))
    task = app.tasks["pf.mode"]
    args = ("k", 0.0, "a")
    name = task.lock_name(args, {})
    direct = redis.Redis.from_url(own_server.url)
    lock = RedisLock(direct, name, ttl=30, prefix=prefix)
    assert lock.acquire(blocking=False)
    attempt = Attempt(lock, threading.get_ident(), "retried")
    here = {task.name: attempt} if hold != "none here" else {}
    record = MarkerRecord(name, prefix, mode, "return_existing", "retried",
                          True).header()
    proxy.black_hole()
    healer = threading.Timer(2.0, proxy.heal)
    loser = threading.Timer(0.8, attempt.found_lost, ("the watchdog's verdict",))
    healer.start()
    if hold == "lost":
        loser.start()
    token = attempts.set(here)
    began = time.monotonic()
    try:
        sent = task.apply_async(args, task_id="retried", lock_mode=mode,
                                headers={MARKER_HEADER: record})
    finally:
        took = time.monotonic() - began
        attempts.reset(token)
        healer.join(10)
        loser.cancel()
    assert sent.id == "retried" and _queued(r, queue) == ["retried"]
    lock.release()
    again = ("new", ("k", 0.0, "b")) if mode == "until_finished" else \
        ("retried", args)
    other = task.apply_async(again[1], task_id=again[0], lock_mode=mode)
    if hold == "stands":
        assert took >= 1.5, f"published after {took:.2f} s, before the store came back"
        assert other.id == "retried" and _queued(r, queue) == ["retried"]
    else:
        assert took < 1.9, f"published after {took:.2f} s: it waited for the store"
        assert other.id == again[0] and len(_queued(r, queue)) == 2
    app.close()
    direct.close()


def _stall(kind: str, server: EmbeddedRedis) -> Callable[[], None]:
    """Stall ``server`` now; the function that ends the stall."""
    assert server.process is not None
    if kind == "SIGSTOP":
        os.kill(server.process.pid, signal.SIGSTOP)
        pid = server.process.pid
        return lambda: os.kill(pid, signal.SIGCONT)
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("CLIENT", "PAUSE", 4000, "ALL")  # ends by itself
    ends = time.monotonic() + 4
    admin.close()
    return lambda: time.sleep(max(0.0, ends - time.monotonic()))


@pytest.mark.parametrize("kind", ("SIGSTOP", "CLIENT PAUSE"))
def test_a_send_against_a_stalled_server_leaves_no_marker_behind(
        redis_url: str, r: redis.Redis, own_server: EmbeddedRedis, prefix: str,
        kind: str) -> None:
    """The claim reaches the server and waits there; the send fails (nothing is
    published); when the server resumes, it runs the claim and the take-back, in
    either order: the name is free, and the next call is queued."""
    queue = f"q-{prefix}"
    app = _producer(redis_url, prefix, queue, lambda: redis.Redis.from_url(
        own_server.url, socket_timeout=0.5, socket_connect_timeout=0.5,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 1)))
    markers = RedisMarkers(redis.Redis.from_url(own_server.url, socket_timeout=10))
    app.tasks["pf.mode"].apply_async(("warm", 0.0, "w"))  # connected, scripts loaded
    resume = _stall(kind, own_server)
    try:
        began = time.monotonic()
        with pytest.raises(BackendUnavailable):
            app.tasks["pf.mode"].apply_async(("k", 0.0, "a"), task_id="stalled")
        assert time.monotonic() - began < 10
        time.sleep(3 * TAKE_BACK_EVERY)  # take-backs are tried meanwhile
    finally:
        resume()
    assert "stalled" not in _queued(r, queue)
    wait_for(lambda: markers.read(prefix, "mode:k") is None, 10, 0.05,
             what="the stalled claim to be taken back")
    time.sleep(2 * TAKE_BACK_EVERY)
    assert markers.read(prefix, "mode:k") is None
    nxt = app.tasks["pf.mode"].apply_async(("k", 0.0, "b"))
    assert nxt.id != "stalled" and nxt.id in _queued(r, queue)
    app.close()
    markers.client.close()


def _publish_fails_while_stalled(redis_url: str, own_server: EmbeddedRedis,
                                 prefix: str, queue: str, *,
                                 stalled_for: float) -> tuple[Any, Any, RedisMarkers]:
    """A producer whose send of ``mode:k`` as task id ``never-sent`` claims its marker,
    then fails to publish (the serializer refuses an argument) while the lock's Redis
    is SIGSTOPped (its take-back fails); the server resumes ``stalled_for`` seconds
    later.  The app, its task, and a reader of the markers."""
    app = _producer(redis_url, prefix, queue, lambda: redis.Redis.from_url(
        own_server.url, socket_timeout=0.5, socket_connect_timeout=0.5,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0)))
    markers = RedisMarkers(redis.Redis.from_url(own_server.url, socket_timeout=10))
    task = app.tasks["pf.mode"]
    task.apply_async(("warm", 0.0, "w"))  # connected, scripts loaded
    resume: list[Callable[[], None]] = []

    def stall(**_: Any) -> None:
        resume.append(_stall("SIGSTOP", own_server))

    before_task_publish.connect(stall, weak=False)
    try:
        with pytest.raises(EncodeError):  # the serializer refuses the argument
            task.apply_async(("k", 0.0, complex(1, 2)), task_id="never-sent")
    finally:
        before_task_publish.disconnect(stall)
        time.sleep(stalled_for)
        for go_on in resume:
            go_on()
    return app, task, markers


def test_a_failed_publish_whose_take_back_fails_is_taken_back_later(
        redis_url: str, r: redis.Redis, own_server: EmbeddedRedis, prefix: str) -> None:
    """The claim went through, then the lock's Redis stalls and the publish fails
    (the broker down with it, as when they are one server): the take-back cannot
    run then.  It is tried again until the server answers, so the name is not held
    for the marker's ttl by a call that was never published."""
    queue = f"q-{prefix}"
    app, task, markers = _publish_fails_while_stalled(
        redis_url, own_server, prefix, queue,
        stalled_for=2 * TAKE_BACK_EVERY)  # (the take-back tried meanwhile, in vain)
    assert "never-sent" not in _queued(r, queue)
    wait_for(lambda: markers.read(prefix, "mode:k") is None, 10, 0.05,
             what="the claim of the call never sent to be taken back")
    nxt = task.apply_async(("k", 0.0, "b"))
    assert nxt.id != "never-sent" and nxt.id in _queued(r, queue)
    app.close()
    markers.client.close()


def test_a_send_right_after_the_store_answers_again_is_not_told_of_a_call_never_sent(
        redis_url: str, r: redis.Redis, own_server: EmbeddedRedis, prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the next send of the name (from the same process) comes the
    moment the server answers again, before the take-back thread tries again (its
    period made long here): it takes the waiting claim back first, so it is queued,
    never told "a duplicate of" the call that was never published."""
    monkeypatch.setattr(takeback, "EVERY", 10.0)
    queue = f"q-{prefix}"
    app, task, markers = _publish_fails_while_stalled(
        redis_url, own_server, prefix, queue,
        stalled_for=1.0)  # the thread's first try fails; its next is 10 s away
    assert markers.read(prefix, "mode:k") is not None, "the claim was taken back early"
    nxt = task.apply_async(("k", 0.0, "b"))
    assert nxt.id != "never-sent" and nxt.id in _queued(r, queue)
    assert "never-sent" not in _queued(r, queue)
    app.close()
    markers.client.close()


@pytest.mark.parametrize("send", ("claim", "replace"))
def test_redis_restarted_between_the_claim_and_the_publish(
        harness: Harness, monkeypatch: pytest.MonkeyPatch, send: str) -> None:
    """The lock's Redis restarts (its data lost) while the call is published: the call
    is not lost (it runs, once); a replace's record is gone, yet the replaced call
    (waiting for its eta on a worker) is revoked, and only the new call runs."""
    h = harness
    lock_server = EmbeddedRedis().start()
    port = lock_server.port
    try:
        monkeypatch.setenv("DLOCK_PF_CONF", json.dumps({"dlock_url": lock_server.url}))
        h.app.conf.dlock_url = lock_server.url
        h.start_workers(count=1, concurrency=2)
        opts = {"lock_mode": "until_started", "on_duplicate": "replace"}
        task = h.app.tasks["pf.mode"]
        old = None
        if send == "replace":
            old = task.apply_async(("rs", 0.0, "old"), countdown=6, **opts)
        due = time.monotonic() + 6
        restarted = threading.Event()

        def restart(**_: Any) -> None:
            if restarted.is_set():
                return
            nonlocal lock_server
            lock_server.stop()
            lock_server = EmbeddedRedis(port=port).start()
            restarted.set()

        duplicates: list[dict[str, Any]] = []

        def seen(sender: Any = None, **info: Any) -> None:
            duplicates.append(info)

        signals.lock_duplicate.connect(seen, weak=False)
        before_task_publish.connect(restart, weak=False)
        try:
            new = task.apply_async(("rs", 0.0, "new"), **opts)
        finally:
            before_task_publish.disconnect(restart)
            signals.lock_duplicate.disconnect(seen)
        assert restarted.is_set()
        # A replace sends its revoke (and its signal) all the same.
        assert [d["existing"] for d in duplicates] == ([old.id] if old else [])
        assert new.get(timeout=30) == "new"
        wait_for(lambda: time.monotonic() > due + 2, 15, 0.1, what="the old eta")
        assert [run["tag"] for run in h.records("mode", "rs")] == ["new"]
    finally:
        with contextlib.suppress(Exception):
            lock_server.stop()
