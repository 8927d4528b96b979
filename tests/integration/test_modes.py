"""Enqueue-time uniqueness (``lock_mode``, ``on_duplicate``) on a real broker and real
prefork workers: what reaches the queue, what runs, and when a lock name frees.

Messages are counted in the broker's own list (the Redis transport keeps a queue as
a list named after it), so "exactly one queued" is read from the broker, not inferred.

The tests that ask for ``store_harness`` run with the locks and queue markers on each
store that keeps them (Redis, PostgreSQL, MySQL/MariaDB; the broker, results and the
tasks' records stay on Redis), and read markers and holders through the store.  The
others run on Redis only: they read or write Redis keys (a marker's or a rate's), or
they are about the send path or the broker rather than the store.
"""

from __future__ import annotations

import gc
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain, chord, group
from celery_helpers import canvas_follows_before_57
from kombu.exceptions import EncodeError
from worker_harness import Harness, assert_disjoint, open_harness, wait_for

from celery_dlock import DROPPED, AlreadyQueued, DroppedResult, InvalidLockConfig
from celery_dlock.core.lock_options import LockOptions
from celery_dlock.task.backend import backend_for, markers_for

pytestmark = pytest.mark.slow

MODES = ("until_started", "until_finished", "queued_and_running", "throttle")


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


def queued(h: Harness) -> list[dict[str, Any]]:
    """The messages waiting in the test's queue: their headers."""
    return [json.loads(raw)["headers"] for raw in h.r.lrange(h.queue, 0, -1)]


def queued_ids(h: Harness, key: str) -> list[str]:
    """The calls of ``key`` queued (a duplicate's follower, which never runs a body,
    is not one)."""
    return [m["id"] for m in queued(h) if f"'{key}'" in m.get("argsrepr", "")
            and "dlock_follows" not in m]


def send(h: Harness, key: str, tag: str, seconds: float = 0.0, **options: Any) -> Any:
    return h.app.tasks["pf.mode"].apply_async((key, seconds, tag), **options)


def runs(h: Harness, key: str) -> list[dict[str, Any]]:
    return h.records("mode", key)


def marker(h: Harness, key: str) -> str | None:
    """The task id in the marker of ``key``, read through the app's store."""
    found = markers_for(h.app).read(h.prefix, f"mode:{key}")
    return found[0] if found is not None else None


def holder(h: Harness, name: str) -> Any:
    """The hold of lock ``name`` (None when free), read through the app's store."""
    return backend_for(h.app).read(h.prefix, name)


# -- at the broker (no worker: every call stays queued) ------------------------------

# Each of the 8 sender threads reads a queued call's state from the result store
# (Celery's Redis result backend) when told a duplicate; those per-thread clients are
# dropped unclosed by Celery when the threads end, which Python reports as unclosed
# sockets (seen with the slower ZooKeeper store, whose claims overlap more).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("mode", MODES)
def test_enqueue_races_never_queue_two(store_harness: Harness, mode: str) -> None:
    """8 clients behind a barrier, many rounds: exactly one message per round."""
    h = store_harness
    clients, rounds = 8, 12
    for n in range(rounds):
        barrier = threading.Barrier(clients)
        results: list[Any] = []
        errors: list[BaseException] = []

        def client(i: int, n: int = n, barrier: threading.Barrier = barrier,
                   results: list[Any] = results,
                   errors: list[BaseException] = errors) -> None:
            try:
                barrier.wait(timeout=10)
                results.append(send(h, f"race-{mode}-{n}", f"c{i}", lock_mode=mode))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors
        ids = queued_ids(h, f"race-{mode}-{n}")
        assert len(ids) == 1, f"round {n}: {len(ids)} messages queued"
        # Every client got the one queued call (return_existing is the default).
        assert {res.id for res in results} == {ids[0]}
        results.clear()
    # The results' consumers and those clients go now, while the harness's Redis is
    # still up and the warnings above are ignored.
    gc.collect()


def test_the_default_mode_queues_every_call_and_claims_nothing(
        store_harness: Harness) -> None:
    h = store_harness
    for i in range(3):
        send(h, "plain", f"c{i}", lock_mode="while_running")
    assert len(queued_ids(h, "plain")) == 3
    assert marker(h, "plain") is None


def test_each_duplicate_policy(store_harness: Harness) -> None:
    h = store_harness
    first = send(h, "pol", "first", lock_mode="until_started")
    existing = send(h, "pol", "again", lock_mode="until_started",
                    on_duplicate="return_existing")
    assert existing.id == first.id
    with pytest.raises(AlreadyQueued) as raised:
        send(h, "pol", "again", lock_mode="until_started", on_duplicate="raise")
    assert raised.value.task_id == first.id
    assert raised.value.countdown is not None and raised.value.countdown > 0
    dropped = send(h, "pol", "again", lock_mode="until_started", on_duplicate="drop")
    assert isinstance(dropped, DroppedResult)
    assert dropped.state == DROPPED and dropped.ready() and dropped.get() is None
    assert dropped.duplicate_of == first.id and dropped.id != first.id
    # The spelling in headers works too, and a keyword beats it.
    with pytest.raises(AlreadyQueued):
        h.app.tasks["pf.mode"].apply_async(
            ("pol", 0.0, "h"), headers={"lock_mode": "until_started",
                                        "on_duplicate": "raise"})
    again = h.app.send_task("pf.mode", ("pol", 0.0, "by-name"),
                            lock_mode="until_started", on_duplicate="return_existing")
    assert again.id == first.id
    assert queued_ids(h, "pol") == [first.id]


def test_a_failed_publish_leaves_no_marker(store_harness: Harness) -> None:
    h = store_harness
    # An argument the json serializer cannot encode: the publish fails after the
    # marker was claimed (the lock name reads only ``key``).  On a connection of its
    # own: kombu closes the connection of a publish that failed, and a pooled one
    # whose channel still waits on a BRPOP it sent earlier can block that close.
    with h.app.connection_for_write() as connection, pytest.raises(EncodeError):
        h.app.tasks["pf.mode"].apply_async(("nopub", object(), "x"),
                                           lock_mode="until_started",
                                           connection=connection)
    assert marker(h, "nopub") is None
    assert send(h, "nopub", "y", lock_mode="until_started").id == marker(h, "nopub")


def test_bad_values_are_refused_where_the_call_is_made(harness: Harness) -> None:
    h = harness
    with pytest.raises(InvalidLockConfig, match="lock_mode"):
        send(h, "bad", "x", lock_mode="nope")
    with pytest.raises(InvalidLockConfig, match="lock_queue_ttl"):
        send(h, "bad", "x", lock_queue_ttl=-1)
    with pytest.raises(InvalidLockConfig, match="on_duplicate"):
        send(h, "bad", "x", on_duplicate="ignore")
    with pytest.raises(InvalidLockConfig, match="throttle"):
        send(h, "bad", "x", lock_mode="throttle", on_duplicate="replace")
    assert queued(h) == []


def _left(h: Harness, key: str) -> float:
    """The seconds left of the marker of ``key``, read through the app's store."""
    found = markers_for(h.app).read(h.prefix, f"mode:{key}")
    assert found is not None and found[1] is not None, found
    return found[1]


def test_countdown_makes_the_marker_outlive_the_eta(store_harness: Harness) -> None:
    h = store_harness
    send(h, "eta", "x", lock_mode="until_started", lock_queue_ttl=5, countdown=60)
    assert 60 < _left(h, "eta") <= 65
    send(h, "exp", "x", lock_mode="until_started", lock_queue_ttl=600, expires=20)
    assert 0 < _left(h, "exp") <= 20


# -- on workers ----------------------------------------------------------------------

def test_until_started_frees_the_name_when_the_call_starts(
        store_harness: Harness) -> None:
    h = store_harness
    h.start_workers(count=1, concurrency=2)
    a = send(h, "us", "a", 1.5, lock_mode="until_started")
    wait_for(lambda: h.records("mode-start", "us"), 20, what="a to start")
    assert marker(h, "us") is None
    b = send(h, "us", "b", 0.0, lock_mode="until_started")  # queues during a's run
    assert b.id != a.id
    assert a.get(timeout=30) == "a" and b.get(timeout=30) == "b"
    assert [run["tag"] for run in runs(h, "us")] == ["a", "b"]
    assert_disjoint(runs(h, "us"))


def test_until_finished_holds_the_name_until_the_call_ends(
        store_harness: Harness) -> None:
    h = store_harness
    h.start_workers(count=1, concurrency=2)
    a = send(h, "uf", "a", 1.5)
    wait_for(lambda: h.records("mode-start", "uf"), 20, what="a to start")
    assert send(h, "uf", "b").id == a.id  # running: a duplicate
    assert a.get(timeout=30) == "a"
    wait_for(lambda: holder(h, "mode:uf") is None, 10, what="the release")
    c = send(h, "uf", "c")
    assert c.id != a.id and c.get(timeout=30) == "c"
    assert [run["tag"] for run in runs(h, "uf")] == ["a", "c"]


def test_queued_and_running_lets_one_wait_behind_the_running_one(
        store_harness: Harness) -> None:
    h = store_harness
    h.start_workers(count=1, concurrency=2)
    opts = {"lock_mode": "queued_and_running"}
    a = send(h, "qr", "a", 2.0, **opts)
    wait_for(lambda: h.records("mode-start", "qr"), 20, what="a to start")
    b = send(h, "qr", "b", 0.0, **opts)
    c = send(h, "qr", "c", 0.0, **opts)
    assert b.id != a.id and c.id == b.id
    assert a.get(timeout=30) == "a" and b.get(timeout=30) == "b"
    assert [run["tag"] for run in runs(h, "qr")] == ["a", "b"]
    assert_disjoint(runs(h, "qr"))


@pytest.mark.parametrize("mode", ("until_started", "queued_and_running",
                                  "until_finished"))
def test_the_retry_of_a_started_call_is_never_superseded(store_harness: Harness,
                                                         mode: str) -> None:
    """a starts and asks for a retry (self.retry); b is sent while a runs, for later
    (until_started, queued_and_running: the name freed when a started, so b queues
    and holds the marker when a's retry starts; until_finished: b is a duplicate of
    the running a, and the retry takes the name again).  a's retry runs all the same,
    b runs once, nothing overlaps."""
    h = store_harness
    h.start_workers(count=1, concurrency=2)
    task = h.app.tasks["pf.mode_retry"]
    a = task.apply_async(("rt", 1.0, "a"), {"retry_in": 1.0}, lock_mode=mode)
    wait_for(lambda: h.records("mode-start", "rt"), 20, what="a to start")
    b = task.apply_async(("rt", 0.0, "b"), lock_mode=mode, countdown=4)
    assert (b.id == a.id) == (mode == "until_finished")
    wait_for(lambda: runs(h, "rt"), 20, what="a's first attempt to end")
    # Between a's attempts: a call sent now is a duplicate of the queued one.
    c = task.apply_async(("rt", 0.0, "c"), lock_mode=mode)
    assert c.id == b.id
    assert a.get(timeout=30) == "a"
    assert b.get(timeout=30) == ("a" if mode == "until_finished" else "b")
    done = runs(h, "rt")
    assert [(run["tag"], run["attempt"]) for run in done] == \
        [("a", 0), ("a", 1)] + ([] if mode == "until_finished" else [("b", 0)])
    assert_disjoint(done)


def test_throttle_runs_once_per_window_counted_from_the_enqueue(
        store_harness: Harness) -> None:
    h = store_harness
    h.start_workers(count=1, concurrency=2)
    opts = {"lock_mode": "throttle", "lock_ttl": 2, "on_duplicate": "drop"}
    a = send(h, "th", "a", **opts)
    assert a.get(timeout=30) == "a"
    dropped = send(h, "th", "b", **opts)  # finished, but inside the window
    assert isinstance(dropped, DroppedResult)
    wait_for(lambda: marker(h, "th") is None, 10, what="the window to end")
    assert send(h, "th", "c", **opts).get(timeout=30) == "c"
    assert [run["tag"] for run in runs(h, "th")] == ["a", "c"]


def test_a_replace_never_stops_a_started_call_between_its_attempts(
        store_harness: Harness) -> None:
    """until_finished: a started and asked for a retry, which holds the name; a call
    sent with replace between a's attempts finds it queued (a started call is never
    stopped: replace acts as return_existing), and a's retry runs."""
    h = store_harness
    h.start_workers(count=1, concurrency=2)
    task = h.app.tasks["pf.mode_retry"]
    opts = {"lock_mode": "until_finished", "on_duplicate": "replace"}
    a = task.apply_async(("rr", 0.5, "a"), {"retry_in": 1.5}, **opts)
    wait_for(lambda: runs(h, "rr"), 20, what="a's first attempt to end")
    wait_for(lambda: holder(h, "mode:rr") is None, 10,
             what="a's first attempt's release")
    assert marker(h, "rr") == a.id  # its retry holds the name
    c = task.apply_async(("rr", 0.0, "c"), **opts)
    assert c.id == a.id
    assert a.get(timeout=30) == "a"
    assert [(run["tag"], run["attempt"]) for run in runs(h, "rr")] == \
        [("a", 0), ("a", 1)]


@pytest.mark.parametrize("requeue", ("contention", "rate"))
def test_a_requeue_never_restarts_the_throttle_window(harness: Harness,
                                                      requeue: str) -> None:
    """A throttle call is accepted at t0 (window 3 s) and delivered at t0 + 1.5 s,
    where it is re-queued (its lock held elsewhere: a contention retry; its rate used
    up: a park).  The window still ends at t0 + 3 s: a call sent after that is
    accepted, and both run once."""
    from celery_dlock.backends.redis.rate import RedisRates
    from celery_dlock.core.rates import parse_rate
    from celery_dlock.task.backend import backend_for

    h = harness
    h.start_workers(count=1, concurrency=2)
    task, name, window = h.app.tasks["pf.rated"], "rated:thw", 3.0
    opts = {"lock_mode": "throttle", "lock_ttl": window, "on_duplicate": "drop",
            "on_contention": "retry"}
    blocker = backend_for(h.app).lock(LockOptions(name, 10, prefix=h.prefix))
    t0 = time.monotonic()
    a = task.apply_async(("thw", 1), countdown=1.5, **opts)
    if requeue == "contention":
        assert blocker.acquire(blocking=False)
    else:  # the next 2 s of the name's rate (5/s) are taken
        for _ in range(10):
            RedisRates(h.r).take(h.prefix, name, parse_rate("5/s"))
    try:
        wait_for(lambda: a.state == "RETRY", 20, what="a to be re-queued")
        pttl = h.r.pttl(h.lock_key(name) + ":m")
        assert 0 < pttl <= (window - (time.monotonic() - t0)) * 1000 + 300, \
            f"the re-queue restarted the window: {pttl} ms left"
        wait_for(lambda: time.monotonic() - t0 > window + 0.2, window + 5,
                 what="the window to end")
        b = task.apply_async(("thw", 2), **opts)
        assert not isinstance(b, DroppedResult), "the window outlived its 3 s"
    finally:
        if blocker.owned():
            blocker.release()
    assert a.get(timeout=30) == 1 and b.get(timeout=30) == 2
    assert sorted(run["n"] for run in h.records("rated", "thw")) == [1, 2]


def test_replace_keeps_the_latest_arguments_and_runs_once(
        store_harness: Harness) -> None:
    h = store_harness
    opts = {"lock_mode": "until_started", "on_duplicate": "replace"}
    old = send(h, "rp", "old", **opts)
    mid = send(h, "rp", "mid", **opts)
    new = send(h, "rp", "new", **opts)
    assert len({old.id, mid.id, new.id}) == 3
    assert marker(h, "rp") == new.id
    h.start_workers(count=1, concurrency=2)
    assert new.get(timeout=30) == "new"
    wait_for(lambda: old.state == "REVOKED" and mid.state == "REVOKED", 20,
             what="the replaced calls to be revoked")
    time.sleep(0.5)
    assert [run["tag"] for run in runs(h, "rp")] == ["new"]


def _canvas(h: Harness, kind: str, key: str, policy: str) -> tuple[Any, Any]:
    """A group, chord or chain whose members of ``key`` are duplicates: the result
    its caller waits on, and what it must give."""
    m = h.app.tasks["pf.mode"]

    def dup(tag: str) -> Any:
        return m.si(key, 0.0, tag).set(on_duplicate=policy)

    got = None if policy == "drop" else "x"  # what each duplicate member gets
    if kind == "group":
        return group(dup("b"), dup("c")).apply_async(), [got, got]
    if kind == "chord":
        return chord([dup("b"), dup("c")], m.si(f"{key}-body", 0.0, "body")
                     ).apply_async(), "body"
    if kind == "chord_body":  # the body, sent by the result store, is the duplicate
        return chord([m.si(f"{key}-head", 0.0, "head")], dup("b")).apply_async(), got
    if kind == "chain_link":  # a later link, sent by the worker: the duplicate
        return chain(m.si(f"{key}-head", 0.0, "head"), dup("b")).apply_async(), got
    return chain(dup("b"), m.si(f"{key}-tail", 0.0, "tail")).apply_async(), "tail"


@pytest.mark.parametrize("policy", ("return_existing", "drop", "raise"))
@pytest.mark.parametrize("kind", ("group", "chord",
                                  pytest.param("chord_body",
                                               marks=canvas_follows_before_57),
                                  "chain", "chain_link"))
def test_a_canvas_with_a_duplicate_member_completes(harness: Harness, kind: str,
                                                    policy: str) -> None:
    """x of a name is running; a group, a chord or a chain with members of that name
    is sent.  The duplicate members never run a body, yet each one's own id gets an
    outcome: x's result (return_existing), None (drop), AlreadyQueued (raise); the
    canvas completes and its get() returns (or raises) instead of hanging."""
    h = harness
    h.start_workers(count=1, concurrency=2)
    key = f"cv-{kind}-{policy}"
    x = send(h, key, "x", 1.5)
    wait_for(lambda: h.records("mode-start", key), 20, what="x to start")
    result, expected = _canvas(h, kind, key, policy)
    if policy == "raise":
        with pytest.raises(Exception, match="already queued"):
            result.get(timeout=20, disable_sync_subtasks=False)
    else:
        assert result.get(timeout=20, disable_sync_subtasks=False) == expected
    assert x.get(timeout=20) == "x"
    time.sleep(0.3)
    assert [run["tag"] for run in runs(h, key)] == ["x"]
    assert marker(h, key) is None and h.owner(f"mode:{key}") is None


def test_a_follower_of_a_lost_call_runs_itself(harness: Harness) -> None:
    """The queued call a group member duplicates was lost (its message purged: only
    its marker is left, 1.5 s of it): the member waits while the marker lasts, then
    runs as the call it is, once."""
    h = harness
    h.start_workers(count=1, concurrency=2)
    h.r.set(h.lock_key("mode:lost") + ":m", "purged-call", px=1500)
    result = group(h.app.tasks["pf.mode"].si("lost", 0.0, "b")).apply_async()
    assert result.get(timeout=30) == ["b"]
    assert [run["tag"] for run in runs(h, "lost")] == ["b"]
    assert marker(h, "lost") is None and h.owner("mode:lost") is None


@canvas_follows_before_57
def test_a_canvas_sent_again_with_its_ids_runs_once(harness: Harness) -> None:
    """A frozen group applied twice: each member is sent again with its own task id,
    a duplicate of itself, so no follower is sent for it; each runs once."""
    h = harness
    m = h.app.tasks["pf.mode"]
    canvas = group(m.si("again-a", 0.5, "a"), m.si("again-b", 0.5, "b"))
    result = canvas.freeze()
    canvas.apply_async()
    canvas.apply_async()
    assert sorted(msg["id"] for msg in queued(h)) == \
        sorted(r.id for r in result.results)
    h.start_workers(count=1, concurrency=2)
    assert result.get(timeout=30) == ["a", "b"]
    time.sleep(1.0)  # a second message would have run by now
    assert [run["tag"] for run in runs(h, "again-a") + runs(h, "again-b")] == \
        ["a", "b"]


def test_a_revoked_queued_call_frees_its_marker(harness: Harness) -> None:
    """A call queued behind a busy worker is revoked: its name frees (at the latest
    when the worker discards the message; at once where the worker records the revoke
    in the result store), the next call queues, and only it runs."""
    h = harness
    h.start_workers(count=1, concurrency=1)
    busy = send(h, "rv-busy", "busy", 2.0)
    wait_for(lambda: h.records("mode-start", "rv-busy"), 20, what="the busy call")
    opts = {"lock_mode": "until_finished", "on_duplicate": "raise"}
    a = send(h, "rv", "a", **opts)
    with pytest.raises(AlreadyQueued):
        send(h, "rv", "again", **opts)
    a.revoke()

    def accepted() -> Any:
        try:
            return send(h, "rv", "b", **opts)
        except AlreadyQueued:
            time.sleep(0.1)
            return None

    b = wait_for(accepted, 30, what="the next call to be accepted")
    assert b.id != a.id
    assert b.get(timeout=30) == "b" and busy.get(timeout=30) == "busy"
    time.sleep(0.5)
    assert [run["tag"] for run in runs(h, "rv")] == ["b"]


def test_a_call_that_does_not_run_frees_its_marker(store_harness: Harness) -> None:
    """skip under contention: the call ends without running; its name is free."""
    h = store_harness
    h.start_workers(count=1, concurrency=2)
    a = send(h, "sk", "a", 2.0, lock_mode="queued_and_running")
    wait_for(lambda: h.records("mode-start", "sk"), 20, what="a to start")
    b = send(h, "sk", "b", 0.0, lock_mode="queued_and_running", on_contention="skip")
    b.get(timeout=30)
    # (the skip's result is stored just before the attempt ends and frees the marker;
    # a call sent in between finds b ended and takes the marker anyway)
    wait_for(lambda: marker(h, "sk") is None, 5, what="b's marker to go")
    assert a.get(timeout=30) == "a"
    assert [run["tag"] for run in runs(h, "sk")] == ["a"]


def test_a_killed_worker_frees_an_until_finished_name_within_the_lock_ttl(
        harness: Harness) -> None:
    h = harness
    worker, = h.start_workers(count=1, concurrency=1)
    a = send(h, "kill", "a", 60.0)
    wait_for(lambda: h.records("mode-start", "kill"), 20, what="a to start")
    assert send(h, "kill", "b").id == a.id
    worker.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: h.owner("mode:kill") is None, 3 + 5, 0.05, what="the lock to expire")
    assert time.monotonic() - killed_at <= 3 + 2  # lock_ttl 3 s, generous slack
    c = send(h, "kill", "c")
    assert c.id != a.id and marker(h, "kill") == c.id


def test_dlock_enabled_false_turns_markers_and_locks_off(harness: Harness) -> None:
    h = harness
    h.app.conf.dlock_enabled = False
    try:
        for i in range(2):
            send(h, "off", f"c{i}", lock_mode="until_started")
        assert len(queued_ids(h, "off")) == 2
        assert marker(h, "off") is None
    finally:
        h.app.conf.dlock_enabled = True


# -- every route a call can take to the broker ----------------------------------------

def _beat(h: Harness, key: str, tag: str) -> Any:
    from celery.beat import ScheduleEntry, Scheduler

    entry = ScheduleEntry(name=f"beat-{tag}", task="pf.mode", schedule=60.0,
                          args=(key, 0.0, tag), app=h.app)
    return Scheduler(h.app, lazy=True).apply_async(entry, advance=False)


ROUTES = {
    "delay": lambda h, key, tag: h.app.tasks["pf.mode"].delay(key, 0.0, tag),
    "apply_async": send,
    "send_task": lambda h, key, tag: h.app.send_task("pf.mode", (key, 0.0, tag)),
    "signature": lambda h, key, tag: h.app.signature(
        "pf.mode", (key, 0.0, tag)).apply_async(),
    "chain": lambda h, key, tag: chain(h.app.tasks["pf.mode"].si(key, 0.0, tag),
                                       h.app.tasks["pf.mode"].si("other", 0.0, tag)
                                       ).apply_async(),
    "group": lambda h, key, tag: group(h.app.tasks["pf.mode"].si(key, 0.0, tag)
                                       for _ in range(2)).apply_async(),
    "chord": lambda h, key, tag: chord(
        [h.app.tasks["pf.mode"].si(key, 0.0, tag)],
        h.app.tasks["pf.mode"].si("after", 0.0, tag)).apply_async(),
    "beat": _beat,
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_route_to_the_broker_is_de_duplicated(harness: Harness,
                                                    route: str) -> None:
    """pf.mode is until_finished on the task: however a call is sent, a second call of
    its name is not queued."""
    h = harness
    h.app.finalize()  # a producer that sends by name has loaded its tasks
    key = f"route-{route}"
    ROUTES[route](h, key, "first")
    ROUTES[route](h, key, "second")
    assert len(queued_ids(h, key)) == 1
    assert marker(h, key) == queued_ids(h, key)[0]
    if route not in ("chain", "group", "chord"):  # outside a canvas: no follower
        assert len(queued(h)) == 1


def test_per_call_keywords_reach_the_worker(harness: Harness) -> None:
    """lock_ttl, on_contention and lock_wait as keywords travel in the message."""
    h = harness
    send(h, "kw", "a", lock_ttl=7, on_contention="skip", lock_wait=1,
         lock_mode="until_started")
    headers, = queued(h)
    assert (headers["lock_ttl"], headers["on_contention"], headers["lock_wait"]) == \
        (7, "skip", 1)
    assert headers["dlock_marker"]["mode"] == "until_started"


@pytest.mark.parametrize("mode", MODES)
def test_no_mode_lets_two_bodies_of_one_name_overlap(store_harness: Harness,
                                                     mode: str) -> None:
    """The runtime lock stays the authority: retries and duplicate deliveries aside,
    calls accepted in any mode never run at once."""
    h = store_harness
    h.start_workers(count=2, concurrency=2)
    results = []
    for i in range(12):
        results.append(send(h, "ov", f"c{i}", 0.15, lock_mode=mode, lock_ttl=1,
                            on_duplicate="drop"))
        time.sleep(0.05)
    for res in results:
        res.get(timeout=60)
    done = runs(h, "ov")
    assert done, "nothing ran"
    assert_disjoint(done)


@pytest.mark.parametrize(("option", "value"), [
    ("lock_mode", "nope"), ("lock_queue_ttl", -1), ("on_duplicate", "skip")])
def test_bad_values_are_refused_at_declaration(option: str, value: Any) -> None:
    from celery import Celery

    from celery_dlock import LockedTask

    app = Celery("declaration", set_as_current=False)
    with pytest.raises(InvalidLockConfig, match=option):
        @app.task(base=LockedTask, name=f"bad.{option}", lock_key="k", shared=False,
                  **{option: value})
        def bad() -> None: ...

        app.finalize()


def test_throttle_with_replace_is_refused_at_declaration() -> None:
    from celery_dlock import LockedTask

    with pytest.raises(InvalidLockConfig, match="throttle"):
        type("Bad", (LockedTask,), {"lock_mode": "throttle", "on_duplicate": "replace",
                                    "lock_key": "k", "run": lambda self: None})
