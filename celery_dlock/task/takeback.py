"""Claims taken back later: a send whose marker claim got no reply published nothing,
but the claim may have run, or may run when a stalled server resumes.  It is taken
back (the store's ``undo``, which names the claim's operation id, so a claim that runs
after it does nothing) from one thread per process, every :data:`EVERY` seconds, for
at most :data:`FOR` seconds (or the marker's ttl), until the store answers.

At most :data:`MAX_PENDING` claims wait at once (an outage with many sends): the
oldest beyond that is given up with a warning (its marker expires within its ttl).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

from ..core.errors import DLockError
from ..core.process import after_fork
from .markers import MarkerStore

__all__ = ["EVERY", "FOR", "MAX_PENDING", "take_back_later"]

logger = logging.getLogger("celery_dlock.task")

EVERY = 0.5
FOR = 30.0
MAX_PENDING = 1000


@dataclass
class _Claim:
    store: MarkerStore
    prefix: str
    name: str
    task_id: str
    op: str
    ttl: float
    deadline: float


_lock = threading.Lock()
_pending: collections.deque[_Claim] = collections.deque()
_thread: threading.Thread | None = None


def take_back_later(store: MarkerStore, prefix: str, name: str, task_id: str, op: str,
                    ttl: float) -> None:
    """Take back the claim ``op`` of ``name`` for ``task_id`` as soon as the store
    answers (see the module)."""
    global _thread
    claim = _Claim(store, prefix, name, task_id, op, ttl,
                   time.monotonic() + min(FOR, ttl))
    with _lock:
        _pending.append(claim)
        while len(_pending) > MAX_PENDING:
            _give_up(_pending.popleft(), "too many waiting")
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="dlock-marker-take-back",
                                       daemon=True)
            _thread.start()


def _give_up(claim: _Claim, why: str) -> None:
    logger.warning("Could not take back the queue marker of %r after its claim got no "
                   "reply (%s; it expires within its ttl)", claim.name, why)


def _run() -> None:
    global _thread
    while True:
        with _lock:
            if not _pending:
                _thread = None
                return
            batch = list(_pending)
            _pending.clear()
        left: list[_Claim] = []
        for claim in batch:
            try:
                claim.store.undo(claim.prefix, claim.name, claim.task_id, claim.op,
                                 claim.ttl)
            except DLockError as exc:
                if time.monotonic() + EVERY > claim.deadline:
                    _give_up(claim, str(exc))
                else:
                    left.append(claim)
        if left:
            with _lock:
                _pending.extendleft(reversed(left))
            time.sleep(EVERY)


def _after_fork_in_child() -> None:
    global _lock, _thread
    _lock = threading.Lock()
    _pending.clear()  # the parent's claims are the parent's to take back
    _thread = None


after_fork(_after_fork_in_child)
