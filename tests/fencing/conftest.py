"""Fixtures for the fenced-write tests: SQLite always, PostgreSQL and MariaDB when a
server can run.

One PostgreSQL server per test session (``pg_server.PostgresServer``), or the one
``$DLOCK_TEST_POSTGRES_URL`` names, and one MariaDB server (``mariadb_url``, from
``tests/mariadb_server.py``), or the one ``$DLOCK_TEST_MYSQL_URL`` names; the cases of
a database are skipped, with the reason, when neither is possible.  Every test writes
to a table of its own, so nothing is dropped or truncated on a shared server.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from mariadb_server import connect_args  # mariadb_url: tests/conftest.py
from pg_server import PostgresServer, Unavailable

_postgres: dict[str, Any] = {}


@dataclass
class Db:
    """One database under test: how to connect to it, by DB-API and by SQLAlchemy."""

    kind: str  # "sqlite" | "postgresql" | "mariadb"
    # a file path (sqlite), a postgresql:// or a mysql:// URL (with a password: no repr)
    dsn: str = field(repr=False)

    def connect(self) -> Any:
        if self.kind == "sqlite":
            return sqlite3.connect(self.dsn, timeout=30)
        if self.kind == "mariadb":
            import pymysql

            return pymysql.connect(**connect_args(self.dsn), connect_timeout=10)
        import psycopg

        return psycopg.connect(self.dsn, connect_timeout=10)

    @property
    def sqlalchemy_url(self) -> str:
        if self.kind == "sqlite":
            return f"sqlite:///{self.dsn}"
        if self.kind == "mariadb":
            return self.dsn.replace("mysql://", "mysql+pymysql://", 1)
        return self.dsn.replace("postgresql://", "postgresql+psycopg://", 1)

    def table(self, conn: Any, columns: str = "sku TEXT PRIMARY KEY, qty INTEGER, "
              "note TEXT, last_fence BIGINT NOT NULL DEFAULT 0") -> str:
        """Create a table of this test's own and return its name."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        if self.kind == "mariadb":  # a TEXT key needs a length there
            columns = columns.replace("TEXT PRIMARY KEY", "VARCHAR(191) PRIMARY KEY")
        cur = conn.cursor()
        cur.execute(f"CREATE TABLE {name} ({columns})")
        cur.close()
        conn.commit()
        return name


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL server for the session (started on first use), else skip."""
    url = os.environ.get("DLOCK_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"no PostgreSQL driver: {exc} (pip install 'psycopg[binary]')")
    if "unavailable" in _postgres:
        pytest.skip(_postgres["unavailable"])
    try:
        with PostgresServer() as server:
            yield server.url
            return
    except Unavailable as exc:
        _postgres["unavailable"] = f"no PostgreSQL server: {exc}"
    pytest.skip(_postgres["unavailable"])


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    if request.param == "sqlite":
        return Db("sqlite", str(tmp_path / "fenced.sqlite3"))
    if request.param == "mariadb":
        return Db("mariadb", request.getfixturevalue("mariadb_url"))
    return Db("postgresql", request.getfixturevalue("postgres_url"))


@pytest.fixture
def conn(db: Db) -> Iterator[Any]:
    c = db.connect()
    try:
        yield c
    finally:
        c.close()
