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
