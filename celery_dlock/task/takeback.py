"""Claims taken back later: a send whose marker claim got no reply published nothing,
but the claim may have run, or may run when a stalled server resumes.  It is taken
back (the store's ``undo``, which names the claim's operation id, so a claim that runs
after it does nothing) from one thread per process, every :data:`EVERY` seconds, for
at most :data:`FOR` seconds (or the marker's ttl), until the store answers.

At most :data:`MAX_PENDING` claims wait at once (an outage with many sends): the
oldest beyond that is given up with a warning (its marker expires within its ttl).

A send of a name from this process first takes back, at once, this process's claims
of that name still waiting (:func:`settle`), so that it is never told of a call that
was never published (a duplicate of nothing) in the moment between the store
answering again and the thread's next try.  A claim is removed from the waiting only
once taken back (or given up): the thread and a send may both run its ``undo``,
which names the claim's operation id, so the second does nothing.
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

__all__ = ["EVERY", "FOR", "MAX_PENDING", "settle", "take_back_later"]

logger = logging.getLogger("celery_dlock.task")

EVERY = 0.5
FOR = 30.0
MAX_PENDING = 1000


@dataclass(eq=False)
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


def _undo(claim: _Claim) -> bool:
    """Take ``claim`` back; False when the store did not answer."""
    try:
        claim.store.undo(claim.prefix, claim.name, claim.task_id, claim.op, claim.ttl)
    except DLockError as exc:
        if time.monotonic() + EVERY > claim.deadline:
            _give_up(claim, str(exc))
            return True
        return False
    return True


def _drop(done: list[_Claim]) -> None:
    """Remove ``done`` from the waiting (each by identity; one already removed by the
    other side, a send or the thread, is simply not there), in one pass."""
    if not done:
        return
    gone = set(done)
    with _lock:
        kept = [claim for claim in _pending if claim not in gone]
        _pending.clear()
        _pending.extend(kept)


def settle(prefix: str, name: str) -> None:
    """Take back now this process's waiting claims of ``name`` under ``prefix`` (see
    the module).  One that the store does not answer for stays waiting."""
    if not _pending:  # (no lock: the usual case costs nothing)
        return
    with _lock:  # (each with its own store: one claim's undo is harmless elsewhere)
        mine = [c for c in _pending if c.prefix == prefix and c.name == name]
    _drop([c for c in mine if _undo(c)])


def _run() -> None:
    global _thread
    while True:
        with _lock:
            if not _pending:
                _thread = None
                return
            batch = list(_pending)
        done = [claim for claim in batch if _undo(claim)]
        _drop(done)
        if len(done) < len(batch):
            time.sleep(EVERY)


def _after_fork_in_child() -> None:
    global _lock, _thread
    _lock = threading.Lock()
    _pending.clear()  # the parent's claims are the parent's to take back
    _thread = None


after_fork(_after_fork_in_child)
