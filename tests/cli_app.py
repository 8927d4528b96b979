"""The Celery app that ``tests/test_cli.py`` inspects with ``celery -A cli_app dlock``.

Importable by name both in the test process (``celery -A cli_app:app`` through Celery's
own click group, and the in-process worker) and in a ``python -m celery`` subprocess,
which configures it from the environment (:data:`ENV_URL`, :data:`ENV_PREFIX`).  The
test process configures the same module-level ``app`` with :func:`configure`.

``hold(x)`` takes the lock ``cli:{x}`` and blocks until :func:`open_gate` is called for
``x`` (a ``BLPOP`` on a list outside the lock keys), so tests can inspect a lock held
by a real running task.  ``probe(x)`` takes the same lock and skips when it is held.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery_helpers import test_conf

from celery_dlock import LockedTask

ENV_URL = "DLOCK_CLI_REDIS_URL"
ENV_PREFIX = "DLOCK_CLI_PREFIX"

GATE_TIMEOUT = 30

_TESTS_DIR = str(Path(__file__).resolve().parent)

app = Celery("cli_app", set_as_current=False)

_clients: dict[str, redis.Redis] = {}


def configure(url: str, prefix: str, queue: str, **conf: Any) -> Celery:
    app.conf.update(test_conf(url, queue=queue, prefix=prefix, **conf))
    return app


if os.environ.get(ENV_URL):
    configure(os.environ[ENV_URL], os.environ.get(ENV_PREFIX, "dlock"), "cli-unused")


def _client() -> redis.Redis:
    url = app.conf.broker_url
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url, socket_timeout=60)
    return client


def gate_key(prefix: str, x: str) -> str:
    return f"{prefix}-data:gate:{x}"


def open_gate(client: redis.Redis, prefix: str, x: str) -> None:
    client.rpush(gate_key(prefix, x), 1)
    client.expire(gate_key(prefix, x), 60)


@app.task(base=LockedTask, bind=True, name="cli_app.hold", lock_key="cli:{x}",
          lock_ttl=10, on_contention="skip")
def hold(self: Any, x: str) -> dict[str, Any]:
    started = time.monotonic()
    _client().blpop([gate_key(self.app.conf.dlock_key_prefix, x)], timeout=GATE_TIMEOUT)
    return {"fence": self.lock.fence, "held": time.monotonic() - started}


@app.task(base=LockedTask, bind=True, name="cli_app.hold_hashed", lock_args=("x",),
          lock_ttl=10)
def hold_hashed(self: Any, x: str, note: str = "") -> str:
    """``hold`` with a hashed lock name (``lock_key=None``, keyed on ``x`` alone)."""
    _client().blpop([gate_key(self.app.conf.dlock_key_prefix, x)], timeout=GATE_TIMEOUT)
    return self.lock.name


@app.task(base=LockedTask, bind=True, name="cli_app.probe", lock_key="cli:{x}",
          on_contention="skip")
def probe(self: Any, x: str) -> str:
    return "ran"


def run_cli(url: str, prefix: str, *args: str, timeout: float = 60,
            extra_env: Mapping[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
    """``celery -A cli_app dlock ARGS`` in a subprocess, as an operator runs it, with
    this module's app pointed at ``url`` and ``prefix``."""
    path = os.pathsep.join(p for p in (_TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "cli_app", "dlock", *args],
        env={**os.environ, "PYTHONPATH": path, ENV_URL: url, ENV_PREFIX: prefix,
             **(extra_env or {})},
        capture_output=True, text=True, timeout=timeout, check=False)
