"""The per-process watchdog and renewal scheduler ("scheduler") and its registry of holds.

Backend-neutral: a hold is renewed through a :class:`RenewTarget` that the backend
supplies (for Redis, one per server: :mod:`celery_dlock.backends.redis.renewal`).

**Deadlines.**  Every hold, renewed or not, has a *local deadline*
(:mod:`celery_dlock.core.deadline`).  The watchdog thread wakes at the earliest deadline
and declares a hold lost there if no renewal has been confirmed meanwhile, *whatever any
Redis call is doing*: a renewal that hangs behind a partition does not delay the news.

**Renewal.**  Every ``ttl/3`` a hold falls due; the watchdog hands all holds of one
target that are due within half an interval to that target's own *renewer* thread, as
one batch (one script call per server; on a cluster, one target and one pipeline per
master).  Each target has its own renewer (and, for Redis, its own connection), so a
stalled or starved server never delays the renewal of another.

Rules that keep renewal from ever outliving its holder:

* the registry keeps a *weak* reference to each lock object: a lock that was dropped
  without release stops being renewed and expires by itself;
* each hold has an id; a report about an old hold never touches a newer one;
* a hold is registered inside ``acquire``; while its final release runs, renewal
  results for it are ignored; it is unregistered once the release is confirmed;
* renewal never re-creates a key: a lock found gone or held by another owner is reported
  lost (``on_lost``) and dropped from the registry;
* failed renewals are retried every :data:`ERROR_RETRY_INTERVAL` until the deadline;
* a hold with a *bound* (``max_hold``: :mod:`celery_dlock.core.max_hold`) is never
  renewed past it: the last renewal asks only for the time left, and the hold's
  deadline then falls a margin before the bound, where it is reported lost with the
  reason "max hold ... reached";
* after ``fork()`` the child starts with an empty registry and no threads (see
  :func:`get_scheduler`), so a child never renews its parent's locks.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .deadline import clock as _default_clock
from .deadline import lease_end
from .max_hold import capped_ms, reached_reason
from .process import after_fork
from .renew_target import LossNote, RenewTarget

__all__ = [
    "ERROR_RETRY_INTERVAL",
    "RenewalScheduler",
    "get_scheduler",
]

logger = logging.getLogger("celery_dlock.scheduler")

#: After a failed renewal, try again this often (seconds) until the hold's deadline.
ERROR_RETRY_INTERVAL = 0.25
#: With nothing registered the watchdog still looks again this often (seconds).
IDLE_WAIT = 1.0
#: A renewer thread with nothing to do for this long ends (a new one starts on demand).
RENEWER_IDLE = 30.0
class _Hold(Protocol):
    @property
    def name(self) -> str: ...

    def _mark_lost(self, reason: str, hold_id: int) -> bool: ...


@dataclass(eq=False)
class _Entry:
    ref: weakref.ReferenceType[Any]
    lock_id: int
    hold_id: int
    target: RenewTarget | None
    key: str
    owner: str
    ttl_ms: int
    deadline: float
    next_due: float
    in_flight: bool = False
    releasing: bool = False
    fence: int | None = None
    #: Seconds each deadline keeps back from the ttl (drift and pause budget).
    margin: float | None = None
    #: When the hold was taken (the send time of its acquire, scheduler clock).
    started: float = 0.0
    #: The hold may not outlive this moment (scheduler clock; None: unbounded) ...
    bound: float | None = None
    #: ... and a confirmed renewal (or extend) already reached it: no more renewals.
    at_bound: bool = False

    @property
    def interval(self) -> float:
        return self.ttl_ms / 3000.0

    def renewable(self) -> bool:
        return (self.target is not None and not self.in_flight and not self.releasing
                and not self.at_bound)

    def send_ms(self, sent_at: float) -> int:
        """The ttl a renewal sent at ``sent_at`` asks for: the hold's, or only the time
        left to its bound (0: the bound is reached)."""
        return capped_ms(self.ttl_ms, self.bound, sent_at)

    def loss_reason(self) -> str:
        """Why a hold whose deadline passed is lost."""
        if self.at_bound and self.bound is not None:
            return reached_reason(self.bound - self.started)
        return "no renewal was confirmed before its deadline"

    def first_look(self) -> float:
        """When the watchdog must next look at this hold: its deadline, or when its
        renewal falls due (half an interval early, as :meth:`RenewalScheduler._scan`
        takes it)."""
        if self.target is None:
            return self.deadline
        return min(self.deadline, self.next_due - self.interval / 2)


class _Renewer:
    """The thread that renews the holds of one target, one batch at a time."""

    def __init__(self, scheduler: RenewalScheduler, target: RenewTarget) -> None:
        self.scheduler = scheduler
        self.target = target
        self.batches: collections.deque[list[_Entry]] = collections.deque()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name="celery-dlock-renewer")

    def _run(self) -> None:
        hb = self.scheduler
        while True:
            with hb._cond:
                idle_until = time.monotonic() + RENEWER_IDLE
                while not self.batches and not hb._stopping:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        break
                    hb._cond.wait(left)
                if hb._stopping or not self.batches:
                    if hb._renewers.get(id(self.target)) is self:
                        del hb._renewers[id(self.target)]
                    for batch in self.batches:
                        for e in batch:
                            e.in_flight = False
                    return
                batch = self.batches.popleft()
            hb._renew_batch(self.target, batch)


class RenewalScheduler:
    """Registry of holds plus the watchdog and renewer threads.

    ``clock`` is injectable for tests; with ``start_thread=False`` nothing runs by itself
    and :meth:`renew_due` does one pass (deadlines and renewals) inline, at a given time.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = _default_clock,
        start_thread: bool = True,
    ) -> None:
        self._clock = clock
        self._start_thread = start_thread
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[int, _Entry] = {}
        self._renewers: dict[int, _Renewer] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dirty = False
        #: When the waiting watchdog looks again by itself (None: it is not waiting).
        self._wake_at: float | None = None
        self.renewal_calls = 0  # renewal calls made, for tests and benchmarks

    def now(self) -> float:
        """This scheduler's clock: send times given to it must come from here."""
        return self._clock()

    # -- registry -----------------------------------------------------------------

    def register(self, lock: _Hold, hold_id: int, target: RenewTarget | None, key: str,
                 owner: str, ttl_ms: int, sent_at: float, *,
                 fence: int | None = None, margin: float | None = None,
                 bound: float | None = None) -> None:
        """Watch a hold confirmed by a request sent at ``sent_at`` (and renew it
        through ``target`` unless that is None); ``fence`` picks the :class:`LossNote`
        that applies to it; each of its deadlines keeps ``margin`` seconds back from
        the ttl (default: :func:`~celery_dlock.core.deadline.margin_of` the ttl);
        ``bound``: renewals never take it past that moment (its max hold)."""
        entry = _Entry(ref=weakref.ref(lock), lock_id=id(lock), hold_id=hold_id,
                       target=target, key=key, owner=owner, ttl_ms=ttl_ms,
                       deadline=0.0, next_due=0.0,
                       fence=fence, margin=margin, started=sent_at, bound=bound)
        # A bound closer than the ttl (a max hold shorter than it) cut the grant.
        entry.deadline = lease_end(sent_at, entry.send_ms(sent_at), margin)
        entry.at_bound = bound is not None and entry.send_ms(sent_at) < ttl_ms
        entry.next_due = sent_at + entry.interval
        with self._cond:
            self._entries[id(lock)] = entry
            if self._start_thread and self._thread is None:
                self._start()
            self._poke(entry.first_look())

    def _entry(self, lock: object, hold_id: int | None) -> _Entry | None:
        entry = self._entries.get(id(lock))
        if entry is None or (hold_id is not None and entry.hold_id != hold_id):
            return None
        return entry

    def unregister(self, lock: object, hold_id: int | None = None) -> None:
        with self._cond:
            if self._entry(lock, hold_id) is not None:
                del self._entries[id(lock)]

    def confirmed(self, lock: object, hold_id: int, ttl_ms: int, sent_at: float,
                  margin: float | None = None, sent_ms: int | None = None) -> None:
        """An extend sent at ``sent_at`` was confirmed: renew with ``ttl_ms`` (and its
        ``margin``) from now on and move the deadline (never earlier); ``sent_ms``:
        the ttl the extend asked for when its bound cut it shorter."""
        with self._cond:
            entry = self._entry(lock, hold_id)
            if entry is not None:
                entry.ttl_ms = ttl_ms
                entry.margin = margin
                if sent_ms is not None and sent_ms < ttl_ms:
                    entry.at_bound = True
                lease = ttl_ms if sent_ms is None else sent_ms
                entry.deadline = max(entry.deadline,
                                     lease_end(sent_at, lease, margin))
                entry.next_due = sent_at + entry.interval
                self._poke(entry.first_look())

    def set_releasing(self, lock: object, hold_id: int, releasing: bool) -> None:
        """While the final release runs, renewal results for the hold are ignored."""
        with self._cond:
            entry = self._entry(lock, hold_id)
            if entry is not None:
                entry.releasing = releasing
                if not releasing:  # renewable again (a final release failed)
                    self._poke()

    def held_locks(self) -> list[Any]:
        """The live lock objects whose holds are registered."""
        with self._cond:
            refs = [e.ref() for e in self._entries.values()]
        return [lock for lock in refs if lock is not None]

    def is_registered(self, lock: object) -> bool:
        with self._cond:
            return id(lock) in self._entries

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    # -- one pass -----------------------------------------------------------------

    def _poke(self, at: float | None = None) -> None:
        """(under the condition) Make the watchdog look again now; with ``at``, only
        if it would otherwise look later than ``at`` (a hold registered on the hot path
        then wakes no thread: the watchdog is due to look before the hold needs it)."""
        self._dirty = True
        if at is None or self._wake_at is None or at < self._wake_at:
            self._cond.notify_all()

    def _scan(self, now: float) -> tuple[list[tuple[_Entry, str]],
                                         dict[int, list[_Entry]], float]:
        """(under the condition) Pop the holds past their deadline, take the batches
        due, and say when to look again."""
        lost: list[tuple[_Entry, str]] = []
        batches: dict[int, list[_Entry]] = {}
        wake = math.inf
        for lock_id, e in list(self._entries.items()):
            if e.ref() is None:
                del self._entries[lock_id]
            elif e.deadline <= now:
                del self._entries[lock_id]
                lost.append((e, e.loss_reason()))
            else:
                wake = min(wake, e.deadline)
                if e.renewable():
                    if e.next_due <= now + e.interval / 2:
                        e.in_flight = True
                        batches.setdefault(id(e.target), []).append(e)
                    else:
                        wake = min(wake, e.next_due)
        return lost, batches, wake

    def renew_due(self, now: float | None = None) -> float | None:
        """One pass at ``now``, inline: declare holds past their deadline lost and renew
        every hold due (within half its interval).  Returns when the next renewable
        hold falls due, or ``None`` when nothing renewable is registered."""
        if now is None:
            now = self._clock()
        with self._cond:
            lost, batches, _ = self._scan(now)
        self._report_lost(lost)
        for entries in batches.values():
            target = entries[0].target
            assert target is not None
            self._renew_batch(target, entries, now)
        with self._cond:
            dues = [e.next_due for e in self._entries.values() if e.target is not None]
        return min(dues) if dues else None

    def _renew_batch(self, target: RenewTarget, entries: list[_Entry],
                     now: float | None = None) -> None:
        # One call for the batch; one item per (key, owner) even when several lock
        # objects of one owner re-entered the same lock (the longest ttl wins).
        # A hold with a bound asks only for the time left to it.
        sent_at = self._clock() if now is None else now
        unique: dict[tuple[str, str], int] = {}
        sent: dict[int, int] = {}
        for e in entries:
            pair = (e.key, e.owner)
            sent[e.lock_id] = e.send_ms(sent_at)
            unique[pair] = max(unique.get(pair, 0), sent[e.lock_id])
        items = [(key, owner, ttl) for (key, owner), ttl in unique.items() if ttl > 0]
        if not items:  # every hold of the batch is at its bound
            with self._cond:
                for e in entries:
                    e.in_flight = False
                    e.at_bound = True
                self._poke()
            return
        self.renewal_calls += 1
        try:
            replies = list(target.renew(items))
        except Exception as exc:
            self._renewal_failed(entries, exc, None if now is None else now)
            return
        status = dict(zip([(k, o) for k, o, _ in items], replies, strict=True))
        lost: list[tuple[_Entry, str]] = []
        with self._cond:
            for e in entries:
                e.in_flight = False
                if self._entries.get(e.lock_id) is not e:
                    continue  # released (or lost) while the call was in flight
                if sent[e.lock_id] <= 0:
                    e.at_bound = True
                    continue
                answer = status[(e.key, e.owner)]
                code = answer.code if isinstance(answer, LossNote) else int(answer)
                if code == 1:
                    lease = sent[e.lock_id]
                    e.deadline = max(e.deadline, lease_end(sent_at, lease, e.margin))
                    e.next_due = sent_at + e.interval
                    e.at_bound = e.at_bound or lease < e.ttl_ms
                elif not e.releasing:
                    del self._entries[e.lock_id]
                    reason = ("expired before it was renewed" if code == 0
                              else "taken by another owner")
                    if isinstance(answer, LossNote) and answer.fence == e.fence:
                        reason = answer.reason
                    lost.append((e, reason))
            self._poke()
        self._report_lost(lost)

    def _renewal_failed(self, entries: Sequence[_Entry], exc: Exception,
                        now: float | None) -> None:
        if now is None:
            now = self._clock()
        with self._cond:
            for e in entries:
                e.in_flight = False
                e.next_due = now + min(ERROR_RETRY_INTERVAL, e.interval)
            self._poke()
        logger.warning("lock renewal failed (%s); retrying until each hold's deadline",
                       exc)

    def _report_lost(self, lost: list[tuple[_Entry, str]]) -> None:
        # Mark first (the holder's checks answer at once), log afterwards: a slow log
        # handler must not delay the news.
        told = []
        for entry, reason in lost:
            lock = entry.ref()
            if lock is None:
                continue
            try:
                if lock._mark_lost(reason, entry.hold_id):
                    told.append((lock.name, lock.on_lost is None, reason))
            except Exception:  # a callback must never kill the watchdog
                logger.exception("on_lost callback for %r failed", lock.name)
        for name, untold, reason in told:
            # One line per lost hold, naming the lock: an on_lost callback is how its
            # owner is told (a LockedTask logs it with the task), so this one is DEBUG.
            logger.log(logging.WARNING if untold else logging.DEBUG, "lock %r lost: %s",
                       name, reason)

    # -- threads ------------------------------------------------------------------

    def _start(self) -> None:
        self._stopping = False
        thread = threading.Thread(target=self._run, name="celery-dlock-watchdog",
                                  daemon=True)
        self._thread = thread
        thread.start()

    def _run(self) -> None:
        logger.debug("scheduler thread started in pid %s", os.getpid())
        while True:
            try:
                with self._cond:
                    if self._stopping:
                        return
                    self._dirty = False
                    lost, batches, wake = self._scan(self._clock())
                    for key, entries in batches.items():
                        renewer = self._renewers.get(key)
                        if renewer is None:
                            target = entries[0].target
                            assert target is not None
                            renewer = self._renewers[key] = _Renewer(self, target)
                            renewer.thread.start()
                        renewer.batches.append(entries)
                    if batches:
                        self._cond.notify_all()
                self._report_lost(lost)
                with self._cond:
                    if not self._dirty and not self._stopping:
                        # At most IDLE_WAIT: a wait counts no suspended time, the
                        # clock does, so a resumed process looks again soon.
                        now = self._clock()
                        timeout = min(IDLE_WAIT, max(0.0, wake - now))
                        self._wake_at = now + timeout
                        try:
                            self._cond.wait(timeout)
                        finally:
                            self._wake_at = None
            except Exception:  # never let the watchdog die
                logger.exception("scheduler pass failed")
                time.sleep(ERROR_RETRY_INTERVAL)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the threads (registrations are kept; a later register restarts it)."""
        with self._cond:
            self._stopping = True
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


_process_scheduler: RenewalScheduler | None = None
_process_scheduler_lock = threading.Lock()


def get_scheduler() -> RenewalScheduler:
    """This process's scheduler, created on first use (and anew after a fork)."""
    global _process_scheduler
    hb = _process_scheduler
    if hb is None:
        with _process_scheduler_lock:
            hb = _process_scheduler
            if hb is None:
                hb = _process_scheduler = RenewalScheduler()
    return hb


def _after_fork_in_child() -> None:
    global _process_scheduler, _process_scheduler_lock
    # The parent's threads do not exist here and its lock may have been held at the
    # moment of the fork: start from nothing.
    _process_scheduler = None
    _process_scheduler_lock = threading.Lock()


after_fork(_after_fork_in_child)
