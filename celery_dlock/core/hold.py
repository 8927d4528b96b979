"""The one hold state machine every lock kind runs: :class:`Hold`.

What a lock object knows without asking a server, and every rule about when it
changes: which owner holds it through this object, how many acquires are not yet
released (re-entry), the hold's id (one per fresh hold, so a late report about an older
hold never touches a newer one), its fencing token, the operation ids of a call that
failed (so that trying it again re-sends the same operation), and whether it was found
lost, why, and who was told.

The state and the reporting of a loss live in :mod:`~celery_dlock.core.hold_state`;
this module holds the calls that change them (acquire, release, extend, the checks).
A backend subclasses :class:`Hold` and says only how to talk to its servers (the
``_send_*`` methods and a few more, listed under "what a backend provides" in
:class:`~celery_dlock.core.hold_state.HoldState`); it never touches the bookkeeping.
So every kind agrees, by construction, on:

* the local view changes only after the server confirmed (a call that raised changed
  nothing here, and trying it again re-sends the same operation id, so a server that
  did apply it the first time does not apply it twice);
* a loss is reported wherever it is found, exactly once per hold: by the watchdog at
  the hold's deadline, by a renewal, or by any call of the holder (a re-entry, a
  release, an extend, ``owned``, ``ensure_held``) that finds the server no longer has
  the hold.  Reporting means: :attr:`lost` and :attr:`lost_reason` set, ``on_lost``
  called once, the hold dropped from the scheduler, the call raising
  :class:`~celery_dlock.LockLost`; depth and fence stay as they were until the holder
  releases, and no new hold is ever taken in its place behind the holder's back;
* a forked child inherits the object's memory but not its hold.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import Any, TypeVar

from .deadline import lease_end
from .errors import DLockError, LockLost, LockNotAcquired, LockNotOwned
from .hold_state import HoldState, next_hold_id
from .lock_args import DEFAULT_PREFIX, RESERVED_INFO, acquire_timeout, check_lock_options
from .lock_options import LockOptions
from .max_hold import capped_ms, reached_reason
from .protocol import GONE, OK, STILL_HELD, Grant, Refused, new_op_id
from .scheduler import RenewalScheduler
from .ttl import ttl_ms as _ttl_to_ms

__all__ = [
    "DEFAULT_PREFIX",
    "RESERVED_INFO",
    "Grant",
    "Hold",
    "Refused",
    "acquire_timeout",
    "check_lock_options",
    "new_op_id",
]

logger = logging.getLogger("celery_dlock.lock")

_Self = TypeVar("_Self", bound="Hold")
#: At most how many releases end a hold this object reported lost that the server
#: still has (one per acquire it counts).
LOST_HOLD_RELEASES = 1024


class Hold(HoldState):
    """A lock object's hold and every rule about it (see the module text), made
    with its :class:`~celery_dlock.core.lock_options.LockOptions`.  A backend
    subclasses it, provides the methods listed in
    :class:`~celery_dlock.core.hold_state.HoldState` and :meth:`_open`; its public
    constructor takes the options as keyword arguments and ``with_options`` takes
    them made already (what ``Backend.lock`` does)."""

    @classmethod
    def with_options(cls: type[_Self], where: Any, options: LockOptions) -> _Self:
        """A lock of this kind on ``where`` (its client, its clients, its server or
        URL) made with ``options``; no server call."""
        lock = cls.__new__(cls)
        lock._open(where, options)
        return lock

    def _open(self, where: Any, options: LockOptions) -> None:
        """Make this lock on ``where`` with ``options`` (the backend's part, then
        ``HoldState.__init__(self, options)``)."""
        raise NotImplementedError

    # -- acquire ------------------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None, *,
                blocking_timeout: float | None = None) -> bool:
        """Take the lock (or re-enter it); True when held.

        ``blocking=False`` tries once.  Otherwise waits, for at most ``timeout``
        seconds (``blocking_timeout`` is redis-py's name for it; neither given: the
        constructor's ``blocking_timeout``; ``None`` or ``-1`` there: no limit).

        A re-entry by the holder whose hold the server no longer has (it expired, was
        released by force, or the server lost its data) takes nothing: the loss is
        reported and :class:`LockLost` raised.  So is a re-entry of a hold already
        known to be lost.  Raises :class:`BackendUnavailable` when the servers cannot
        be reached.
        """
        timeout = acquire_timeout(blocking, timeout, blocking_timeout,
                                  self.blocking_timeout)
        owner, reentry, hold_id, lost_reason = self._caller_view()
        if lost_reason is not None:
            raise LockLost(f"cannot re-enter: lock lost ({lost_reason})",
                           lock_name=self.name)
        deadline = None if timeout is None else time.monotonic() + timeout
        scheduler = self._get_scheduler()
        if reentry:
            self._check_bound(hold_id, scheduler.now(), "cannot re-enter: lock lost: ")
        margin = self._margin(self.ttl_ms)
        op = new_op_id()
        queued = acquired = False
        try:
            while True:
                sent_at = scheduler.now()
                reply = self._send_acquire(owner, op, queue=blocking and not reentry,
                                           reentry=reentry)
                if isinstance(reply, Grant) and not reentry and reply.reentered and \
                        reply.fence is not None and \
                        self._lost_hold == (owner, reply.fence):
                    # The server still has the hold this object reported lost (its
                    # release did not get through), and this acquire re-entered it:
                    # taken as a new hold, its fence would be handed out twice.  End
                    # that hold (this acquire included), then take one of its own.
                    logger.info("lock %r: the hold reported lost (fence %s) was still "
                                "on the server; ending it before taking a new one",
                                self.name, reply.fence)
                    self._end_lost_hold(owner)
                    op = new_op_id()
                    continue
                if isinstance(reply, Grant):
                    if reply.reentered or scheduler.now() < lease_end(
                            sent_at, self.ttl_ms, margin):
                        acquired = True
                        self._acquired(owner, reply, sent_at, margin)
                        return True
                    # A fresh hold confirmed after its own deadline may be gone
                    # already: nobody can vouch for it, so give it back and go on
                    # as if it had not been granted.
                    logger.warning("lock %r was confirmed after its deadline (a slow "
                                   "link or a paused process): giving it back",
                                   self.name)
                    self._give_back(owner)
                    self.last_holder = None
                    op = new_op_id()
                    refused = Refused()
                elif isinstance(reply, Refused):
                    refused = reply
                else:
                    raise self._report_gone(reply, owner, hold_id,
                                            "cannot re-enter: lock lost: ")
                if not blocking:
                    return False
                queued = True
                left = None
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                self._wait_turn(owner, refused, left)
        finally:
            if queued and not acquired:
                self._leave_line(owner)

    def _end_lost_hold(self, owner: str) -> None:
        """Undo every acquire of ``owner``'s hold on the server: the hold this object
        reported lost, which its release did not reach (and the acquire that just
        re-entered it)."""
        with self._state:
            self._lost_hold = None
        for _ in range(LOST_HOLD_RELEASES):
            if self._send_release(owner, new_op_id()) != STILL_HELD:
                return

    def _undo_acquire(self, owner: str) -> None:
        """Undo one acquire of ``owner``'s hold on the server (best effort: a hold
        that was told lost ends by itself)."""
        try:
            self._send_release(owner, new_op_id())
        except DLockError as exc:
            logger.info("lock %r: could not undo a re-entry of a hold told lost (%s); "
                        "it ends with that hold", self.name, exc)

    def _check_bound(self, hold_id: int, now: float, what: str) -> None:
        """Report the hold lost and raise LockLost when it is at its max hold (its
        bound less the deadline's margin: where the watchdog reports it too)."""
        bound, max_hold = self._bound, self.max_hold
        if bound is None or max_hold is None or \
                now < bound - self._margin(self.ttl_ms):
            return
        reason = reached_reason(max_hold)
        if not self._mark_lost(reason, hold_id):
            reason = self._lost_reason or reason
        raise LockLost(f"{what}{reason}", lock_name=self.name)

    def _acquired(self, owner: str, grant: Grant, sent_at: float,
                  margin: float) -> None:
        scheduler = self._get_scheduler()
        with self._state:
            self._sync_generation()
            reentered = grant.reentered and self._depth > 0 and \
                owner == self._hold_owner
            raced = self._lost_reason if reentered else None
            if not reentered:
                self._new_hold(owner, grant, sent_at, margin, scheduler)
            elif raced is None:
                # Re-entry: the expiry is now at least ttl from the send time (or, at
                # a max hold, the bound).
                scheduler.confirmed(self, self._hold_id, self.ttl_ms, sent_at, margin,
                                    capped_ms(self.ttl_ms, self._bound, sent_at))
            if raced is None:
                self._depth += 1
        if raced is not None:
            # The re-entry reached the server while it still had the hold, but the
            # holder was told it lost that hold before the grant came back: taken
            # as a new hold it would carry the old fence and a fresh bound, and be
            # renewed again.  Undo this acquire on the server and report the loss.
            self._undo_acquire(owner)
            raise LockLost(f"cannot re-enter: lock lost: {raced}", lock_name=self.name)

    def _new_hold(self, owner: str, grant: Grant, sent_at: float, margin: float,
                  scheduler: RenewalScheduler) -> None:
        """Start the bookkeeping of a fresh hold, with a new hold id (under
        ``_state``)."""
        self._depth = 0
        self._hold_id = next_hold_id()
        self._hold_owner = owner
        self._fence = grant.fence
        self._lost_reason = None
        self._lost_hold = None
        self._release_op = None
        self._extend_op = None
        self._bound = None if self.max_hold is None else sent_at + self.max_hold
        target = self._renew_target() if self.auto_renew else None
        scheduler.register(self, self._hold_id, target, self._renew_key(), owner,
                           self.ttl_ms, sent_at, fence=grant.fence, margin=margin,
                           bound=self._bound)

    # -- release ------------------------------------------------------------------------

    def release(self) -> None:
        """Undo one acquire; the lock is freed when releases match acquires.

        Raises :class:`LockNotOwned` when the caller's owner does not hold the lock
        (nothing is deleted), :class:`LockLost` when this object held it but it was lost
        (expired, taken, or past its deadline) meanwhile, :class:`BackendUnavailable`
        when the servers did not confirm: then nothing changed, locally either, and
        calling release again re-sends the same operation (so a server that did apply
        it undoes one acquire, not two).
        """
        caller = self._current_owner()
        with self._state:
            self._sync_generation()
            held_here = self._depth > 0
            if held_here and caller != self._hold_owner:
                raise LockNotOwned(
                    "release by an owner that did not acquire it through this object",
                    lock_name=self.name)
            owner = self._hold_owner if held_here else caller
            assert owner is not None
            hold_id, lost_reason, depth = self._hold_id, self._lost_reason, self._depth
            final = held_here and depth == 1
            pending = self._release_op
            if held_here and pending is not None and pending[:2] == (hold_id, depth):
                op = pending[2]
            else:
                op = new_op_id()
                self._release_op = (hold_id, depth, op) if held_here else None
        scheduler = self._get_scheduler()
        if final and lost_reason is None:
            scheduler.set_releasing(self, hold_id, True)
        try:
            status = self._send_release(owner, op)
        except DLockError:
            if lost_reason is None:
                if final:
                    scheduler.set_releasing(self, hold_id, False)
                raise
            status = GONE  # a lost hold: the loss is the answer, best effort was made
        if not held_here:
            if status in (OK, STILL_HELD):
                return
            what = "is not held" if status == GONE else "is held by another owner"
            raise LockNotOwned(f"cannot release: lock {what}", lock_name=self.name)
        if lost_reason is None and status not in (OK, STILL_HELD):
            lost_reason = self._why_gone(status, owner)
            self._mark_lost(lost_reason, hold_id)
        with self._state:
            if self._hold_id == hold_id and self._depth > 0:
                self._depth -= 1
                self._release_op = None
                if self._depth == 0:
                    self._hold_owner = None
                    self._fence = None
        if final:
            scheduler.unregister(self, hold_id)
        if lost_reason is not None:
            raise LockLost(f"lock lost before it was released ({lost_reason})",
                           lock_name=self.name)

    def release_all(self) -> int:
        """Release every acquire of this object's hold, whichever thread asks.

        For shutdown paths that must not leave holds to expire; returns how many
        acquires were undone.  Errors are logged, not raised.
        """
        with self._state:
            self._sync_generation()
            depth, owner, hold_id = self._depth, self._hold_owner, self._hold_id
            if depth == 0 or owner is None:
                return 0
            self._depth = 0
            self._hold_owner = None
            self._fence = None
            self._release_op = None
            self._extend_op = None
        self._get_scheduler().unregister(self, hold_id)
        for _ in range(depth):
            try:
                status = self._send_release(owner, new_op_id())
            except DLockError as exc:
                logger.warning("releasing %r at shutdown failed: %s", self.name, exc)
                break
            if status != STILL_HELD:
                break
        return depth

    # -- extend, checks -----------------------------------------------------------------

    def extend(self, ttl: float | None = None) -> None:
        """Make the hold expire at least ``ttl`` seconds from now (default: the lock's
        ttl); an extend never brings the expiry closer.

        The new ttl is kept: later renewals use it too, and the holder's deadline uses
        its drift allowance and pause budget.  Answers for the calling owner:
        :class:`LockNotOwned` when it does not hold the lock, :class:`LockLost` when
        this object held it and it is gone.
        """
        ttl_ms = self.ttl_ms if ttl is None else _ttl_to_ms(ttl, "ttl", self.name)
        owner, held_here, hold_id, lost_reason = self._caller_view()
        if lost_reason is not None:
            raise LockLost(f"cannot extend: lock lost ({lost_reason})",
                           lock_name=self.name)
        with self._state:
            pending = self._extend_op
            if held_here and pending is not None and pending[:2] == (hold_id, ttl_ms):
                op = pending[2]
            else:
                op = new_op_id()
                self._extend_op = (hold_id, ttl_ms, op) if held_here else None
        scheduler = self._get_scheduler()
        sent_at = scheduler.now()
        send_ms = ttl_ms
        if held_here:
            self._check_bound(hold_id, sent_at, "cannot extend: lock lost: ")
            send_ms = capped_ms(ttl_ms, self._bound, sent_at)
        status = self._send_extend(owner, send_ms, op)
        with self._state:
            self._extend_op = None
        if status == OK:
            self.ttl_ms = ttl_ms
            if held_here:
                scheduler.confirmed(self, hold_id, ttl_ms, sent_at, self._margin(ttl_ms),
                                    send_ms)
            return
        if held_here:
            raise self._report_gone(status, owner, hold_id, "cannot extend: lock ")
        what = "is not held" if status == GONE else "is held by another owner"
        raise LockNotOwned(f"cannot extend: lock {what}", lock_name=self.name)

    def owned(self) -> bool:
        """Whether the calling owner holds the lock (asks the servers; a hold known to
        be lost answers False without asking).  A hold of this object that the
        servers no longer have is reported lost."""
        owner, held_here, hold_id, lost_reason = self._caller_view()
        if lost_reason is not None:
            return False
        status = self._read_status(owner)
        if status != OK and held_here:
            self._mark_lost(self._why_gone(status, owner), hold_id)
        return status == OK

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` unless the calling owner still holds the lock.

        Asks the servers, so it is authoritative at the moment it returns; pair it
        with :attr:`fence` for writes that must not come from a stale holder.  A hold
        known to be lost raises without asking.
        """
        owner, held_here, hold_id, lost_reason = self._caller_view()
        if lost_reason is not None:
            raise LockLost(f"lock lost: {lost_reason}", lock_name=self.name)
        status = self._read_status(owner)
        if status == OK:
            return
        if held_here:
            raise self._report_gone(status, owner, hold_id, "lock lost: ")
        raise LockLost(f"lock not held by this owner "
                       f"({self._gone_reason(status, owner)})", lock_name=self.name)

    # -- context manager ----------------------------------------------------------------

    def __enter__(self: _Self) -> _Self:
        if not self.acquire(blocking=True, timeout=self.blocking_timeout):
            raise LockNotAcquired(lock_name=self.name, holder=self.last_holder)
        return self

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.release()
        except DLockError as release_error:
            if exc is None:
                raise
            # Never hide the body's exception behind a release problem.
            logger.warning("releasing %r after an error also failed: %s",
                           self.name, release_error)
            if hasattr(exc, "add_note"):
                exc.add_note(f"celery-dlock: releasing lock {self.name!r} also failed: "
                             f"{release_error}")

