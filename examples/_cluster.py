"""Process plumbing for the example runners: a Redis and real ``celery`` processes.

The approach of ``celery-dlock demo`` (:mod:`celery_dlock.ops.demo`), made generic over
the app module and the sub-command (``worker`` or ``beat``): every process is
``python -m celery -A examples.NAME ...`` in its own session, started from the
repository root with ``REDIS_URL`` in its environment, its output in a log file (shown
when the run fails), stopped with SIGTERM and, if it lingers, SIGKILL of its group.
Workers are known to be up when they answer ``app.control.ping``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from celery import Celery

from celery_dlock.ops.embedded import EmbeddedRedis

__all__ = ["REPO", "Cluster", "beat_argv", "redis_server", "say", "worker_argv"]

REPO = Path(__file__).resolve().parents[1]


def say(text: str = "") -> None:
    """Print a line of the runner's story at once (workers log to files)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@contextmanager
def redis_server(url: str | None = None) -> Iterator[str]:
    """``url`` when given, else a throwaway redis-server's URL for the block."""
    if url:
        yield url
        return
    with EmbeddedRedis() as server:
        say(f"embedded redis-server at {server.url}")
        yield server.url


def worker_argv(module: str, node: str, concurrency: int = 2) -> list[str]:
    """``celery worker`` arguments: prefork pool, quiet cluster chatter."""
    return ["-A", module, "worker", "--pool=prefork", f"--concurrency={concurrency}",
            "-n", node, "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--loglevel=INFO"]


def beat_argv(module: str, schedule_file: str | os.PathLike[str]) -> list[str]:
    """``celery beat`` arguments, with its own schedule file."""
    return ["-A", module, "beat", f"--schedule={schedule_file}", "--loglevel=INFO"]


class Cluster:
    """Named ``celery`` subprocesses sharing one Redis; a context manager."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self._dir = tempfile.TemporaryDirectory(prefix="dlock-example-")
        self.dir = Path(self._dir.name)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        env = dict(os.environ, REDIS_URL=self.redis_url,
                   PYTHONPATH=os.pathsep.join(filter(None, [
                       str(REPO), os.environ.get("PYTHONPATH", "")])))
        with open(self.dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", *argv], cwd=REPO, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.procs[name] = proc
        return proc

    def wait_for_workers(self, app: Celery, nodes: Sequence[str],
                         timeout: float = 30.0) -> None:
        """Block until every worker node answers a ping."""
        deadline = time.monotonic() + timeout
        waiting = set(nodes)
        while waiting:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} at start")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not up after {timeout:.0f}s: "
                                   f"{', '.join(sorted(waiting))}")
            for reply in app.control.ping(destination=list(waiting), timeout=0.5) or []:
                waiting -= set(reply)

    def stop(self, *names: str, timeout: float = 15.0) -> None:
        """SIGTERM the named processes (all by default) together; SIGKILL stragglers."""
        chosen = [self.procs.pop(n) for n in (names or list(self.procs))]
        for proc in chosen:
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in chosen:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # and any child left behind
            proc.wait()

    def log_tails(self, lines: int = 25) -> str:
        out = []
        for log in sorted(self.dir.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name} (last {len(text)} lines) ---")
            out += text
        return "\n".join(out)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None,
                 tb: object) -> None:
        self.stop()
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            sys.stderr.write(self.log_tails() + "\n")
        self._dir.cleanup()
