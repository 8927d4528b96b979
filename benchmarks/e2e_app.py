"""The Celery app that ``bench_e2e.py`` runs in a real ``celery worker`` (prefork).

Both sides import this module: the worker with ``celery -A e2e_app worker`` (with
``benchmarks/`` on ``PYTHONPATH``), the benchmark process to send the tasks.  The app is
configured from the environment, which the benchmark sets before either import:

* ``DLOCK_E2E_REDIS_URL``  broker, celery-dlock, celery-once and celery-singleton Redis
* ``DLOCK_E2E_PREFIX``     per-run prefix of every key (queue, counter, locks)
* ``DLOCK_E2E_LOCK_URL``   optional: the ``dlock_url`` of the ``LockedTask`` variants
                           (``bench_backends.py``: a PostgreSQL or ZooKeeper URL);
                           unset, the locks live in the broker's Redis
* ``DLOCK_E2E_PEER_LOCK_URL``  optional: the Redis of celery-once's and
                           celery-singleton's locks (``bench_commands.py``: a server
                           apart from the broker); unset, the broker's Redis

Every variant runs the same body: one ``INCR`` of the run's counter.  The benchmark
sets the counter to ``DONE_AT - n`` before sending ``n`` tasks, so the task whose
``INCR`` reaches :data:`DONE_AT` is the last one to finish, and it pushes a marker
that the benchmark waits for with ``BLPOP`` (no polling).  No results are stored.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_dlock import LockedTask

URL = os.environ.get("DLOCK_E2E_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("DLOCK_E2E_PREFIX", "dlock-e2e")
QUEUE = f"{PREFIX}:queue"
COUNTER = f"{PREFIX}:done"
MARKER = f"{PREFIX}:last"
DONE_AT = 1 << 40
LOCK_URL = os.environ.get("DLOCK_E2E_LOCK_URL")
PEER_LOCK_URL = os.environ.get("DLOCK_E2E_PEER_LOCK_URL") or URL

app = Celery("e2e_app", broker=URL, set_as_current=False)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_prefetch_multiplier=64,
    worker_hijack_root_logger=False,
    broker_transport_options={"polling_interval": 0.1},
    dlock_key_prefix=f"{PREFIX}:dlock",
    singleton_backend_url=PEER_LOCK_URL,
    singleton_key_prefix=f"{PREFIX}:singleton:",
    ONCE={"backend": "celery_once.backends.Redis",
          "settings": {"url": PEER_LOCK_URL, "default_timeout": 60}},
)
if LOCK_URL:
    app.conf.dlock_url = LOCK_URL

# redis-py rebuilds a client's connections in a forked child, so one client serves
# the main process and every prefork child.
_counter = redis.Redis.from_url(URL)


def _done() -> None:
    if _counter.incr(COUNTER) == DONE_AT:
        _counter.rpush(MARKER, b"1")


@app.task(name="e2e.plain", ignore_result=True)
def plain(n: int) -> None:
    _done()


@app.task(name="e2e.locked", base=LockedTask, ignore_result=True)
def locked(n: int) -> None:
    _done()


@app.task(name="e2e.locked_template", base=LockedTask, lock_key="e2e:{n}",
          ignore_result=True)
def locked_template(n: int) -> None:
    _done()


@app.task(name="e2e.once", base=QueueOnce, ignore_result=True)
def once(n: int) -> None:
    _done()


@app.task(name="e2e.singleton", base=Singleton, ignore_result=True)
def singleton(n: int) -> None:
    _done()


#: variant label -> task, in table order (plain first: the baseline).
VARIANTS = {
    "plain task": plain,
    "LockedTask (hashed args)": locked,
    "LockedTask (template key)": locked_template,
    "celery-once QueueOnce": once,
    "celery-singleton Singleton": singleton,
}


def _locked_variant(name: str, **options: Any) -> Any:
    """A ``LockedTask`` (hashed arguments) declared with ``options``, the same body."""

    def body(n: int) -> None:
        _done()

    return app.task(name=f"e2e.{name}", base=LockedTask, ignore_result=True,
                    **options)(body)


#: ``bench_commands.py`` (which sets ``DLOCK_E2E_MODES``): a ``LockedTask`` per
#: ``lock_mode`` (the throttle's window is ``lock_ttl``, 30 s by default), and a
#: semaphore of two slots.  Declared only then: a lock store without markers or
#: semaphores (``bench_backends.py``'s PostgreSQL, MySQL, ZooKeeper) refuses them.
MODE_VARIANTS = {
    **{f"LockedTask {mode}": _locked_variant(f"mode_{mode}", lock_mode=mode)
       for mode in ("while_running", "until_started", "until_finished",
                    "queued_and_running", "throttle")},
    "LockedTask while_running, lock_limit=2": _locked_variant(
        "mode_while_running_limit2", lock_mode="while_running", lock_limit=2),
} if os.environ.get("DLOCK_E2E_MODES") else {}
