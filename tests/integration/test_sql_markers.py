"""Queue markers on the SQL stores (PostgreSQL, MySQL/MariaDB): what the table and
the compare-and-set add to the protocol the store-level tests check on every store
(docs/backends.md, "Queue markers"): a write sent twice answers as the first, two
threads racing for one name claim it once, the markers table is made only by a step
(never by reading) and a table of another shape at its name is refused, and a name
of any length or with a NUL keeps its markers.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from marker_stores import MarkerCase, backend_of, close_backend, open_markers, store_url

from celery_dlock import LockKeyConflict
from celery_dlock.task.markers import CLAIMED, QUEUED, REPLACED

pytestmark = pytest.mark.slow


@pytest.fixture(params=["postgres", "mysql"])
def sql(request: pytest.FixtureRequest) -> Iterator[MarkerCase]:
    yield from open_markers(request.param, request)


def _claim(store: Any, prefix: str, name: str, task_id: str, *,
           replace: bool = False) -> tuple[int, str]:
    code, other, _ = store.claim(prefix, name, task_id, 60, running_counts=False,
                                 replace=replace, requeue=False, op=f"op-{task_id}")
    return code, other


@pytest.mark.parametrize("step", ["claim", "replace", "hand over"])
def test_a_write_sent_twice_answers_as_the_first(sql: MarkerCase, prefix: str,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 step: str) -> None:
    """The server ran a step's write, its reply was lost, and the statement was sent
    again (the server object re-sends once on a fresh connection): the second write
    changes nothing (its compare-and-set fails), the step runs again on what the
    first wrote, and answers as the first did."""
    m = sql.store
    if step != "claim":
        assert _claim(m, prefix, "n", "old") == (CLAIMED, "")
    sent = m._write
    lost = [True]  # one reply lost, as a broken connection loses it

    def twice(*args: Any) -> bool:
        if lost.pop() if lost else False:
            sent(*args)  # ran; its reply lost
        return bool(sent(*args))

    monkeypatch.setattr(m, "_write", twice)
    if step == "claim":
        assert _claim(m, prefix, "n", "a") == (CLAIMED, "")
        expected = "a"
    elif step == "replace":
        assert _claim(m, prefix, "n", "new", replace=True) == (REPLACED, "old")
        expected = "new"
    else:
        assert m.hand_over(prefix, "n", "old", remove=True, replaced_check=True,
                           keep=60) is None
        expected = None
    monkeypatch.undo()
    found = m.read(prefix, "n")
    assert (found[0] if found else None) == expected


def test_two_threads_claim_one_name_once(sql: MarkerCase, prefix: str) -> None:
    """Sends of one name from two threads (each with its own connection): each
    round, exactly one claims it and the other is told a duplicate of that one."""
    other = backend_of(sql.kind, sql.url)
    try:
        _race(sql, prefix, [sql.store, other.markers()])
    finally:
        close_backend(sql.kind, other)


def _race(sql: MarkerCase, prefix: str, stores: list[Any]) -> None:
    for round_ in range(20):
        name = f"race-{round_}"
        answers: dict[str, tuple[int, str]] = {}
        barrier = threading.Barrier(2)

        def send(i: int, name: str = name, barrier: threading.Barrier = barrier,
                 answers: dict[str, tuple[int, str]] = answers) -> None:
            barrier.wait(5)
            answers[f"{name}-{i}"] = _claim(stores[i], prefix, name, f"{name}-{i}")

        threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        claimed = [t for t, (code, _) in answers.items() if code == CLAIMED]
        assert len(answers) == 2 and len(claimed) == 1, answers
        [loser] = set(answers) - set(claimed)
        assert answers[loser] == (QUEUED, claimed[0])
        assert (sql.store.read(prefix, name) or ("",))[0] == claimed[0]


@pytest.mark.parametrize("odd", ["x" * 5000, "a\x00b", "\x01sha256:looks-digested"])
def test_a_long_or_odd_name_keeps_its_markers(sql: MarkerCase, prefix: str,
                                              odd: str) -> None:
    m = sql.store
    assert m.claim(prefix, odd, "a", 60, running_counts=False, replace=False,
                   requeue=False, op="op-a")[0] == CLAIMED
    assert m.claim(prefix, odd, "b", 60, running_counts=False, replace=False,
                   requeue=False, op="op-b")[:2] == (QUEUED, "a")
    assert (m.read(prefix, odd) or ("",))[0] == "a"
    assert [(n, t) for n, t, _ in m.queued(prefix)] == [
        (odd.replace("\x00", "\\0") if sql.kind == "postgres" else odd, "a")]
    assert m.clear(prefix, odd, "a") is True
    assert m.read(prefix, odd) is None


def _url_with_table(url: str, table: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}dlock_table={table}"


def test_reading_makes_no_table_and_a_step_makes_it(
        request: pytest.FixtureRequest, sql: MarkerCase, prefix: str) -> None:
    table = f"mk{uuid.uuid4().hex[:10]}"
    backend = backend_of(sql.kind, _url_with_table(store_url(sql.kind, request), table))
    try:
        m = backend.markers()
        assert m.read(prefix, "n") is None
        assert list(m.queued(prefix)) == []
        assert not backend.server.ensure_side_table("_markers", create=False)
        assert _claim(m, prefix, "n", "a") == (CLAIMED, "")
        assert backend.server.ensure_side_table("_markers", create=False)
    finally:
        close_backend(sql.kind, backend)


def test_a_foreign_table_at_the_markers_table_name_is_a_conflict(
        request: pytest.FixtureRequest, sql: MarkerCase, prefix: str) -> None:
    table = f"mf{uuid.uuid4().hex[:10]}"
    url = _url_with_table(store_url(sql.kind, request), table)
    backend = backend_of(sql.kind, url)
    conn = backend.server.connect()
    try:
        cur = conn.cursor()
        cur.execute(f"CREATE TABLE {table}_markers (id integer PRIMARY KEY, note text)")
        if sql.kind == "mysql":
            conn.commit()
    finally:
        conn.close()
    try:
        with pytest.raises(LockKeyConflict, match=f"{table}_markers"):
            _claim(backend.markers(), prefix, "n", "a")
        with pytest.raises(LockKeyConflict, match=f"{table}_markers"):
            backend.markers().read(prefix, "n")  # nor read as markers
    finally:
        close_backend(sql.kind, backend)
    conn = backend.server.connect()
    try:
        cur = conn.cursor()
        cur.execute(f"SELECT count(*) FROM {table}_markers")
        assert tuple(cur.fetchone()) == (0,), "nothing was written there"
    finally:
        conn.close()
