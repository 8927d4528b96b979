"""A throwaway RabbitMQ node for the chaos runs' AMQP broker.

:class:`RabbitServer` runs Debian's ``rabbitmq-server`` (``/usr/lib/rabbitmq/bin``, or
``$DLOCK_RABBITMQ_SERVER``) as a node of its own: a unique ``RABBITMQ_NODENAME``, free
loopback ports for AMQP (``RABBITMQ_NODE_PORT``), Erlang distribution
(``RABBITMQ_DIST_PORT``) and a private ``epmd`` (``ERL_EPMD_PORT``), its database,
logs, config files and Erlang cookie (``HOME``) in a temp dir, no plugins.  The
database is kept across :meth:`RabbitServer.restart`, so durable queues and persistent
messages survive it as in production.  :class:`Unavailable` says why there is none
(the caller skips, saying so).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

__all__ = ["RabbitServer", "Unavailable", "find_rabbitmq_server"]


class Unavailable(RuntimeError):
    """No RabbitMQ node can be started here (the message says why)."""


def find_rabbitmq_server() -> Path:
    """The ``rabbitmq-server`` script that starts a node in the foreground."""
    wanted = os.environ.get("DLOCK_RABBITMQ_SERVER")
    candidates = [wanted] if wanted else ["/usr/lib/rabbitmq/bin/rabbitmq-server"]
    for c in candidates:
        if Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    if wanted:
        raise Unavailable(f"DLOCK_RABBITMQ_SERVER={wanted} is not an executable")
    raise Unavailable("no rabbitmq-server (apt-get install rabbitmq-server, or set "
                      "DLOCK_RABBITMQ_SERVER)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RabbitServer:
    """``RabbitServer().start()``: a node of the caller's own (see the module text)."""

    def __init__(self) -> None:
        self.binary = find_rabbitmq_server()
        self.dir = Path(tempfile.mkdtemp(prefix="dlock-rabbitmq-"))
        self.port = _free_port()
        self.dist_port = _free_port()
        self.epmd_port = _free_port()
        self.node = f"dlock{uuid.uuid4().hex[:8]}@localhost"
        self.process: subprocess.Popen[bytes] | None = None
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq-env.conf").write_text("")

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "HOME": str(self.dir),  # the Erlang cookie
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS":
                "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_PID_FILE": str(self.dir / "node.pid"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
        })
        return env

    def start(self, timeout: float = 90.0) -> RabbitServer:
        log = (self.dir / "server.log").open("ab")
        self.process = subprocess.Popen(
            [str(self.binary)], cwd=self.dir, env=self.env(), stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = (self.dir / "server.log").read_text(errors="replace")[-2000:]
                self.process = None
                raise Unavailable(f"rabbitmq-server exited: {tail}")
            if self.answers():
                return self
            time.sleep(0.2)
        self.stop()
        raise Unavailable(f"RabbitMQ did not answer on port {self.port} in {timeout:g}s")

    def answers(self) -> bool:
        """Whether the node speaks AMQP on its port (it answers a protocol header)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"AMQP\x00\x00\x09\x01")
                s.settimeout(2)
                return s.recv(1) == b"\x01"  # the first byte of connection.start
        except OSError:
            return False

    def halt(self, hard: bool = True) -> None:
        """Stop the node, its database kept: SIGKILL (a crash) or SIGTERM (a clean
        shutdown); every process of its session goes."""
        proc, self.process = self.process, None
        if proc is None:
            return
        if not hard:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 10  # the port is free again
        while self.answers() and time.monotonic() < deadline:
            time.sleep(0.1)

    def restart(self, hard: bool = True, down: float = 0.0) -> None:
        self.halt(hard)
        time.sleep(down)
        self.start()

    def stop(self) -> None:
        """Stop the node and its epmd, and remove the temp dir."""
        self.halt(hard=True)
        epmd = shutil.which("epmd") or next(
            iter(sorted(Path("/usr/lib/erlang").glob("erts-*/bin/epmd"))), None)
        if epmd is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run([str(epmd), "-port", str(self.epmd_port), "-kill"],
                               env=self.env(), capture_output=True, timeout=10,
                               check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
