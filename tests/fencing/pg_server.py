"""A throwaway PostgreSQL server for the fenced-write tests.

Debian's ``postgresql`` package (``/usr/lib/postgresql/<version>/bin``, or ``initdb``
and ``pg_ctl`` on ``PATH``; ``$DLOCK_PG_BINDIR`` names another directory): ``initdb`` in
a temporary directory, ``pg_ctl start`` on a free loopback port, trust authentication,
no fsync (``durable=True``: fsync and synchronous commits, for a server whose crash
must keep every acknowledged commit).  PostgreSQL refuses to run as root: when the
tests run as root the server runs as the ``postgres`` user (``runuser``).
:class:`Unavailable` says why there is no server, for the skip reason.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

__all__ = ["PostgresServer", "Unavailable", "find_bindir"]

USER = "dlock"


class Unavailable(RuntimeError):
    """No PostgreSQL server can be started here (the message says why)."""


def find_bindir() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl``."""
    wanted = os.environ.get("DLOCK_PG_BINDIR")
    if wanted:
        candidates = [wanted]
    else:
        candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                            key=lambda p: int(Path(p).parent.name)
                            if Path(p).parent.name.isdigit() else 0, reverse=True)
        on_path = shutil.which("pg_ctl")
        if on_path:
            candidates.append(str(Path(on_path).parent))
    for c in candidates:
        if (Path(c) / "initdb").exists() and (Path(c) / "pg_ctl").exists():
            return Path(c)
    if wanted:
        raise Unavailable(f"DLOCK_PG_BINDIR={wanted} holds no initdb and pg_ctl")
    raise Unavailable("no PostgreSQL server binaries (initdb, pg_ctl): "
                      "apt-get install postgresql, or set DLOCK_PG_BINDIR")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """``with PostgresServer() as pg: pg.url``: a server of the caller's own."""

    def __init__(self, *, durable: bool = False) -> None:
        self.bindir = find_bindir()
        self.durable = durable
        self.prefix: list[str] = []
        self.owner: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            try:
                self.owner = pwd.getpwnam("postgres")
            except KeyError:
                raise Unavailable("running as root and there is no 'postgres' user "
                                  "to run the server as") from None
            runuser = shutil.which("runuser")
            if runuser is None:
                raise Unavailable("running as root and there is no runuser to run "
                                  "the server as 'postgres'")
            self.prefix = [runuser, "-u", "postgres", "--"]
        self.dir = Path(tempfile.mkdtemp(prefix="dlock-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = 0
        self.url = ""

    def _run(self, *argv: str) -> None:
        proc = subprocess.run([*self.prefix, *argv], capture_output=True, text=True,
                              timeout=120, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise Unavailable(f"{Path(argv[0]).name} failed ({proc.returncode}): "
                              f"{' / '.join(tail)}")

    def start(self) -> PostgresServer:
        if self.owner is not None:
            os.chown(self.dir, self.owner.pw_uid, self.owner.pw_gid)
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", USER,
                  "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
        error: Unavailable | None = None
        for _ in range(3):  # another process may take the free port before we do
            self.port = _free_port()
            try:
                self._pg_start()
            except Unavailable as exc:
                error = exc
                continue
            self.url = f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"
            return self
        log = self.log.read_text(errors="replace") if self.log.exists() else ""
        raise Unavailable(f"{error}; {log.strip().splitlines()[-1:] or ''}")

    def _pg_start(self) -> None:
        sync = ("-c fsync=on -c synchronous_commit=on" if self.durable else
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                   f"{sync} -c max_connections=80")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l",
                  str(self.log), "-o", options, "-w", "-t", "60", "start")

    def halt(self, mode: str = "fast") -> None:
        """Stop the server, its data kept (``fast``: a clean shutdown that closes
        every connection; ``immediate``: a crash, which loses the commits not yet
        flushed, as ``synchronous_commit=off`` here allows)."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m",
                  mode, "-w", "-t", "30", "stop")

    def restart(self) -> None:
        """Start it again, on the same port, after :meth:`halt`."""
        self._pg_start()

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(Exception):
                self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m",
                          "immediate", "-w", "-t", "30", "stop")
            self.url = ""
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
