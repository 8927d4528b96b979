"""Fenced writes through SQLAlchemy (Core ``Connection`` and ORM ``Session``), on SQLite
and PostgreSQL (psycopg 3): the same refusals as through DB-API, inside the caller's
transaction."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import Db

from celery_dlock.fencing import (
    FencedRowMissing,
    InvalidFencedWrite,
    StaleFence,
    claim,
    fenced_update,
    fenced_upsert,
)

sqlalchemy = pytest.importorskip("sqlalchemy")
orm = pytest.importorskip("sqlalchemy.orm")


@pytest.fixture
def engine(db: Db) -> Iterator[Any]:
    e = sqlalchemy.create_engine(db.sqlalchemy_url)
    try:
        yield e
    finally:
        e.dispose()


@pytest.fixture
def table(db: Db, conn: Any) -> str:
    return db.table(conn)


def content(engine: Any, table: str) -> list[tuple[Any, ...]]:
    with engine.connect() as c:
        result = c.execute(sqlalchemy.text(
            f"SELECT sku, qty, note, last_fence FROM {table} ORDER BY sku"))
        return [tuple(r) for r in result]


def test_core_connection_refuses_a_stale_fence_and_keeps_the_row(
        engine: Any, table: str) -> None:
    with engine.begin() as c:
        assert fenced_upsert(c, table, {"sku": "A"}, 4, {"qty": 10, "note": "B"}) == 1
    with engine.begin() as c:  # the same hold writes again
        fenced_update(c, table, {"sku": "A"}, 4, {"qty": 9})
        fenced_update(c, table, {"sku": "A"}, 4, {"qty": 8})
    before = content(engine, table)
    assert before == [("A", 8, "B", 4)]

    with pytest.raises(StaleFence) as caught, engine.begin() as c:
        c.execute(sqlalchemy.text(f"UPDATE {table} SET note = 'A was here'"))
        fenced_update(c, table, {"sku": "A"}, 3, {"qty": 0})
    assert (caught.value.fence, caught.value.found) == (3, 4)
    # the exception rolled the whole transaction back, the unfenced UPDATE too
    assert content(engine, table) == before

    with pytest.raises(StaleFence), engine.begin() as c:
        fenced_upsert(c, table, {"sku": "A"}, 3, {"qty": 0})
    with pytest.raises(FencedRowMissing), engine.begin() as c:
        fenced_update(c, table, {"sku": "Z"}, 9, {"qty": 0})
    assert content(engine, table) == before


def test_orm_session_claims_and_writes_in_its_transaction(
        engine: Any, table: str) -> None:
    with orm.Session(engine) as s, s.begin():
        fenced_upsert(s, table, {"sku": "A"}, 1, {"qty": 10})
    with orm.Session(engine) as s, s.begin():
        claim(s, table, {"sku": "A"}, 2)
        qty = s.execute(sqlalchemy.text(f"SELECT qty FROM {table} WHERE sku = :s"),
                        {"s": "A"}).scalar_one()
        fenced_update(s, table, {"sku": "A"}, 2, {"qty": qty - 1})
    assert content(engine, table) == [("A", 9, None, 2)]
    with pytest.raises(StaleFence), orm.Session(engine) as s, s.begin():
        fenced_update(s, table, {"sku": "A"}, 1, {"qty": 0})
    assert content(engine, table) == [("A", 9, None, 2)]


def test_an_engine_is_refused_the_write_belongs_to_a_transaction(
        engine: Any, table: str) -> None:
    with pytest.raises(InvalidFencedWrite, match="Connection or Session"):
        fenced_update(engine, table, {"sku": "A"}, 1, {"qty": 0})
