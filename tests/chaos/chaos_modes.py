"""The tasks of the modes scenario (docs/chaos.md, "The modes scenario"), registered on
the chaos app (:mod:`chaos_app`, whose ``celery worker`` processes run them) and on the
producer's app (which needs them to name the lock and claim the queue marker).

* ``chaos.mode``: a :class:`~celery_dlock.LockedTask` on ``mode:{key}``; its
  ``lock_mode`` and ``on_duplicate`` come per call (each key of :data:`MARKER_KEYS` has
  one pair).  The body sleeps ``seconds`` in short steps (``lock_lost_action=
  "interrupt"``: a holder told of its loss stops there), and calls ``self.retry()``
  while ``retries < retry``.  ``payload`` is never read: a value the serializer
  refuses there makes the publish fail.
* ``chaos.rated``: ``lock_rate`` :data:`RATE` (burst :data:`RATE_BURST`) on
  ``rated:{key}``, waiting for its lock (``on_contention="wait"``), registered only
  when the lock's server keeps rates (Redis).

Each body records ``body_start`` and ``body_end`` (with its outcome) in its process's
records file, and each worker process records the messages it discards as revoked.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery, signals

from celery_dlock import LockedTask

#: The lock servers whose runs send every mode (they keep queue markers) and rated
#: calls (they keep rates).
MARKER_STORES = ("redis", "postgresql", "zookeeper")
#: (key, lock_mode, on_duplicate) of the calls of ``chaos.mode`` on a store with queue
#: markers (:data:`MARKER_STORES`): every mode with markers, every duplicate policy.
MARKER_KEYS: tuple[tuple[str, str, str], ...] = (
    ("uf-existing", "until_finished", "return_existing"),
    ("uf-raise", "until_finished", "raise"),
    ("uf-drop", "until_finished", "drop"),
    ("uf-replace", "until_finished", "replace"),
    ("us-replace", "until_started", "replace"),
    ("us-drop", "until_started", "drop"),
    ("qr-replace", "queued_and_running", "replace"),
    ("qr-raise", "queued_and_running", "raise"),
    ("th-drop", "throttle", "drop"),
    ("th-existing", "throttle", "return_existing"),
)
#: On a store without markers: the runtime lock alone.
PLAIN_KEYS: tuple[tuple[str, str, str], ...] = tuple(
    (f"wr-{c}", "while_running", "return_existing") for c in "abcdef")
#: ``chaos.rated``'s rate and burst: at most RATE_N + RATE_BURST body starts in any
#: window of RATE_PERIOD seconds.
RATE, RATE_N, RATE_PERIOD, RATE_BURST = "2/s", 2, 1.0, 1

Recorder = Callable[..., None]


def keys_for(lock: str) -> tuple[tuple[str, str, str], ...]:
    """The (key, mode, policy) table a run on this lock server sends."""
    return MARKER_KEYS if lock in MARKER_STORES else PLAIN_KEYS


def rated(lock: str) -> bool:
    """Whether a run on this lock server sends ``chaos.rated`` calls."""
    return lock in MARKER_STORES


def register(app: Celery, record: Callable[[], Recorder] | None, *, ttl: float,
             rates: bool) -> None:
    """Declare the scenario's tasks on ``app``; ``record()`` gives the process's
    recorder (None on the producer's app: it runs no body)."""

    def rec(ev: str, **fields: Any) -> None:
        if record is not None:
            record()(ev, **fields)

    @app.task(name="chaos.mode", base=LockedTask, bind=True, lock_key="mode:{key}",
              lock_ttl=ttl, on_contention="retry", lock_lost_action="interrupt",
              shared=False)
    def mode(self: Any, key: str, seconds: float, retry: int = 0,
             payload: Any = None) -> str:
        task_id = self.request.id
        rec("body_start", task_id=task_id, key=key, name=self.lock.name,
            retries=self.request.retries)
        outcome = "ok"
        try:
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                time.sleep(0.02)
            if self.request.retries < retry:
                outcome = "retry"
        except BaseException as exc:
            outcome = f"error:{type(exc).__name__}"
            raise
        finally:
            rec("body_end", task_id=task_id, key=key, outcome=outcome)
        if outcome == "retry":
            raise self.retry(countdown=0.3, max_retries=retry)
        return key

    if rates:
        @app.task(name="chaos.rated", base=LockedTask, bind=True,
                  lock_key="rated:{key}", lock_ttl=ttl, on_contention="wait",
                  lock_wait=20, lock_rate=RATE, lock_rate_burst=RATE_BURST,
                  lock_lost_action="interrupt", shared=False)
        def rated(self: Any, key: str, seconds: float) -> str:
            task_id = self.request.id
            rec("body_start", task_id=task_id, key=key, name=self.lock.name,
                retries=self.request.retries)
            outcome = "ok"
            try:
                time.sleep(seconds)
            except BaseException as exc:
                outcome = f"error:{type(exc).__name__}"
                raise
            finally:
                rec("body_end", task_id=task_id, key=key, outcome=outcome)
            return key

    if record is not None:
        def _revoked(request: Any = None, expired: bool = False, **_: Any) -> None:
            rec("revoked", task_id=getattr(request, "id", None), expired=expired,
                worker_pid=os.getpid())

        signals.task_revoked.connect(_revoked, weak=False)
