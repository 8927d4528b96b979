"""Queue markers on ZooKeeper (:class:`~celery_dlock.backends.zookeeper.markers.
ZkMarkers`): the marker protocol's key orders replayed against a real ZooKeeper (the
same orders and replies as on Redis: tests/faults/test_marker_model_orders.py,
test_marker_faults.py), a running holder being a real ZooKeeper lock held with
``info={"task_id": ...}``; and what is ZooKeeper's own: foreign data at a marker
node, reading that makes no node, an unreachable ensemble, a write whose reply was
lost (docs/backends.md, "Queue markers on ZooKeeper").
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from proxy import FaultProxy

pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper extra)")

from celery_dlock import BackendUnavailable, LockKeyConflict
from celery_dlock.backends.zookeeper import ZooKeeperLock, backend_from_url
from celery_dlock.backends.zookeeper.markers import ZkMarkers
from celery_dlock.backends.zookeeper.nodes import marker_path
from celery_dlock.backends.zookeeper.session import close_sessions
from celery_dlock.task.markers import CLAIMED, OURS, PENDING, QUEUED, REPLACED, RUNNING

#: The marker modes by whether a running call is a duplicate of a new one.
RUNNING_COUNTS = {"until_finished": True, "until_started": False,
                  "queued_and_running": False}


@pytest.fixture
def zk_url(zk_server: Any) -> str:
    return str(zk_server.url)


@pytest.fixture
def m(zk_url: str) -> ZkMarkers:
    return backend_from_url(zk_url).markers()


@pytest.fixture
def view(zk_url: str) -> Iterator[Any]:
    from zk_server import ZkView

    found = ZkView(zk_url.removeprefix("zookeeper://"))
    try:
        yield found
    finally:
        found.close()


def claim(m: ZkMarkers, prefix: str, name: str, task_id: str, op: str, *,
          replace: bool = False, ttl: float = 60.0,
          running_counts: bool = True) -> tuple[int, str, float | None]:
    """A send's claim; by default as ``until_finished`` makes it."""
    return m.claim(prefix, name, task_id, ttl, running_counts=running_counts,
                   replace=replace, requeue=False, op=op)


def start(m: ZkMarkers, prefix: str, name: str, task_id: str, *,
          running_counts: bool = True, keep: float = 0.0) -> str | None:
    """A call's hand-over at its start (the mode as for :func:`claim`)."""
    return m.hand_over(prefix, name, task_id, remove=True, replaced_check=True,
                       running_counts=running_counts, keep=keep)


def marked(m: ZkMarkers, prefix: str, name: str) -> str | None:
    found = m.read(prefix, name)
    return None if found is None else found[0]


def running(url: str, prefix: str, name: str, task_id: str) -> ZooKeeperLock:
    """The call ``task_id`` holding the name's lock (a started call)."""
    lock = ZooKeeperLock(url, name, 30, prefix=prefix, info={"task_id": task_id})
    assert lock.acquire(blocking=False)
    return lock


# -- the protocol's orders --------------------------------------------------------------

def test_a_claim_a_duplicate_and_the_start(m: ZkMarkers, prefix: str, name: str) -> None:
    assert m.read(prefix, name) is None
    assert claim(m, prefix, name, "1", "op1") == (CLAIMED, "", None)
    code, other, left = claim(m, prefix, name, "2", "op2")
    assert (code, other) == (QUEUED, "1") and left is not None and 55 < left <= 60
    assert claim(m, prefix, name, "1", "op1")[:2] == (CLAIMED, "")  # re-sent: first reply
    assert claim(m, prefix, name, "1", "op3")[:2] == (QUEUED, "1")  # its id sent again
    task_id, left = m.read(prefix, name) or ("", None)
    assert task_id == "1" and left is not None and 55 < left <= 60
    assert start(m, prefix, name, "1") is None
    assert m.read(prefix, name) is None
    assert claim(m, prefix, name, "3", "op4")[0] == CLAIMED


def test_a_replace_its_confirm_and_the_replaced_calls_start(
        m: ZkMarkers, prefix: str, name: str) -> None:
    claim(m, prefix, name, "old", "op1")
    assert claim(m, prefix, name, "new", "op2", replace=True)[:2] == (REPLACED, "old")
    assert claim(m, prefix, name, "newer", "op3", replace=True)[:2] == (PENDING, "new")
    assert m.confirm(prefix, name, "new") is True
    assert marked(m, prefix, name) == "new"
    assert start(m, prefix, name, "old") == "new"  # superseded: never runs
    assert start(m, prefix, name, "new") is None
    assert m.confirm(prefix, name, "nobody") is True  # nothing known: revoke all the same


def test_a_failed_publish_gives_the_name_back(m: ZkMarkers, prefix: str,
                                              name: str) -> None:
    """(OP_IN_RECORD) 1 claims and its reply is lost; 2 replaces 1, and 2's publish
    fails: the name goes back to 1; 1's re-sent claim gets its first reply."""
    assert claim(m, prefix, name, "1", "op1")[0] == CLAIMED
    assert claim(m, prefix, name, "2", "op2", replace=True)[:2] == (REPLACED, "1")
    assert m.undo(prefix, name, "2", "op2", 60) is True
    assert m.undo(prefix, name, "2", "op2", 60) is True  # re-sent: the first reply
    assert claim(m, prefix, name, "1", "op1")[:2] == (CLAIMED, "")
    assert marked(m, prefix, name) == "1"
    assert start(m, prefix, name, "1") is None


def test_a_resent_claim_of_a_replace_taken_back_is_not_claimed_anew(
        m: ZkMarkers, prefix: str, name: str) -> None:
    """(CLAIM_REPLACED) 3 queued; 2 replaces it (reply lost); 3 starts and takes the
    replace back; 2's claim re-sent is a duplicate, and 2 never runs."""
    assert claim(m, prefix, name, "3", "op3")[0] == CLAIMED
    assert claim(m, prefix, name, "2", "op2", replace=True)[:2] == (REPLACED, "3")
    assert start(m, prefix, name, "3") is None
    assert claim(m, prefix, name, "2", "op2", replace=True)[0] == QUEUED
    assert m.read(prefix, name) is None
    assert claim(m, prefix, name, "1", "op1", replace=True)[0] == CLAIMED
    assert m.undo(prefix, name, "1", "op1", 60) is True
    assert m.read(prefix, name) is None
    assert start(m, prefix, name, "2") is not None


def test_a_claim_taken_back_before_it_ran_does_nothing_when_it_runs(
        m: ZkMarkers, prefix: str, name: str) -> None:
    assert m.undo(prefix, name, "late", "op1", 60) is False
    assert claim(m, prefix, name, "late", "op1")[0] == QUEUED
    assert m.read(prefix, name) is None
    assert claim(m, prefix, name, "next", "op2")[0] == CLAIMED


@pytest.mark.parametrize("mode", RUNNING_COUNTS)
def test_a_running_holder_is_a_duplicate_only_in_until_finished(
        m: ZkMarkers, zk_url: str, prefix: str, name: str, mode: str) -> None:
    counts = RUNNING_COUNTS[mode]
    assert claim(m, prefix, name, "1", "op1", running_counts=counts)[0] == CLAIMED
    lock = running(zk_url, prefix, name, "1")
    try:
        assert start(m, prefix, name, "1", running_counts=counts) is None
        code, other, left = claim(m, prefix, name, "2", "op2", running_counts=counts)
        if counts:
            assert (code, other) == (RUNNING, "1") and left is not None and left > 0
            assert m.read(prefix, name) is None  # nothing written
        else:
            assert code == CLAIMED and marked(m, prefix, name) == "2"
        # a send with the running call's own id is that call, in every mode
        code, other, _ = claim(m, prefix, name, "1", "op3", running_counts=counts,
                               replace=True)
        assert (code, other) == (RUNNING, "1")
    finally:
        lock.release()
    if counts:
        assert claim(m, prefix, name, "2", "op4")[0] == CLAIMED  # free once it ends


@pytest.mark.parametrize("mode", ["until_started", "queued_and_running"])
def test_a_started_call_is_kept_among_the_waiting_until_it_ends(
        m: ZkMarkers, prefix: str, name: str, mode: str) -> None:
    """Its hand-over keeps it (``keep``): a send of its task id is that call, a new
    call is queued; its end (``clear``) forgets it."""
    claim(m, prefix, name, "1", "op1", running_counts=False)
    assert start(m, prefix, name, "1", running_counts=False, keep=60) is None
    code, other, left = claim(m, prefix, name, "1", "op2", running_counts=False)
    assert (code, other) == (QUEUED, "1") and left is not None and 55 < left <= 60
    assert claim(m, prefix, name, "2", "op3", running_counts=False)[0] == CLAIMED
    assert m.clear(prefix, name, "1") is False  # not its marker: 2's stays
    assert marked(m, prefix, name) == "2"
    assert m.clear(prefix, name, "2") is True
    assert claim(m, prefix, name, "1", "op4", running_counts=False)[0] == CLAIMED


@pytest.mark.parametrize("mode", RUNNING_COUNTS)
def test_a_dead_processs_call_is_kept_live_only_if_it_had_started(
        m: ZkMarkers, prefix: str, name: str, mode: str) -> None:
    counts = RUNNING_COUNTS[mode]

    def keep(task_id: str) -> bool:
        return m.keep_for_redelivery(prefix, name, task_id, 60.0, running_counts=counts)

    assert claim(m, prefix, name, "queued", "op1", running_counts=counts)[0] == CLAIMED
    assert keep("queued") is False
    assert claim(m, prefix, name, "new", "op2", replace=True,
                 running_counts=counts)[:2] == (REPLACED, "queued")
    assert m.confirm(prefix, name, "new") is True
    assert keep("queued") is False
    assert start(m, prefix, name, "queued", running_counts=counts) == "new"
    assert start(m, prefix, name, "new", running_counts=counts) is None
    assert keep("new") is True
    code, other, _ = claim(m, prefix, name, "new", "op3", running_counts=counts)
    assert (code, other) == (QUEUED, "new")
    code, other, _ = claim(m, prefix, name, "later", "op4", running_counts=counts)
    if counts:
        assert (code, other) == (QUEUED, "new")
    else:
        assert code == CLAIMED
    assert start(m, prefix, name, "new", running_counts=counts) is None
    assert marked(m, prefix, name) == (None if counts else "later")


def test_a_requeue_keeps_the_marker_and_a_replaced_one_stays_replaced(
        m: ZkMarkers, prefix: str, name: str) -> None:
    claim(m, prefix, name, "a", "op1", ttl=5)
    code, _, _ = m.claim(prefix, name, "a", 600, running_counts=True, replace=False,
                         requeue=True, op="op2")  # a contention retry
    assert code == OURS
    _, left = m.read(prefix, name) or ("", None)
    assert left is not None and left > 590
    claim(m, prefix, name, "b", "op3", replace=True)
    assert m.confirm(prefix, name, "b") is True
    code, _, _ = m.claim(prefix, name, "a", 600, running_counts=True, replace=False,
                         requeue=True, op="op4")
    assert code == QUEUED and marked(m, prefix, name) == "b"
    assert start(m, prefix, name, "a") == "b"


def test_racing_claims_queue_one_call(m: ZkMarkers, prefix: str, name: str) -> None:
    """Eight threads claim one name at once, many rounds: each round one claim
    wins, and every other is told that call (the compare-and-set: a claim that read
    before the winner's write reads again)."""
    import threading

    for n in range(10):
        barrier = threading.Barrier(8)
        answers: list[tuple[str, int, str]] = []

        def send(i: int, n: int = n, barrier: threading.Barrier = barrier,
                 answers: list[tuple[str, int, str]] = answers) -> None:
            barrier.wait(timeout=10)
            code, other, _ = claim(m, prefix, f"{name}-{n}", f"c{i}", f"op{i}")
            answers.append((f"c{i}", code, other))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        won = [task_id for task_id, code, _ in answers if code == CLAIMED]
        assert len(answers) == 8 and len(won) == 1, answers
        assert {(code, other) for task_id, code, other in answers
                if task_id != won[0]} == {(QUEUED, won[0])}
        assert marked(m, prefix, f"{name}-{n}") == won[0]


def test_queued_lists_live_markers_and_a_marker_expires(
        m: ZkMarkers, prefix: str, name: str) -> None:
    assert list(m.queued(prefix)) == []
    claim(m, prefix, name, "1", "op1", ttl=0.5)
    claim(m, prefix, f"{name}/b", "2", "op2", ttl=60)
    listed = {shown: (task_id, left) for shown, task_id, left in m.queued(prefix)}
    assert set(listed) == {name, f"{name}/b"}
    assert listed[f"{name}/b"][0] == "2" and 55 < (listed[f"{name}/b"][1] or 0) <= 60
    assert listed[name][0] == "1" and 0 < (listed[name][1] or 0) <= 0.5
    time.sleep(0.7)
    assert m.read(prefix, name) is None
    assert [shown for shown, _, _ in m.queued(prefix)] == [f"{name}/b"]
    assert claim(m, prefix, name, "3", "op3")[0] == CLAIMED  # the node, overwritten


# -- what is ZooKeeper's own -------------------------------------------------------------

def test_foreign_data_at_a_marker_node_is_a_conflict(
        m: ZkMarkers, view: Any, zk_url: str, prefix: str, name: str) -> None:
    """Another application's data where a name's marker node would be is
    LockKeyConflict at a step and at ``read`` (left as it was), left out of
    ``queued``; the markers' subtree is no lock for ``holds``."""
    path = marker_path(prefix, name)
    view.client.create(path, b"someone else's", makepath=True)
    with pytest.raises(LockKeyConflict, match="did not write"):
        claim(m, prefix, name, "1", "op1")
    with pytest.raises(LockKeyConflict):
        m.read(prefix, name)
    assert claim(m, prefix, "other", "2", "op2")[0] == CLAIMED
    assert [(shown, task_id) for shown, task_id, _ in m.queued(prefix)] == [
        ("other", "2")]
    assert view.client.get(path)[0] == b"someone else's"
    assert list(backend_from_url(zk_url).holds(prefix)) == []


def test_reading_markers_makes_no_node(m: ZkMarkers, view: Any, prefix: str,
                                       name: str) -> None:
    assert m.read(prefix, name) is None
    assert list(m.queued(prefix)) == []
    assert view.client.exists(f"/{prefix}") is None
    claim(m, prefix, name, "1", "op1")
    before = sorted(view.client.get_children(f"/{prefix}/.markers"))
    assert len(before) == 2  # the name's node and the clock
    assert m.read(prefix, name + "-none") is None
    assert [shown for shown, _, _ in m.queued(prefix)] == [name]
    assert sorted(view.client.get_children(f"/{prefix}/.markers")) == before


def test_an_unreachable_ensemble_is_backend_unavailable(prefix: str, name: str) -> None:
    m = backend_from_url("zookeeper://127.0.0.1:1/x?connect_timeout=1").markers()
    for call in (lambda: claim(m, prefix, name, "1", "op1"),
                 lambda: m.read(prefix, name),
                 lambda: list(m.queued(prefix)),
                 lambda: m.clear(prefix, name, "1")):
        with pytest.raises(BackendUnavailable, match="ZooKeeper"):
            call()


@pytest.mark.slow
@pytest.mark.parametrize("write", ["create", "set"])
def test_a_marker_write_whose_reply_was_lost_answers_as_the_first(
        zk_server: Any, prefix: str, name: str, write: str) -> None:
    """The proxy forwards a claim's write of the marker node (the server runs it)
    and swallows every reply after it, until kazoo drops the connection and the
    write fails with ConnectionLoss: the step reads again on the new connection and,
    run on what its write left, answers as that write did (claimed, replaced), never
    as a duplicate of itself."""
    with FaultProxy(zk_server.port) as proxy:
        via = f"127.0.0.1:{proxy.port}"
        m = backend_from_url(f"zookeeper://{via}").markers()
        try:
            if write == "set":
                assert claim(m, prefix, name, "old", "op1")[0] == CLAIMED
            swallowed = proxy.drop_reply(b'"dlock_markers":1')
            started = time.monotonic()
            if write == "create":
                answer = claim(m, prefix, name, "1", "op2")[:2]
            else:
                answer = claim(m, prefix, name, "new", "op2", replace=True)[:2]
            took = time.monotonic() - started
            assert swallowed.is_set(), "the write never went out"
            after = marked(m, prefix, name)
        finally:
            close_sessions(via)
    assert took < 30, took
    if write == "create":
        assert (answer, after) == ((CLAIMED, ""), "1")
    else:
        assert (answer, after) == ((REPLACED, "old"), "new")
