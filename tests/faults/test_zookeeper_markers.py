"""Queue markers on ZooKeeper (:class:`~celery_dlock.backends.zookeeper.markers.
ZkMarkers`): a few of the protocol's key orders against a real ZooKeeper (the
shared store tests, ``markers`` fixture, run every order on ZooKeeper too:
tests/faults/test_marker_model_orders.py, test_marker_faults.py,
test_marker_started.py, tests/integration/test_marker_stores.py), racing claims; and
what is ZooKeeper's own: foreign data at a marker
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
from celery_dlock.task.markers import CLAIMED, OURS, PENDING, QUEUED, REPLACED

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
