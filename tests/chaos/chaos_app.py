"""The Celery app the chaos run's ``celery worker`` subprocesses run (prefork pool).

Built from the environment the driver sets (see :data:`ENV`).  The lock scenario's
task is ``chaos.bump`` (the modes scenario's are in :mod:`chaos_modes`): a
:class:`~celery_dlock.LockedTask` on the lock ``chaos:{key}`` that makes a few fenced
increments (:mod:`chaos_db`) with a pause between them.  The lock's traffic (Redis,
PostgreSQL or ZooKeeper: ``dlock_url``) goes through the driver's fault proxy; the
broker (Redis, the lock's own server or another; or RabbitMQ) is reached directly.

Every process records, in its own file (:mod:`chaos_records`): each task it starts and
ends (for the broker-level accounting), each hold (``acquired`` with the fence and the
process's acquisition number, ``lost`` when told, ``released``) and each write with its
fence and whether the database took it.  A hold is named by (pid, acquisition number),
never by its fence: the checker must catch a lock that hands one fence to two holds.
``lock_lost_action="warn"``: a holder told of its loss keeps writing, as a careless body
would; the database has to refuse it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import chaos_db
import chaos_modes
from celery import Celery, signals
from chaos_records import Recorder

from celery_dlock import LockedTask
from celery_dlock import signals as dlock_signals

ENV = ("CHAOS_BROKER_URL", "CHAOS_BROKER", "CHAOS_LOCK_URL", "CHAOS_PREFIX",
       "CHAOS_QUEUE", "CHAOS_DB", "CHAOS_DSN", "CHAOS_RECORDS", "CHAOS_TTL",
       "CHAOS_VISIBILITY")

_per_pid: dict[int, tuple[Recorder, Any]] = {}


def _env(name: str) -> str:
    return os.environ[name]


#: Per process: the number of its latest acquisition (a hold is (pid, acquisition),
#: never its fence, so that a checker can catch a lock that repeats fences).
_acquisition: dict[int, int] = {}


def here() -> tuple[Recorder, Any]:
    """This process's recorder and database connection (new ones after a fork)."""
    pid = os.getpid()
    found = _per_pid.get(pid)
    if found is None:
        rec = Recorder(Path(_env("CHAOS_RECORDS")) / f"worker-{pid}.jsonl")
        conn = chaos_db.connect(_env("CHAOS_DB"), _env("CHAOS_DSN"))
        found = _per_pid[pid] = (rec, conn)
    return found


app = Celery("chaos_app", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("CHAOS_BROKER_URL", "redis://127.0.0.1:1/0"),
    dlock_url=os.environ.get("CHAOS_LOCK_URL", "redis://127.0.0.1:1/0"),
    dlock_key_prefix=os.environ.get("CHAOS_PREFIX", "chaos"),
    task_default_queue=os.environ.get("CHAOS_QUEUE", "chaos"),
    task_ignore_result=True,
    # The settings that narrow the broker's loss window (docs/chaos.md): the message is
    # acknowledged after the task, a task whose child died is requeued, and (Redis) a
    # message a dead consumer took comes back after visibility_timeout, or (AMQP) a
    # publish counts once the broker confirmed it.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    broker_transport_options=(
        {"confirm_publish": True} if os.environ.get("CHAOS_BROKER") == "amqp"
        else {"polling_interval": 0.1,
              "visibility_timeout": float(os.environ.get("CHAOS_VISIBILITY", "30"))}),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    dlock_retry_backoff=0.05,
    dlock_retry_backoff_max=0.5,
    dlock_retry_max=10_000,
    worker_hijack_root_logger=True,
)
TTL = float(os.environ.get("CHAOS_TTL", "2"))


@app.task(name="chaos.bump", base=LockedTask, bind=True, lock_key="chaos:{key}",
          lock_ttl=TTL, on_contention="wait", lock_wait=10, lock_lost_action="warn")
def bump(self: Any, key: str, writes: int, gap: float) -> int:
    rec, conn = here()
    lock = self.lock
    fence = lock.fence
    acq = _acquisition[os.getpid()] = _acquisition.get(os.getpid(), 0) + 1
    rec("acquired", who="task", name=lock.name, fence=fence, acq=acq,
        task_id=self.request.id)
    accepted = 0
    for seq in range(writes):
        out = chaos_db.increment(conn, f"task-{os.getpid()}.{acq}", seq, fence)
        rec("write", fence=fence, acq=acq, seq=seq, ok=out["ok"], t0=out["t0"],
            t=out["t"], found=out.get("found"), value=out.get("value"))
        accepted += bool(out["ok"])
        time.sleep(gap)
    # The body is done: from here on the task no longer writes (the lock is released
    # as the attempt unwinds, and "released" is recorded after that).
    rec("releasing", fence=fence, acq=acq, task_id=self.request.id)
    return accepted


@signals.task_prerun.connect(weak=False)
def _started(task_id: str = "", **_: Any) -> None:
    here()[0]("task_start", task_id=task_id)


@signals.task_postrun.connect(weak=False)
def _ended(task_id: str = "", state: str | None = None, retval: Any = None,
           **_: Any) -> None:
    # An ignored run says why (a marked call superseded at its start says by whom); a
    # rejected one too (Celery rejects a retry whose publish raised: with what).
    why = {"reason": str(retval)[:200]} if state in ("IGNORED", "REJECTED") else {}
    here()[0]("task_end", task_id=task_id, state=state, **why)


@dlock_signals.lock_lost.connect(weak=False)
def _lost(sender: Any = None, fence: int | None = None, task_id: str | None = None,
          reason: str | None = None, **_: Any) -> None:
    here()[0]("lost", fence=fence, acq=_acquisition.get(os.getpid()), task_id=task_id,
              reason=str(reason))


@dlock_signals.lock_released.connect(weak=False)
def _released(sender: Any = None, fence: int | None = None, task_id: str | None = None,
              state: str | None = None, **_: Any) -> None:
    here()[0]("released", fence=fence, acq=_acquisition.get(os.getpid()),
              task_id=task_id, state=state)


@signals.worker_process_init.connect(weak=False)
def _child_up(**_: Any) -> None:
    here()[0]("child_up")


chaos_modes.register(app, lambda: here()[0], ttl=TTL,
                     rates=app.conf.dlock_url.startswith(chaos_modes.MARKER_STORES))
