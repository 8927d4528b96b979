"""A real ZooKeeper server for the suite, and the reads the lock tests make of it.

:class:`ZkServer` runs a standalone ZooKeeper (Debian's ``zookeeper`` package: its
jars under ``/usr/share/java``, or ``DLOCK_ZOOKEEPER_CLASSPATH``) in a temp dir on a
free loopback port, as the Redis tests run ``redis-server``.  It keeps its data dir
across :meth:`ZkServer.restart`, so sessions and zxids survive a restart as in
production.  A test that needs it is skipped, saying why, when Java or the jars are
missing.

:class:`ZkView` answers the reads the lock-contract tests make of a lock's "keys"
(``exists``, ``hget``, ``hgetall``, ``pttl``, ``zrange``, ``delete``) from ZooKeeper,
so that the same tests run on the ZooKeeper kind (tests/lock_kinds.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["LINE", "ZkServer", "ZkView", "find_classpath", "zk_server"]

_JARS = ("zookeeper", "zookeeper-jute", "slf4j-api", "slf4j-nop", "netty-handler",
         "netty-common", "netty-buffer", "netty-transport", "netty-codec",
         "netty-resolver", "netty-transport-native-epoll",
         "netty-transport-native-unix-common", "metrics-core", "commons-cli",
         "snappy-java")
#: What a test view's key ends with to mean "the line of waiters" of a lock node.
LINE = " line"


def find_classpath() -> str:
    """The Java class path of a ZooKeeper server; RuntimeError saying what is missing."""
    own = os.environ.get("DLOCK_ZOOKEEPER_CLASSPATH")
    if own:
        return own
    if shutil.which("java") is None:
        raise RuntimeError("no java on PATH (apt-get install zookeeper)")
    jars = [Path("/usr/share/java") / f"{jar}.jar" for jar in _JARS]
    if not jars[0].exists():
        raise RuntimeError("no ZooKeeper jars in /usr/share/java (apt-get install "
                           "zookeeper, or set DLOCK_ZOOKEEPER_CLASSPATH)")
    return ":".join(str(j) for j in jars if j.exists())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ZkServer:
    """A standalone ZooKeeper in a temp dir (see the module text)."""

    #: The session timeouts it grants (ms): from 0.1 s to an hour.
    MIN_SESSION_MS = 100
    MAX_SESSION_MS = 3_600_000

    def __init__(self) -> None:
        self.classpath = find_classpath()
        self.dir = Path(tempfile.mkdtemp(prefix="dlock-zk-"))
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"zookeeper://127.0.0.1:{self.port}"

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _config(self) -> Path:
        cfg = self.dir / "zoo.cfg"
        cfg.write_text(
            f"tickTime=50\n"
            f"minSessionTimeout={self.MIN_SESSION_MS}\n"
            f"maxSessionTimeout={self.MAX_SESSION_MS}\n"
            f"dataDir={self.dir / 'data'}\n"
            f"clientPort={self.port}\n"
            f"clientPortAddress=127.0.0.1\n"
            f"admin.enableServer=false\n"
            f"4lw.commands.whitelist=ruok,srvr\n"
            f"maxClientCnxns=0\n")
        return cfg

    def start(self, timeout: float = 60.0) -> ZkServer:
        (self.dir / "data").mkdir(exist_ok=True)
        log = (self.dir / "server.log").open("ab")
        self.process = subprocess.Popen(
            ["java", "-Xmx256m", "-XX:+UseSerialGC", "-cp", self.classpath,
             "org.apache.zookeeper.server.ZooKeeperServerMain", str(self._config())],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ZooKeeper exited: "
                                   f"{(self.dir / 'server.log').read_text()[-2000:]}")
            if self.answers():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"ZooKeeper did not answer on port {self.port} in "
                           f"{timeout:g}s")

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log (for a failing test's message)."""
        try:
            return (self.dir / "server.log").read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no server log: {exc})"

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"ruok")
                return s.recv(16) == b"imok"
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (SIGKILL: nothing is flushed that a crash would not)."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)

    def restart(self) -> None:
        """Stop and start again on the same port and data dir."""
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def zk_server() -> Iterator[ZkServer]:
    """One ZooKeeper server for the session (skipped, saying why, without one)."""
    try:
        server = ZkServer()
    except RuntimeError as exc:
        pytest.skip(f"ZooKeeper server not available: {exc}")
    try:
        server.start()
    except RuntimeError as exc:
        server.cleanup()
        pytest.skip(f"ZooKeeper server did not start: {exc}")
    try:
        yield server
    finally:
        with contextlib.suppress(ImportError):
            from celery_dlock.backends.zookeeper.session import close_sessions

            close_sessions()
        server.cleanup()


class ZkView:
    """The reads the lock tests make of a lock's keys, answered from ZooKeeper.

    A key is a lock node's path (``lock.keys.lock``): ``exists`` says whether it is
    held, ``hget``/``hgetall`` read the holder's child (``owner``, ``count``,
    ``fence`` = its czxid, ``ttl``), ``pttl`` is the ttl the server keeps it for a
    dead holder; the path plus :data:`LINE` is its line of waiters (``exists``,
    ``zrange``: the owners after the holder).
    """

    def __init__(self, hosts: str) -> None:
        self.hosts = hosts
        self._pid = 0
        self._client: Any = None

    @property
    def client(self) -> Any:
        """This process's client (a forked child makes its own: the parent's
        connection thread does not exist there)."""
        if self._pid != os.getpid():
            from kazoo.client import KazooClient

            self._client = KazooClient(hosts=self.hosts, timeout=10)
            self._client.start(timeout=20)
            self._pid = os.getpid()
        return self._client

    def close(self) -> None:
        if self._client is not None and self._pid == os.getpid():
            self._client.stop()
            self._client.close()

    def _line(self, path: str) -> list[tuple[str, dict[str, Any], Any]]:
        from kazoo.exceptions import NoNodeError

        try:
            names = self.client.get_children(path)
        except NoNodeError:
            return []
        out = []
        for child in sorted(names, key=lambda n: n[-10:]):
            try:
                raw, stat = self.client.get(f"{path}/{child}")
            except NoNodeError:
                continue
            out.append((f"{path}/{child}", json.loads(raw), stat))
        return out

    def exists(self, *keys: str) -> int:
        count = 0
        for key in keys:
            if key.endswith(LINE):
                count += len(self._line(key[:-len(LINE)])) > 1
            else:
                count += bool(self._line(key))
        return count

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        line = self._line(key)
        if not line:
            return {}
        _, data, stat = line[0]
        fields = {"owner": data["owner"], "count": data["count"], "ttl": data["ttl"],
                  "fence": stat.czxid, "pid": data.get("pid"), **data["info"]}
        return {k.encode(): str(v).encode() for k, v in fields.items()
                if v is not None}

    def hget(self, key: str, field: str) -> bytes | None:
        return self.hgetall(key).get(field.encode())

    def pttl(self, key: str) -> int:
        line = self._line(key)
        return int(line[0][1]["ttl"]) if line else -2

    def zrange(self, key: str, start: int, end: int) -> list[bytes]:
        path = key[:-len(LINE)] if key.endswith(LINE) else key
        owners = [d["owner"].encode() for _, d, _ in self._line(path)[1:]]
        return owners[start:] if end == -1 else owners[start:end + 1]

    def delete(self, *keys: str) -> int:
        """Delete the holder's child of each lock node (the hold, nothing else)."""
        gone = 0
        for key in keys:
            line = self._line(key)
            if line:
                with contextlib.suppress(Exception):
                    self.client.delete(line[0][0])
                    gone += 1
        return gone

    def delete_all(self, key: str) -> None:
        """Delete the lock node and every child (its holder and its line)."""
        with contextlib.suppress(Exception):
            self.client.delete(key, recursive=True)
