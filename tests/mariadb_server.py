"""A throwaway MariaDB server for the tests, and its session fixture ``mariadb_url``.

Debian's ``mariadb-server`` package (``mariadbd`` or ``mysqld`` and
``mariadb-install-db`` or ``mysql_install_db`` on ``PATH`` or in ``/usr/sbin``,
``/usr/bin``; ``$DLOCK_MARIADB_BINDIR`` names another directory): a data directory made
by ``mariadb-install-db`` in a temporary directory, the server on a free loopback port
(``--bind-address=127.0.0.1``) with its socket in that directory, no durability (the
data is thrown away) and grant tables on: an init file creates the user ``dlock`` with
a random password and a database ``dlock`` it owns (and may grant on, to users it
creates).  MariaDB runs as root only when
told, so as root the server is started with ``--user=root``.  :class:`Unavailable`
says why there is no server, for the skip reason.

``mariadb_url`` is a session fixture (import it into a conftest: ``from
mariadb_server import mariadb_url  # noqa: F401``): the URL of the session's server,
``mysql://dlock:<password>@127.0.0.1:<port>/dlock``, or of the running server
``$DLOCK_TEST_MYSQL_URL`` names; skipped with the reason when PyMySQL is missing or no
server can start.  Tests create tables of their own and drop nothing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

__all__ = ["MariaDBServer", "Unavailable", "connect_args", "find_binaries",
           "mariadb_url"]

USER = "dlock"
DATABASE = "dlock"
START_TIMEOUT = 60.0

_state: dict[str, Any] = {}


class Unavailable(RuntimeError):
    """No MariaDB server can be started here (the message says why)."""


def find_binaries() -> tuple[Path, Path]:
    """``(server, install_db)``: ``mariadbd`` (or ``mysqld``) and
    ``mariadb-install-db`` (or ``mysql_install_db``)."""
    wanted = os.environ.get("DLOCK_MARIADB_BINDIR")
    dirs = [wanted] if wanted else [*os.environ.get("PATH", "").split(os.pathsep),
                                    "/usr/sbin", "/usr/bin", "/usr/local/sbin",
                                    "/usr/local/bin"]

    def first(*names: str) -> Path | None:
        for d in dirs:
            for n in names:
                p = Path(d) / n
                if d and p.is_file() and os.access(p, os.X_OK):
                    return p
        return None

    server = first("mariadbd", "mysqld")
    install = first("mariadb-install-db", "mysql_install_db")
    if server is not None and install is not None:
        return server, install
    where = f"DLOCK_MARIADB_BINDIR={wanted}" if wanted else "PATH, /usr/sbin, /usr/bin"
    raise Unavailable(f"no MariaDB server binaries (mariadbd, mariadb-install-db) in "
                      f"{where}: apt-get install mariadb-server, or set "
                      f"DLOCK_MARIADB_BINDIR")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connect_args(url: str) -> dict[str, Any]:
    """PyMySQL's ``connect()`` keywords for a ``mysql://user:password@host:port/db``."""
    parts = urlsplit(url)
    return {"host": parts.hostname or "127.0.0.1", "port": parts.port or 3306,
            "user": unquote(parts.username or ""),
            "password": unquote(parts.password or ""),
            "database": parts.path.lstrip("/") or None}


class MariaDBServer:
    """``with MariaDBServer() as db: db.url``: a server of the caller's own."""

    def __init__(self) -> None:
        self.server, self.install_db = find_binaries()
        self.dir = Path(tempfile.mkdtemp(prefix="dlock-mariadb-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.socket = self.dir / "mariadb.sock"
        # Its temporary tables in a folder of its own: in the shared /tmp, one was once
        # gone before mariadb-install-db removed it, and the install failed.
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir()
        self.password = secrets.token_hex(16)
        self.as_root = ["--user=root"] if os.geteuid() == 0 else []
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.url = ""

    def _install(self) -> None:
        proc = subprocess.run(
            [str(self.install_db), "--no-defaults", f"--datadir={self.data}",
             f"--tmpdir={self.tmp}", *self.as_root,
             "--auth-root-authentication-method=socket", "--skip-test-db",
             "--skip-name-resolve"],
            capture_output=True, text=True, timeout=180, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise Unavailable(f"{self.install_db.name} failed ({proc.returncode}): "
                              f"{' / '.join(tail)}")

    def _init_file(self) -> Path:
        path = self.dir / "init.sql"
        path.write_text(
            f"CREATE DATABASE IF NOT EXISTS {DATABASE};\n"
            f"CREATE USER IF NOT EXISTS '{USER}'@'127.0.0.1' "
            f"IDENTIFIED BY '{self.password}';\n"
            f"GRANT ALL PRIVILEGES ON {DATABASE}.* TO '{USER}'@'127.0.0.1' "
            f"WITH GRANT OPTION;\n"
            # tests make users of their own with only the privileges they name
            f"GRANT CREATE USER ON *.* TO '{USER}'@'127.0.0.1';\n")
        path.chmod(0o600)
        return path

    def _try_start(self, init: Path | None, port: int | None = None) -> str | None:
        """Start on ``port`` (default: a fresh free one), running ``init`` first when
        given; None when it serves, else the reason."""
        self.port = port or _free_port()
        self.log.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [str(self.server), "--no-defaults", *self.as_root,
             f"--datadir={self.data}", f"--socket={self.socket}", f"--tmpdir={self.tmp}",
             f"--pid-file={self.dir / 'mariadb.pid'}", f"--log-error={self.log}",
             f"--port={self.port}", "--bind-address=127.0.0.1",
             *([f"--init-file={init}"] if init is not None else []),
             "--skip-name-resolve", "--skip-log-bin",
             "--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0",
             "--innodb-buffer-pool-size=32M",
             "--performance-schema=OFF", "--max-connections=60",
             "--character-set-server=utf8mb4"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"mariadbd exited ({self.proc.returncode}): {self._log_tail()}"
            if "ready for connections" in self._log_text():
                return None
            time.sleep(0.1)
        return f"mariadbd did not start in {START_TIMEOUT:.0f}s: {self._log_tail()}"

    def _log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _log_tail(self) -> str:
        errors = [line for line in self._log_text().splitlines() if "[ERROR]" in line]
        return " / ".join(errors[-2:]) or "(no error in its log)"

    def start(self) -> MariaDBServer:
        self._install()
        init = self._init_file()
        reason = ""
        for _ in range(3):  # another process may take the free port before we do
            failed = self._try_start(init)
            if failed is None:
                init.unlink()
                self.url = (f"mysql://{USER}:{self.password}@127.0.0.1:{self.port}/"
                            f"{DATABASE}")
                return self
            reason = failed
            self._kill()
        raise Unavailable(reason)

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)  # the data is thrown away anyway
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)

    def halt(self) -> None:
        """Stop the server, its data kept (a clean shutdown: every connection is
        closed)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)

    def restart(self) -> None:
        """Start it again, on the same port, after :meth:`halt`."""
        failed = self._try_start(None, port=self.port)
        if failed is not None:
            raise Unavailable(failed)

    def stop(self) -> None:
        self._kill()
        self.url = ""
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> MariaDBServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def mariadb_url() -> Iterator[str]:
    """A MariaDB (or MySQL) server for the session (started on first use), else skip."""
    url = os.environ.get("DLOCK_TEST_MYSQL_URL")
    if url:
        yield url
        return
    try:
        import pymysql  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"no MySQL driver: {exc} (pip install PyMySQL)")
    if "unavailable" in _state:
        pytest.skip(_state["unavailable"])
    try:
        with MariaDBServer() as server:
            yield server.url
            return
    except Unavailable as exc:
        _state["unavailable"] = f"no MariaDB server: {exc}"
    pytest.skip(_state["unavailable"])
