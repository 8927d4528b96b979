"""A ``celery worker`` refuses a configuration that cannot work, at start, with one
line naming the setting and a non-zero exit (issue 11, items 9 and 10); and finds
Redis as Celery does (item 5: ``CELERY_BROKER_URL``, which ``celery -b`` sets).

Real worker subprocesses (solo pool: what is checked happens in the main process)
configured through :mod:`config_app`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from celery_helpers import QUICK_POLLING, close_app, test_app, test_conf
from config_app import ENV_CONF, ENV_OPTIONS
from dlock_helpers import wait_until
from url_passwords import PASSWORDS, RAW_WORKS, assert_hidden

from celery_dlock.backends.redis.keyspace import LockKeys

TESTS_DIR = Path(__file__).resolve().parents[1]
#: Seconds a refused worker gets to exit; it exits during start-up, in about one.
EXIT_TIMEOUT = 60

pytestmark = pytest.mark.slow


def _env(conf: dict[str, Any], options: dict[str, Any] | None = None,
         **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")}
    path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH"))
                           if p)
    env.update({ENV_CONF: json.dumps(conf), ENV_OPTIONS: json.dumps(options or {}),
                "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra})
    return env


def _worker_args(queue: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "config_app", "worker", "--pool=solo",
            "-Q", queue, "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-l", "info"]


def _refused(conf: dict[str, Any], options: dict[str, Any] | None = None
             ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(_worker_args(f"q-{uuid.uuid4().hex[:8]}"),
                          env=_env(conf, options), cwd=TESTS_DIR, capture_output=True,
                          text=True, timeout=EXIT_TIMEOUT, check=False)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "ready." not in proc.stdout + proc.stderr
    return proc


def _base_conf(redis_url: str) -> dict[str, Any]:
    return test_conf(redis_url, broker_connection_retry_on_startup=True)


def test_bad_dlock_url_stops_the_worker_with_the_password_masked(redis_url):
    conf = {**_base_conf(redis_url), "dlock_url": "http://:S3cretPW@nope"}
    proc = _refused(conf)
    output = proc.stdout + proc.stderr
    assert "S3cretPW" not in output
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("celery-dlock: app.conf.dlock_url must be"), output
    assert "'http://:**@nope'" in last


@pytest.mark.parametrize("password", [p for p in PASSWORDS if p.values[0] != RAW_WORKS])
@pytest.mark.parametrize("spelling", ["one", "sentinel", "redlock"])
def test_an_unencoded_password_that_makes_the_url_ambiguous_stops_the_worker(
        redis_url, password, spelling):
    one = f"redis://:{password}@127.0.0.1:6379/0"
    url = {"one": one,
           "sentinel": f"sentinel://:{password}@127.0.0.1:26379;sentinel://127.0.0.1:1",
           "redlock": ";".join(f"redlock://:{password}@127.0.0.1:{p}/0"
                               for p in (1, 2, 3))}[spelling]
    conf = {**_base_conf(redis_url), "dlock_url": url,
            "dlock_transport_options": {"master_name": "m"}}
    proc = _refused(conf)
    output = proc.stdout + proc.stderr
    assert_hidden(output, password)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("celery-dlock: app.conf.dlock_url"), output
    assert "one way only" in last and "%23" in last, last


def test_misspelt_setting_stops_the_worker(redis_url):
    proc = _refused({**_base_conf(redis_url), "dlock_tll": 5})
    last = proc.stderr.strip().splitlines()[-1]
    assert "app.conf.dlock_tll" in last and "did you mean dlock_ttl?" in last, last


def test_bad_setting_value_stops_the_worker(redis_url):
    proc = _refused({**_base_conf(redis_url), "dlock_on_contention": "sometimes"})
    last = proc.stderr.strip().splitlines()[-1]
    assert "app.conf.dlock_on_contention must be one of" in last, last


def test_misspelt_task_option_stops_the_worker(redis_url):
    proc = _refused(_base_conf(redis_url), {"lock_tll": 5})
    last = proc.stderr.strip().splitlines()[-1]
    assert "unknown option lock_tll (did you mean lock_ttl?)" in last, last


def test_no_redis_anywhere_stops_the_worker(redis_url, tmp_path):
    folder = tmp_path / "broker"
    folder.mkdir()
    conf = {"broker_url": "filesystem://", "result_backend": "rpc://",
            "broker_transport_options": {"data_folder_in": str(folder),
                                         "data_folder_out": str(folder),
                                         "control_folder": str(tmp_path / "control")}}
    proc = _refused(conf)
    last = proc.stderr.strip().splitlines()[-1]
    assert "celery-dlock needs a lock store: set app.conf.dlock_url" in last, last
    assert "PostgreSQL" in last  # every store, not Redis alone


def test_broker_from_the_environment_in_a_worker(redis_url, r, prefix):
    """No broker in code: ``CELERY_BROKER_URL`` names Redis, for Celery and the locks."""
    queue = f"q-{prefix}"
    conf = test_conf(queue=queue, prefix=prefix, result_backend=redis_url,
                     **QUICK_POLLING)
    log = subprocess.DEVNULL
    worker = subprocess.Popen(_worker_args(queue),
                              env=_env(conf, CELERY_BROKER_URL=redis_url),
                              cwd=TESTS_DIR, stdin=subprocess.DEVNULL, stdout=log,
                              stderr=log, start_new_session=True)
    client = test_app("client", redis_url, queue=queue)
    try:
        out = client.send_task("cfgapp.locked", ("7",)).get(timeout=60)
        assert out["key"] == "cfg:7" and out["held"] is True
        fence_key = LockKeys.for_name(prefix, "cfg:7").fence
        # the task's final release left the counter at its fence + 1
        assert int(r.get(fence_key) or 0) == out["fence"] + 1 >= 2
    finally:
        _stop(worker)
        close_app(client)
    assert wait_until(lambda: worker.returncode is not None, timeout=5)


def _stop(worker: subprocess.Popen[Any]) -> None:
    """Stop a worker (warm, then its whole process group)."""
    worker.terminate()
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, 9)
        worker.wait(timeout=30)



# -- the lock store itself, checked at start (celery dlock check's checks) -------------

def _started(conf: dict[str, Any], timeout: float = 60) -> str:
    """Start a worker with ``conf``, wait until it is ready, stop it: its output."""
    worker = subprocess.Popen(_worker_args(f"q-{uuid.uuid4().hex[:8]}"),
                              env=_env(conf), cwd=TESTS_DIR, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    assert worker.stdout is not None
    seen: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        for line in worker.stdout:
            seen.append(line)
            if "ready." in line or time.monotonic() > deadline:
                break
    finally:
        _stop(worker)
        worker.stdout.close()
    output = "".join(seen)
    assert "ready." in output, output
    return output


def test_a_store_that_may_evict_locks_stops_the_worker(own_server, redis_url):
    own = redis.Redis.from_url(own_server.url)
    own.config_set("maxmemory", 100 * 1024 * 1024)
    own.config_set("maxmemory-policy", "allkeys-lru")
    conf = {**_base_conf(redis_url), "dlock_url": own_server.url}
    proc = _refused(conf)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("celery-dlock: the redis lock store: "), last
    assert "maxmemory-policy allkeys-lru" in last and "noeviction" in last
    # the check can be left to celery dlock check
    assert "ready." in _started({**conf, "dlock_check_at_start": False})
    own.config_set("maxmemory-policy", "noeviction")
    assert "ready." in _started(conf)


def test_a_store_that_does_not_answer_at_start_lets_the_worker_start(redis_url):
    """Down for a moment is not a configuration error: the worker starts, says so,
    and its locked tasks fail closed until the store answers."""
    conf = {**_base_conf(redis_url), "dlock_url": "redis://127.0.0.1:1/0"}
    output = _started(conf)
    assert "the lock store does not answer" in output, output
