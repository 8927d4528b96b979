"""The servers of a chaos run: the lock's server (Redis, PostgreSQL or ZooKeeper) and
the Celery broker (Redis or RabbitMQ), each started by the run in a temp dir on free
loopback ports, with the faults the driver injects into it.

A lock server offers :meth:`restart` (a crash or a clean stop, some downtime, a start
on the same port from what it kept on disk), :meth:`pause` (every lock call waits, the
connections stay up) and :meth:`locks_left` (holds still there after every process
stopped).  Each keeps what it acknowledged across a restart, the assumption of README
"Guarantees": Redis with ``appendfsync always``, PostgreSQL with ``fsync`` and
synchronous commits, ZooKeeper with its transaction log synced (its default).

A broker offers :meth:`restart`, :meth:`queue_length` (the producer keeps the queue
fed) and :meth:`task_ids` (the tasks whose messages it still keeps once every worker
stopped: a task sent and never run is *lost* only when its message is gone).  When
the lock's server is Redis, the broker is that same server.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import redis

from celery_dlock.ops.embedded import EmbeddedRedis

TESTS = Path(__file__).resolve().parent.parent
for extra in (TESTS / "fencing", TESTS):
    if str(extra) not in sys.path:
        sys.path.append(str(extra))

#: The lock's servers and the brokers a run can use.
LOCKS = ("redis", "postgresql", "zookeeper")
BROKERS = ("redis", "amqp")


class LockServer(Protocol):
    port: int
    url: str

    def lock_url(self, port: int) -> str: ...
    def restart(self, hard: bool, down: float) -> str: ...
    def pause(self, seconds: float) -> None: ...
    def locks_left(self, prefix: str) -> list[str]: ...
    def stop(self) -> None: ...


class Broker(Protocol):
    url: str

    def restart(self, hard: bool, down: float) -> str: ...
    def queue_length(self, queue: str) -> int: ...
    def task_ids(self, queue: str) -> set[str]: ...
    def stop(self) -> None: ...


class RedisServer:
    """``redis-server`` with an AOF synced at every write (lock server and broker)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.args = ("--appendonly", "yes", "--appendfsync", "always", "--dir",
                     str(directory), "--maxmemory-policy", "noeviction")
        self.server = EmbeddedRedis(extra_args=self.args).start()
        self.port = self.server.port
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._queues: redis.Redis | None = None

    def lock_url(self, port: int) -> str:
        return f"redis://127.0.0.1:{port}/0"

    def restart(self, hard: bool, down: float) -> str:
        proc = self.server.process
        assert proc is not None
        proc.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
        proc.wait(timeout=30)
        self.server.stop()
        time.sleep(down)
        self.server = EmbeddedRedis(port=self.port, extra_args=self.args).start()
        return "SIGKILL" if hard else "SIGTERM"

    def pause(self, seconds: float) -> None:
        r = redis.Redis.from_url(self.url, socket_timeout=5)
        try:
            r.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
        finally:
            r.close()
        time.sleep(seconds)

    def locks_left(self, prefix: str) -> list[str]:
        """Lock keys under ``prefix`` (not the fence counters)."""
        r = redis.Redis.from_url(self.url, socket_timeout=5)
        try:
            found = [k.decode() for k in r.scan_iter(match=f"{prefix}:*", count=1000)]
        finally:
            r.close()
        return sorted(k for k in found if not k.endswith(":fence"))

    def queue_length(self, queue: str) -> int:
        if self._queues is None:
            self._queues = redis.Redis.from_url(self.url, socket_timeout=2,
                                                socket_connect_timeout=1)
        return int(self._queues.llen(queue))

    def task_ids(self, queue: str) -> set[str]:
        """The task ids of kombu's messages: in the queue's lists (one per priority)
        and in its ``unacked`` hash (taken by a consumer that died or was stopped:
        restored after the visibility timeout)."""
        r = redis.Redis.from_url(self.url, socket_timeout=5)
        try:
            raw: list[bytes] = []
            for key in r.scan_iter(match=f"{queue}*", count=1000):
                if r.type(key) == b"list":
                    raw += r.lrange(key, 0, -1)
            for value in r.hvals("unacked"):
                raw.append(json.dumps(json.loads(value)[0]).encode())
        finally:
            r.close()
        return {json.loads(m).get("headers", {}).get("id", "?") for m in raw}

    def stop(self) -> None:
        if self._queues is not None:
            self._queues.close()
        self.server.stop()


class PostgresLockServer:
    """A PostgreSQL server of the run's own (tests/fencing/pg_server.py), durable."""

    TABLE = "dlock_locks"

    def __init__(self) -> None:
        import psycopg
        from pg_server import PostgresServer

        from celery_dlock.backends.sql.postgres.schema import create_sql

        self.server = PostgresServer(durable=True).start()
        self.port = self.server.port
        self.url = self.server.url
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(create_sql(self.TABLE))  # type: ignore[arg-type]

    def lock_url(self, port: int) -> str:
        return self.url.replace(f":{self.port}/", f":{port}/")

    def restart(self, hard: bool, down: float) -> str:
        """``pg_ctl stop -m immediate`` (a crash: recovery from the WAL) or ``-m
        fast`` (a clean shutdown), then a start on the same port."""
        mode = "immediate" if hard else "fast"
        self.server.halt(mode)
        time.sleep(down)
        self.server.restart()
        return mode

    def pause(self, seconds: float) -> None:
        """Hold the lease table in ACCESS EXCLUSIVE mode: every lock statement waits
        (as under Redis's CLIENT PAUSE), the connections stay up."""
        import psycopg

        with psycopg.connect(self.url, connect_timeout=5) as conn:
            conn.execute(f"LOCK TABLE {self.TABLE} IN ACCESS EXCLUSIVE MODE")
            time.sleep(seconds)
            conn.rollback()

    def locks_left(self, prefix: str) -> list[str]:
        """Rows of ``prefix`` held and not lapsed (a released row keeps its fence,
        with no owner)."""
        import psycopg

        with psycopg.connect(self.url, connect_timeout=5) as conn:
            rows = conn.execute(
                f"SELECT name FROM {self.TABLE} WHERE prefix = %s AND owner IS NOT NULL"
                f" AND expires_at > now()", (prefix,)).fetchall()  # type: ignore[arg-type]
        return sorted(f"{prefix}:{r[0]}" for r in rows)

    def stop(self) -> None:
        self.server.stop()


class ZooKeeperLockServer:
    """A standalone ZooKeeper of the run's own (tests/zk_server.py)."""

    def __init__(self) -> None:
        from zk_server import ZkServer

        self.server = ZkServer().start()
        self.port = self.server.port
        self.url = self.server.url

    def lock_url(self, port: int) -> str:
        return f"zookeeper://127.0.0.1:{port}"

    def restart(self, hard: bool, down: float) -> str:
        """SIGKILL or SIGTERM the server, then start it on the same port and data dir
        (sessions and zxids survive, as in production)."""
        proc = self.server.process
        assert proc is not None
        proc.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
        proc.wait(timeout=30)
        self.server.stop()
        time.sleep(down)
        self.server.start()
        return "SIGKILL" if hard else "SIGTERM"

    def pause(self, seconds: float) -> None:
        """SIGSTOP the server (ZooKeeper has no pause command): no call is answered,
        no session expires until it runs again."""
        proc = self.server.process
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(proc.pid, signal.SIGCONT)

    def locks_left(self, prefix: str) -> list[str]:
        """Children (holders or waiters) of every lock node under ``prefix``."""
        from kazoo.client import KazooClient
        from kazoo.exceptions import NoNodeError

        from celery_dlock.backends.zookeeper.nodes import prefix_path

        client = KazooClient(hosts=self.server.hosts, timeout=10)
        client.start(timeout=20)
        try:
            root = prefix_path(prefix)
            left: list[str] = []
            with contextlib.suppress(NoNodeError):
                for node in client.get_children(root):
                    with contextlib.suppress(NoNodeError):
                        left += [f"{root}/{node}/{c}"
                                 for c in client.get_children(f"{root}/{node}")]
            return sorted(left)
        finally:
            client.stop()
            client.close()

    def stop(self) -> None:
        self.server.cleanup()


class RabbitBroker:
    """A RabbitMQ node of the run's own (tests/rabbitmq_server.py)."""

    def __init__(self) -> None:
        from rabbitmq_server import RabbitServer

        self.server = RabbitServer()
        try:
            self.server.start()
        except BaseException:
            self.server.stop()
            raise
        self.url = self.server.url
        self._conn: Any = None

    def restart(self, hard: bool, down: float) -> str:
        self.server.restart(hard, down)
        return "SIGKILL" if hard else "SIGTERM"

    def queue_length(self, queue: str) -> int:
        from amqp.exceptions import NotFound
        from kombu import Connection

        if self._conn is None:
            self._conn = Connection(self.url, connect_timeout=2)
        try:
            return int(self._conn.default_channel.queue_declare(
                queue=queue, passive=True).message_count)
        except NotFound:  # not declared yet: nothing sent
            self._close()
            return 0
        except Exception:
            self._close()
            raise

    def task_ids(self, queue: str) -> set[str]:
        """The task ids of the queue's messages (read, then left for the broker to
        requeue: nothing is acknowledged).  The workers are stopped, so the broker
        has already put back what they had taken."""
        from amqp.exceptions import NotFound
        from kombu import Connection

        ids: set[str] = set()
        with Connection(self.url, connect_timeout=5) as conn:
            channel = conn.channel()
            try:
                while True:
                    message = channel.basic_get(queue=queue, no_ack=False)
                    if message is None:
                        break
                    ids.add(str(message.headers.get("id", "?")))
            except NotFound:
                pass
        return ids

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.release()

    def stop(self) -> None:
        self._close()
        self.server.stop()


def locks_left_after(server: LockServer, prefix: str, within: float) -> dict[str, Any]:
    """Holds under ``prefix`` still on the lock's server once ``within`` seconds have
    passed (a holder killed at the very end leaves its hold to expire within its ttl,
    or on ZooKeeper its session timeout)."""
    started = time.monotonic()
    left = server.locks_left(prefix)
    while left and time.monotonic() - started < within:
        time.sleep(0.1)
        left = server.locks_left(prefix)
    return {"keys": left, "cleared_after": round(time.monotonic() - started, 2)}


def kept_tasks(broker: Broker, queue: str) -> dict[str, Any]:
    """The task ids whose messages the broker still keeps (every worker stopped)."""
    try:
        return {"ids": sorted(broker.task_ids(queue))}
    except Exception as exc:
        return {"ids": None, "error": f"{type(exc).__name__}: {exc}"}


def lock_server(kind: str, out: Path) -> LockServer:
    if kind == "redis":
        return RedisServer(out / "redis")
    if kind == "postgresql":
        return PostgresLockServer()
    if kind == "zookeeper":
        return ZooKeeperLockServer()
    raise ValueError(f"lock server {kind!r}: one of {', '.join(LOCKS)}")


def broker(kind: str, out: Path) -> Broker:
    if kind == "redis":
        return RedisServer(out / "broker-redis")
    if kind == "amqp":
        return RabbitBroker()
    raise ValueError(f"broker {kind!r}: one of {', '.join(BROKERS)}")


def unavailable(lock: str, broker_kind: str) -> str | None:
    """Why a run on this lock server and broker cannot start here (None: it can)."""
    if lock == "postgresql":
        try:
            import psycopg  # noqa: F401
            from pg_server import PostgresServer

            shutil.rmtree(PostgresServer().dir)  # binaries found, a user to run them
        except Exception as exc:
            return f"no PostgreSQL server: {exc}"
    if lock == "zookeeper":
        from zk_server import find_classpath

        try:
            find_classpath()
            import kazoo  # noqa: F401
        except Exception as exc:
            return f"no ZooKeeper server: {exc}"
    if broker_kind == "amqp":
        from rabbitmq_server import find_rabbitmq_server

        try:
            find_rabbitmq_server()
        except Exception as exc:
            return f"no RabbitMQ: {exc}"
    return None
