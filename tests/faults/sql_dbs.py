"""The SQL servers of the fault tests, behind one face: a throwaway PostgreSQL or
MariaDB server, how to stop and start it, talk to it as its administrator, make a
user with few privileges and count what the renewals cost on it.

``tests/faults/test_sql_faults.py`` runs every fault test both servers share through
a :class:`SqlDb`; what is one server's alone stays in ``test_postgres_faults.py`` and
``test_mysql_faults.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from mariadb_server import MariaDBServer, connect_args
from mariadb_server import Unavailable as MariaDBUnavailable


def start_mariadb() -> MariaDBServer:
    """A MariaDB server of the caller's own, else a skip with the reason."""
    pytest.importorskip("pymysql")
    try:
        server = MariaDBServer()
    except MariaDBUnavailable as exc:
        pytest.skip(f"no MariaDB server: {exc}")
    try:
        return server.start()
    except MariaDBUnavailable as exc:
        server.stop()
        pytest.skip(f"no MariaDB server: {exc}")


def start_postgres() -> Any:
    """A PostgreSQL server of the caller's own, else a skip with the reason."""
    pytest.importorskip("psycopg")
    from fencing.pg_server import PostgresServer, Unavailable

    try:
        return PostgresServer().start()
    except Unavailable as exc:
        pytest.skip(f"no PostgreSQL server: {exc}")


def connect_mysql(url: str) -> Any:
    """An autocommitted PyMySQL connection to ``url``."""
    import pymysql

    return pymysql.connect(**connect_args(url), autocommit=True, connect_timeout=10)


def mysql_user(db: MariaDBServer, user: str, *grants: str) -> str:
    """A MariaDB user of the test's own with only ``grants``: its URL."""
    with connect_mysql(db.url) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'pw-{user}'")
        for grant in grants:
            cur.execute(grant.format(user=f"'{user}'@'127.0.0.1'"))
    return db.url.replace(f"dlock:{db.password}@", f"{user}:pw-{user}@")


class SqlDb:
    """One SQL server of a fault test and what the tests do to it."""

    #: The lock kind (``postgres``, ``mysql``) and the words of its unavailability.
    kind = ""
    unavailable = ""
    #: A hold's ttl in the short restart (longer than the server takes to restart),
    #: and how long another owner may take to acquire after a long one (seconds).
    restart_ttl = 0.0
    restart_limit = 0.0
    #: Statements a renewal round may take, and the counters' own statements.
    per_round = 1
    own_reads = 0
    #: The module making the tables (``create_sql``, ``create_line_sql``).
    schema: Any = None

    def __init__(self, server: Any) -> None:
        self.server = server
        self.url: str = server.url
        self.port: int = server.port

    def halt(self) -> None:
        self.server.halt()

    def restart(self) -> None:
        self.server.restart()

    def behind(self, port: int) -> str:
        """The server's URL through another port (a fault proxy's)."""
        return self.url.replace(f":{self.port}/", f":{port}/")

    def refusing(self) -> tuple[str, str]:
        """The URL of a port nobody listens on, with a password: and that password."""
        raise NotImplementedError

    def execute(self, *statements: str) -> None:
        raise NotImplementedError

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def columns(self, table: str) -> int:
        """How many columns ``table`` has."""
        raise NotImplementedError

    def tables_like(self, start: str) -> int:
        """How many tables have a name starting with ``start``."""
        raise NotImplementedError

    def limited(self) -> str:
        """The URL of a user ``limited`` (password ``pw-limited``) who may use the
        database but not create tables in it."""
        raise NotImplementedError

    def grant(self, privileges: str, table: str) -> None:
        """Grant ``privileges`` on ``table`` to ``limited``."""
        raise NotImplementedError

    def counters(self) -> tuple[Callable[[], tuple[int, int]], Callable[[], None]]:
        """A reader of (statements, updated rows) counted on the server, and its
        close."""
        raise NotImplementedError


class PostgresDb(SqlDb):
    kind = "postgres"
    unavailable = "PostgreSQL unavailable"
    restart_ttl = 6.0
    restart_limit = 15.0
    per_round = 2
    own_reads = 3

    def __init__(self, server: Any) -> None:
        from celery_dlock.backends.sql.postgres import schema

        super().__init__(server)
        self.schema = schema

    def refusing(self) -> tuple[str, str]:
        return self.behind(1).replace("dlock@", "dlock:pw@"), "pw"

    def execute(self, *statements: str) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            return [tuple(row) for row in conn.execute(sql, params or None).fetchall()]

    def columns(self, table: str) -> int:
        return int(self.query("SELECT count(*) FROM information_schema.columns "
                              "WHERE table_name = %s", table)[0][0])

    def tables_like(self, start: str) -> int:
        return int(self.query("SELECT count(*) FROM pg_tables WHERE tablename LIKE %s",
                              start + "%")[0][0])

    def limited(self) -> str:
        self.execute("CREATE ROLE limited LOGIN",
                     "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        return self.url.replace("dlock@", "limited:pw-limited@")

    def grant(self, privileges: str, table: str) -> None:
        self.execute(f"GRANT {privileges} ON {table} TO limited")

    def counters(self) -> tuple[Callable[[], tuple[int, int]], Callable[[], None]]:
        import psycopg

        watch = psycopg.connect(self.url, autocommit=True)

        def read() -> tuple[int, int]:
            watch.execute("SELECT pg_stat_force_next_flush()")
            xacts = watch.execute("SELECT xact_commit FROM pg_stat_database "
                                  "WHERE datname = current_database()").fetchone()
            rows = watch.execute("SELECT n_tup_upd FROM pg_stat_user_tables "
                                 "WHERE relname = 'dlock_locks'").fetchone()
            assert xacts is not None and rows is not None
            return int(xacts[0]), int(rows[0])

        return read, watch.close


class MySQLDb(SqlDb):
    kind = "mysql"
    unavailable = "MySQL unavailable"
    restart_ttl = 8.0
    restart_limit = 30.0

    def __init__(self, server: MariaDBServer) -> None:
        from celery_dlock.backends.sql.mysql import schema as my_schema

        super().__init__(server)
        self.schema = my_schema

    def refusing(self) -> tuple[str, str]:
        return self.behind(1), self.server.password

    def execute(self, *statements: str) -> None:
        with connect_mysql(self.url) as conn, conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with connect_mysql(self.url) as conn, conn.cursor() as cur:
            cur.execute(sql, params or None)
            return [tuple(row) for row in cur.fetchall()]

    def columns(self, table: str) -> int:
        return int(self.query("SELECT count(*) FROM information_schema.COLUMNS WHERE "
                              "TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
                              table)[0][0])

    def tables_like(self, start: str) -> int:
        return int(self.query("SELECT count(*) FROM information_schema.TABLES WHERE "
                              "TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE %s",
                              start + "%")[0][0])

    def limited(self) -> str:
        # it may use the database (a table of it), not create tables in it
        self.execute("CREATE TABLE some_table (id INT PRIMARY KEY)")
        return mysql_user(self.server, "limited",
                          "GRANT SELECT ON dlock.some_table TO {user}")

    def grant(self, privileges: str, table: str) -> None:
        self.execute(f"GRANT {privileges} ON dlock.{table} TO 'limited'@'127.0.0.1'")

    def counters(self) -> tuple[Callable[[], tuple[int, int]], Callable[[], None]]:
        watch = connect_mysql(self.url)

        def read() -> tuple[int, int]:
            with watch.cursor() as cur:
                cur.execute("SHOW GLOBAL STATUS WHERE Variable_name IN "
                            "('Com_update', 'Handler_update')")
                found = {str(k): int(v) for k, v in cur.fetchall()}
            return found["Com_update"], found["Handler_update"]

        return read, watch.close


def own_db(kind: str) -> Iterator[SqlDb]:
    """A server of ``kind`` of the test's own (it may be stopped and started again)."""
    server = start_postgres() if kind == "postgres" else start_mariadb()
    try:
        yield PostgresDb(server) if kind == "postgres" else MySQLDb(server)
    finally:
        server.stop()
