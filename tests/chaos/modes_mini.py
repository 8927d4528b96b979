"""A short modes run without fault injection, for any queue-marker store: the calls
where a broken marker store shows, recorded in the modes scenario's format so that
:func:`modes_check.check` judges it.

The calls are sent while no worker runs (so a revoke reaches nobody, as a revoke sent
while the workers restart), then a real ``celery worker`` (prefork) runs them:

* ``until_finished`` / ``raise``: a call, then another of the same name (a duplicate);
* ``until_started`` / ``replace``: a call with a countdown, then one that replaces it
  (and runs at once: the replaced one's eta comes after the new one has started).

``markers`` is the class the producer's backend claims with (the real
:class:`~celery_dlock.backends.redis.markers.RedisMarkers`, or a broken one of
:mod:`broken_markers`); the worker runs the shipped code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any
from unittest import mock

import chaos_driver
import modes_check
import modes_producer
from chaos_records import Recorder

COUNTDOWN = 5.0


def run(out: Path, markers: Any, redis_url: str, prefix: str,
        timeout: float = 40.0) -> Path:
    (out / "records").mkdir(parents=True)
    queue = f"q-{prefix}"
    log = Recorder(out / "driver.jsonl")
    t0 = time.time()
    app = modes_producer.producer_app(redis_url, redis_url, prefix, queue, 2.0, False)
    producer = modes_producer.Producer(app, log, 0, [], rated=False, queue=queue)
    target = "celery_dlock.backends.redis.backend.RedisMarkers"
    try:
        with mock.patch(target, markers):
            producer.send("uf", "until_finished", "raise", seconds=0.5)
            producer.send("uf", "until_finished", "raise", seconds=0.5)
            producer.send("us", "until_started", "replace", seconds=0.2,
                          countdown=COUNTDOWN)
            producer.send("us", "until_started", "replace", seconds=0.2)
    finally:
        producer.close()
        app.close()
    env = {**os.environ, "CHAOS_BROKER_URL": redis_url, "CHAOS_BROKER": "redis",
           "CHAOS_LOCK_URL": redis_url, "CHAOS_PREFIX": prefix, "CHAOS_QUEUE": queue,
           "CHAOS_DB": "sqlite", "CHAOS_DSN": str(out / "unused.sqlite3"),
           "CHAOS_RECORDS": str(out / "records"), "CHAOS_TTL": "2",
           "PYTHONPATH": os.pathsep.join([str(chaos_driver.HERE),
                                          str(chaos_driver.REPO)]),
           "PYTHONUNBUFFERED": "1"}
    worker = chaos_driver.start_worker(out / "worker.log", env, queue,
                                       f"mini-{prefix}", 2)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.3)
            if time.time() > t0 + COUNTDOWN + 1 and modes_check.pending(out) == 0:
                break
        time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
    meta = {"config": {"seed": 0, "lock": "redis", "scenario": "modes"},
            "t0": t0, "end": time.time(), "broker_left": {"ids": None}}
    (out / "meta.json").write_text(json.dumps(meta))
    return out
