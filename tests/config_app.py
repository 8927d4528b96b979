"""A Celery app configured entirely from the environment, for ``celery worker``
subprocesses that test configuration (``tests/test_secrets.py``,
``tests/test_worker_config.py``).

:data:`ENV_CONF` holds the JSON of ``app.conf`` and :data:`ENV_OPTIONS` the JSON of
extra options for the locked task, so a test can start a worker with any
configuration, good or bad, without a module of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from celery import Celery

from celery_dlock import LockedTask

ENV_CONF = "DLOCK_CFGAPP_CONF"
ENV_OPTIONS = "DLOCK_CFGAPP_OPTIONS"

app = Celery("config_app", set_as_current=False)
app.conf.update(json.loads(os.environ.get(ENV_CONF) or "{}"))


@app.task(base=LockedTask, bind=True, name="cfgapp.locked", lock_key="cfg:{k}",
          **json.loads(os.environ.get(ENV_OPTIONS) or "{}"))
def locked(self: Any, k: str) -> dict[str, Any]:
    lock = self.lock
    return {"key": lock.name, "held": lock.owned(), "fence": lock.fence}


def run(conf: dict[str, Any], *args: str, timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    """``celery -A config_app ARGS`` in a subprocess, its app configured with
    ``conf`` (``dlock check``, a ``worker`` that refuses to start, ...)."""
    tests = str(Path(__file__).resolve().parent)
    env = {k: v for k, v in os.environ.items()
           if k not in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")}
    env.update({ENV_CONF: json.dumps(conf), "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(
                    p for p in (tests, os.environ.get("PYTHONPATH")) if p)})
    return subprocess.run([sys.executable, "-m", "celery", "-A", "config_app", *args],
                          env=env, cwd=tests, capture_output=True, text=True,
                          timeout=timeout, check=False)
