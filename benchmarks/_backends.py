"""The lock backends of ``bench_backends.py``: the table of them, their servers, and
what the benchmark counts of them (requests sent, the server's processes).

Adding a backend is one entry in :data:`BACKENDS`: a name, and how to get a URL (start
a throwaway server with the test suite's launcher, or take the one given on the
command line; :class:`Skip` with a one-line reason when neither can be had).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import _common as c
import bench_e2e as e2e
import psutil
import redis

from celery_dlock import lock_from_url

TESTS = c.HERE.parent / "tests"


class Skip(Exception):
    """A backend cannot run here: the message is the one-line reason."""


# -- the backends --------------------------------------------------------------------


def _load(path: Path, name: str) -> ModuleType:
    """A module of the test suite, imported by its path (``tests/`` is no package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise Skip(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise Skip(f"{path.relative_to(c.HERE.parent)} needs {exc.name} "
                   f"(pip install -e '.[test]')") from None
    return module


def redis_url(args: argparse.Namespace, stack: contextlib.ExitStack,
              broker: str) -> str:
    return broker  # the broker's Redis: the default place of a LockedTask's locks


def postgres_url(args: argparse.Namespace, stack: contextlib.ExitStack,
                 broker: str) -> str:
    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        raise Skip(f"no driver: {exc} (pip install 'celery-dlock[postgres]')") from None
    if args.postgres_url:
        return str(args.postgres_url)
    pg = _load(TESTS / "fencing" / "pg_server.py", "_bench_pg_server")
    try:
        server = pg.PostgresServer()
        stack.callback(server.stop)
        server.start()
    except pg.Unavailable as exc:
        raise Skip(f"no server: {exc}") from None
    return str(server.url)


def zookeeper_url(args: argparse.Namespace, stack: contextlib.ExitStack,
                  broker: str) -> str:
    try:
        import kazoo  # noqa: F401
    except ImportError as exc:
        raise Skip(f"no driver: {exc} (pip install 'celery-dlock[zookeeper]')") from None
    from celery_dlock.backends.zookeeper.session import close_sessions

    def close() -> None:
        # Ours close before the server stops; kazoo's warnings of the connections it
        # drops on the way out are not the benchmark's.
        logging.getLogger("kazoo").setLevel(logging.ERROR)
        close_sessions()

    if args.zookeeper_url:
        stack.callback(close)
        return str(args.zookeeper_url)
    zk = _load(TESTS / "zk_server.py", "_bench_zk_server")

    class Server(zk.ZkServer):  # type: ignore[misc,name-defined]
        """The suite's server, writing its transaction log without an fsync per
        write (``--zookeeper-fsync`` keeps ZooKeeper's default), as the other
        servers here keep nothing on disk (redis-server) or run with ``fsync=off``
        (PostgreSQL)."""

        def _config(self) -> Path:
            cfg: Path = super()._config()
            if not args.zookeeper_fsync:
                cfg.write_text(cfg.read_text() + "forceSync=no\n")
            return cfg

    try:
        server = Server()
    except RuntimeError as exc:
        raise Skip(f"no server: {exc}") from None
    stack.callback(server.cleanup)
    try:
        server.start()
    except RuntimeError as exc:
        raise Skip(f"the server did not start: {exc}") from None
    stack.callback(close)
    return str(server.url)


def mysql_url(args: argparse.Namespace, stack: contextlib.ExitStack,
              broker: str) -> str:
    try:
        import pymysql  # noqa: F401
    except ImportError as exc:
        raise Skip(f"no driver: {exc} (pip install 'celery-dlock[mysql]')") from None
    if args.mysql_url:
        return str(args.mysql_url)
    my = _load(TESTS / "mariadb_server.py", "_bench_mariadb_server")
    try:
        server = my.MariaDBServer()
        stack.callback(server.stop)
        server.start()
    except my.Unavailable as exc:
        raise Skip(f"no server: {exc}") from None
    return str(server.url)


def add_server_arguments(parser: argparse.ArgumentParser, option: str,
                         what: str) -> None:
    """The options choosing the servers: ``--postgres-url``, ``--mysql-url``,
    ``--zookeeper-url``, ``--zookeeper-fsync``, and ``option`` (``--backends``,
    ``--stores``): the subset of :data:`BACKENDS` to run, ``what`` its default."""
    parser.add_argument("--postgres-url", default=None,
                        help="use this PostgreSQL instead of starting a throwaway one")
    parser.add_argument("--mysql-url", default=None,
                        help="use this MySQL or MariaDB (mysql://user:pw@host:port/db) "
                             "instead of starting a throwaway MariaDB")
    parser.add_argument("--zookeeper-url", default=None,
                        help="use this ZooKeeper (zookeeper://host:port) instead of "
                             "starting a throwaway one")
    parser.add_argument("--zookeeper-fsync", action="store_true",
                        help="the ZooKeeper started here syncs its log to disk on "
                             "every write (its default; without: forceSync=no, as "
                             "the other servers here write nothing durably)")
    parser.add_argument(option, default=None,
                        help="comma-separated subset of "
                             + ",".join(b.name for b in BACKENDS) + f" (default {what})")


@dataclass(frozen=True)
class Backend:
    """One row of :data:`BACKENDS`: a name, and how to get a URL for it (start a
    server, or take the one given; :class:`Skip` saying why not)."""

    name: str
    url: Callable[[argparse.Namespace, contextlib.ExitStack, str], str]


#: Every backend benchmarked, Redis first (the reference of ``x Redis``).  Adding one
#: is one entry (and its driver's requests counted in :class:`Requests`).
BACKENDS = (
    Backend("redis", redis_url),
    Backend("postgres", postgres_url),
    Backend("mysql", mysql_url),
    Backend("zookeeper", zookeeper_url),
)
REFERENCE = BACKENDS[0].name


def start_backends(args: argparse.Namespace, stack: contextlib.ExitStack,
                   broker: str, wanted: list[str] | None = None
                   ) -> tuple[dict[str, str], dict[str, str]]:
    """``({name: url}, {name: why skipped})`` for the backends asked for:
    ``wanted``, else ``--backends``, else all."""
    if wanted is None:
        wanted = (args.backends.split(",") if args.backends
                  else [b.name for b in BACKENDS])
    urls: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for backend in BACKENDS:
        if backend.name not in wanted:
            continue
        try:
            url = backend.url(args, stack, broker)
            # One lock first: the driver imports, the connection (and for PostgreSQL
            # the table) are made here, not in the first measured cycle.
            lock = lock_from_url(url, f"{c.run_id()}:probe", ttl=30)
            if not lock.acquire(blocking=False):
                raise Skip("a probe lock could not be taken")
            lock.release()
        except Skip as exc:
            skipped[backend.name] = str(exc)
            print(f"skipped {backend.name}: {exc}")
            continue
        except Exception as exc:  # a server given that does not answer, a bad URL
            skipped[backend.name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            print(f"skipped {backend.name}: {skipped[backend.name]}")
            continue
        urls[backend.name] = url
    return urls, skipped


class Requests:
    """Counts the requests this process's drivers send to a server: redis-py round
    trips (``Connection.send_packed_command``: a command, or a whole pipeline; on
    the client's pool and on renewal's alike), psycopg statements
    (``Connection.execute``: each one an autocommitted round trip), PyMySQL
    statements (``Cursor.execute``; a transaction's BEGIN and COMMIT are not
    counted), kazoo requests (``KazooClient._call``: a ZooKeeper request; requests
    sent before the first reply is read share one round trip)."""

    sent = 0
    #: The same count per driver: ``{"redis": n, "postgres": n, "mysql": n,
    #: "zookeeper": n}`` (named as :data:`BACKENDS`), to tell a store's requests
    #: from the Redis broker's in one process.
    by_driver: dict[str, int] = {}
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        cls._installed = True

        def counting(cls_: Any, attr: str, driver: str) -> None:
            original = getattr(cls_, attr)
            cls.by_driver[driver] = 0

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                cls.sent += 1
                cls.by_driver[driver] += 1
                return original(*args, **kwargs)

            setattr(cls_, attr, wrapper)

        counting(redis.Connection, "send_packed_command", "redis")
        with contextlib.suppress(ImportError):
            import psycopg

            counting(psycopg.Connection, "execute", "postgres")
        with contextlib.suppress(ImportError):
            import pymysql.cursors

            counting(pymysql.cursors.Cursor, "execute", "mysql")
        with contextlib.suppress(ImportError):
            from kazoo.client import KazooClient

            counting(KazooClient, "_call", "zookeeper")


def server_processes(url: str) -> e2e.Processes | None:
    """The processes of the server at ``url`` (the one listening on its port, and its
    children: PostgreSQL's backends), when it runs on this machine; else None."""
    netloc = urlsplit(url).netloc.rsplit("@", 1)[-1].split(",")[0]
    host, _, port = netloc.rpartition(":")
    if host.strip("[]") not in ("127.0.0.1", "localhost", "::1") or not port.isdigit():
        return None
    try:
        pid = next(conn.pid for conn in psutil.net_connections("tcp")
                   if conn.status == psutil.CONN_LISTEN and conn.laddr
                   and conn.laddr.port == int(port) and conn.pid)
        main = psutil.Process(pid)
    except (StopIteration, psutil.Error):
        return None

    def procs() -> list[psutil.Process]:
        try:
            return [main, *main.children(recursive=True)]
        except psutil.Error:
            return []

    return procs


def group_cpu(groups: list[e2e.Processes]) -> float:
    """CPU seconds used so far by the processes of ``groups``."""
    return sum(sum(e2e.group_seconds(g).values()) for g in groups)


def server_versions(urls: dict[str, str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for backend, url in urls.items():
        out[backend] = None
        with contextlib.suppress(Exception):
            if backend == "postgres":
                import psycopg

                with psycopg.connect(url, connect_timeout=5) as conn:
                    row = conn.execute("SHOW server_version").fetchone()
                    out[backend] = None if row is None else str(row[0])
            elif backend == "zookeeper":  # the srvr command (the suite allows it)
                host, _, port = url.removeprefix("zookeeper://").split("/")[0] \
                    .split(",")[0].rpartition(":")
                with socket.create_connection((host, int(port)), timeout=5) as sock:
                    sock.sendall(b"srvr")
                    first = sock.recv(4096).decode(errors="replace").splitlines()[0]
                # "Zookeeper version: 3.8.0-<build>, built on ..."
                out[backend] = first.split(":", 1)[1].split(",")[0].strip() \
                    .split("-")[0]
            elif backend == "mysql":
                import pymysql

                from celery_dlock.backends.sql.mysql.server import connect_args
                with contextlib.closing(pymysql.connect(**connect_args(url)[0])) \
                        as conn, conn.cursor() as cur:
                    cur.execute("SELECT VERSION()")
                    row = cur.fetchone()
                    out[backend] = None if row is None else str(row[0]).split("-")[0]
            elif backend == REFERENCE:
                out[backend] = redis.Redis.from_url(url).info("server")["redis_version"]
    return out
