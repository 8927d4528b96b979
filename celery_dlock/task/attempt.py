"""One execution attempt of a :class:`~celery_dlock.LockedTask`, and how two attempts
of the same task id relate.

A task id is shared on purpose by a task's retries (``self.retry()``,
``autoretry_for``, contention retries) and by its replacement (``self.replace()``); by
accident by a broker redelivery of a message whose first run is still alive.  Each
hold stores which *generation* of its task id took it: ``(replaced, retries)``, Celery's
``replaced_task_nesting`` and ``retries``.  An attempt that finds its own task id
holding the lock compares generations::

    t0  attempt T (gen 0,0) holds stock:42; its body calls self.retry(countdown=0)
    t1  the retry T (gen 0,1) arrives while T's finally block still runs:
        holder gen (0,0) < (0,1): its PREDECESSOR -> wait for the release, whatever
        the contention policy; no contention retry is counted
    t2  the broker redelivers T (gen 0,0) (acks_late, visibility timeout):
        holder gen (0,1) >= (0,0): a DUPLICATE -> it re-queues itself silently (a
        copy with a backoff) and ends with Ignore: no body, no state, no result
    t3  T (gen 0,1) ends: its result is the task's result
    t4  the copy runs: the task id has a result (or a retry) -> it ends, silently.
        Had T died instead (no result, lock freed or expired), the copy runs the
        body: the redelivery recovers the task, as it should.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, NoReturn

from celery import states
from celery.exceptions import Ignore

from ..core.errors import Holder, LockLost
from ..core.protocol import Lock
from .contention import backoff_delay

__all__ = [
    "DUPLICATE",
    "DUPLICATE_GRACE",
    "DUPLICATE_HEADER",
    "PREDECESSOR",
    "Attempt",
    "LockLostInterrupt",
    "attempts",
    "first_run_ended",
    "header",
    "hold_info",
    "interrupt_thread",
    "interrupts_deferred",
    "relation",
    "requeue_duplicate",
]

logger = logging.getLogger("celery_dlock.task")

#: The holder is an earlier generation of this task id (a retry's or a replacement's
#: predecessor still unwinding): wait for it.
PREDECESSOR = "predecessor"
#: The holder is this very generation (or a later one): this delivery is a duplicate.
DUPLICATE = "duplicate"

#: Message header counting how often a duplicate delivery re-queued itself.
DUPLICATE_HEADER = "dlock_duplicate"
#: Seconds a re-queued duplicate that finds the lock free waits for the first run's
#: result to appear (it is stored just after the first run releases the lock) before
#: it concludes that the first run died and runs the body itself.
DUPLICATE_GRACE = 1.0
#: States of a task id whose first run has ended (or handed over to its retry).
_ENDED = states.READY_STATES | {states.RETRY}


class LockLostInterrupt(LockLost):
    """Raised inside a running task whose lock was lost.

    Only with ``lock_lost_action="interrupt"``.
    """

    def __init__(self, message: str = "the task's lock was lost while it ran",
                 *, lock_name: str | None = None) -> None:
        super().__init__(message, lock_name=lock_name)


def interrupt_thread(thread_id: int) -> bool:
    """Raise :class:`LockLostInterrupt` in another thread at its next instruction."""
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(LockLostInterrupt))
    return bool(done == 1)


class Attempt:
    """The lock of one running attempt, as the task body sees it (``self.lock``)."""

    __slots__ = ("_asked", "_gate", "_told", "fence", "key", "lock", "lost_reason",
                 "running", "started", "task_id", "thread_id")

    def __init__(self, lock: Lock, thread_id: int, task_id: str | None) -> None:
        self.task_id = task_id
        self.lock = lock
        self.key = lock.name
        self.fence = lock.fence if lock.fences else None  # Redlock gives none
        self.started = time.monotonic()
        self.thread_id = thread_id
        self.running = True
        #: Set (from the scheduler thread) when the hold is found lost.
        self.lost_reason: str | None = None
        self._told = threading.Lock()
        #: Held while an interrupt is decided and while ``running`` changes, so that
        #: none is sent once the body stopped being interruptible.
        self._gate = threading.Lock()
        #: An interrupt was asked for while the body could not take one.
        self._asked = False

    def interrupt(self) -> bool:
        """Raise :class:`LockLostInterrupt` in the body's thread, if it still runs
        and may be interrupted (False otherwise: :meth:`deferred` raises it later)."""
        with self._gate:
            if self.running:
                return interrupt_thread(self.thread_id)
            self._asked = True
            return False

    def stop(self) -> None:
        """The body has ended: no interrupt is sent from here on."""
        with self._gate:
            self.running = False

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """An interrupt asked for inside the block waits for its end, and is raised
        there when the block ends normally (one that raises is the body's to handle;
        the loss was reported).  A send of a call with a ``lock_mode`` runs in one: an
        interrupt between its marker's claim and its publish would leave the marker
        behind with nothing published, the name taken for the marker's ttl by a call
        that never runs."""
        with self._gate:
            was, self.running = self.running, False
            outer, self._asked = self._asked, False
        try:
            yield
        finally:
            with self._gate:
                self.running = was
                asked, self._asked = self._asked, outer
        if asked and was:
            raise LockLostInterrupt(lock_name=self.key)

    @contextmanager
    def uninterrupted(self) -> Iterator[None]:
        """No interrupt is sent inside the block (one sent before it is raised on
        entry, at the body's next instruction), nor after it when it raises: the body
        is ending with that exception.  ``self.retry()`` publishes its retry in one:
        an interrupt raised inside that publish would make Celery reject the message
        (``Reject(requeue=False)``), and the call would be lost untold."""
        with self._gate:
            was, self.running = self.running, False
        yield
        with self._gate:
            self.running = was

    def found_lost(self, reason: str) -> bool:
        """Record that the hold was lost; True for the first finder only (the
        watchdog's ``on_lost``, or the release that found it first), which tells."""
        with self._told:
            if self.lost_reason is not None:
                return False
            self.lost_reason = reason
            return True


#: The runs in progress in this context, by task name.
_NO_ATTEMPTS: Mapping[str, Attempt] = MappingProxyType({})
attempts: ContextVar[Mapping[str, Attempt]] = ContextVar("celery_dlock_attempts",
                                                         default=_NO_ATTEMPTS)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """:meth:`Attempt.deferred` for every body running in this thread."""
    here = threading.get_ident()
    with ExitStack() as stack:
        for attempt in attempts.get().values():
            if attempt.thread_id == here:
                stack.enter_context(attempt.deferred())
        yield


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def generation(request: Any) -> tuple[int, int]:
    """``(replaced_task_nesting, retries)`` of a task request."""
    return (_int(getattr(request, "replaced_task_nesting", 0)),
            _int(getattr(request, "retries", 0)))


def hold_info(task_name: str, request: Any) -> dict[str, object]:
    """The metadata a task attempt stores with its hold."""
    replaced, retries = generation(request)
    return {
        "task_id": request.id,
        "task_name": task_name,
        "worker": request.hostname,
        "retries": retries,
        "replaced": replaced,
    }


def relation(holder: Holder | None, request: Any) -> str | None:
    """:data:`PREDECESSOR`, :data:`DUPLICATE`, or None when the holder is not an
    attempt of this request's task id."""
    if holder is None or not request.id or holder.task_id != request.id:
        return None
    theirs = (_int(holder.info.get("replaced")), _int(holder.info.get("retries")))
    return PREDECESSOR if theirs < generation(request) else DUPLICATE


def header(request: Any, name: str) -> int:
    """A counter carried in a message header (0 when absent)."""
    raw = getattr(request, name, None)
    if raw is None:
        raw = (request.headers or {}).get(name, 0)
    return _int(raw)


def first_run_ended(task: Any, task_id: str, grace: float = 0.0) -> bool:
    """Whether the result store shows ``task_id`` finished (or retried), waiting up
    to ``grace`` seconds for it.  False when it cannot tell (no result backend)."""
    deadline = time.monotonic() + grace
    while True:
        try:
            state = task.backend.get_task_meta(task_id, cache=False)["status"]
        except Exception:
            return False
        if state in _ENDED:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def requeue_duplicate(task: Any, lock: Lock, request: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any], settings: Mapping[str, Any]) -> NoReturn:
    """End a duplicate delivery without a trace (``Ignore``), after re-queueing a copy
    that looks again later: it recovers the task if the first run dies."""
    count = header(request, DUPLICATE_HEADER)
    countdown = backoff_delay(count, float(settings["lock_retry_backoff"]),
                              float(settings["lock_retry_backoff_max"]))
    headers = {**(request.headers or {}), DUPLICATE_HEADER: count + 1}
    task.signature_from_request(request, args, kwargs, countdown=countdown,
                                retries=request.retries, headers=headers).apply_async()
    holder = lock.last_holder
    logger.warning(
        "Task %s[%s]: duplicate delivery while its first run (%s) holds lock %r: "
        "ignored (looks again in %.2fs in case that run dies)", task.name, request.id,
        holder.describe() if holder is not None else "?", lock.name, countdown)
    raise Ignore(f"duplicate delivery of {request.id}: its first run holds lock "
                 f"{lock.name!r}")
