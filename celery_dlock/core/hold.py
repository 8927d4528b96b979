"""The one hold state machine every lock kind runs: :class:`Hold`.

What a lock object knows without asking a server, and every rule about when it
changes: which owner holds it through this object, how many acquires are not yet
released (re-entry), the hold's id (one per fresh hold, so a late report about an older
hold never touches a newer one), its fencing token, the operation ids of a call that
failed (so that trying it again re-sends the same operation), and whether it was found
lost, why, and who was told.

A backend subclasses :class:`Hold` and says only how to talk to its servers (the
``_send_*`` methods and a few more, listed under "what a backend provides"); it never
touches the bookkeeping.  So every kind agrees, by construction, on:

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

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

from . import owner as _owner
from .deadline import DRIFT_RATE, lease_end, margin_of
from .errors import (
    DLockError,
    Holder,
    InvalidLockConfig,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
)
from .max_hold import capped_ms, check_max_hold, reached_reason
from .protocol import GONE, OK, STILL_HELD
from .renew_target import RenewTarget
from .scheduler import RenewalScheduler, get_scheduler
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

#: The key prefix of every backend unless told otherwise.
DEFAULT_PREFIX = "dlock"

_HOST = socket.gethostname()
#: Fields of a hold that ``info`` may not set.
RESERVED_INFO = frozenset({"owner", "count", "fence", "acquired_at", "ttl", "pid", "ops",
                           "prev"})

_Self = TypeVar("_Self", bound="Hold")
#: At most how many releases end a hold this object reported lost that the server
#: still has (one per acquire it counts).
LOST_HOLD_RELEASES = 1024
_hold_ids = itertools.count(1)


def new_op_id() -> str:
    """A fresh operation id: lets a server recognise a call it already ran."""
    return os.urandom(8).hex()


class Grant(NamedTuple):
    """An acquire the server granted: the hold's fencing token (None: the kind gives
    none) and whether it was a re-entry of a hold the owner already had."""

    fence: int | None
    reentered: bool


class Refused(NamedTuple):
    """An acquire the server did not grant; ``retry_in`` (seconds, None: unknown) is
    when trying again may be worth it (the holder's remaining ttl, say)."""

    retry_in: float | None = None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_lock_options(name: Any, prefix: Any, owner: Any, blocking_timeout: Any,
                       info: Mapping[str, object] | None,
                       pause_budget: Any = None) -> list[str]:
    """InvalidLockConfig for a bad name, prefix, owner, blocking_timeout or pause
    budget, or an info field that is reserved; else the metadata (``host`` added) as
    flat field/value arguments."""
    if not isinstance(name, str) or not name:
        raise InvalidLockConfig(f"a lock needs a non-empty name, got {name!r}")
    if not _encodable(name):
        raise InvalidLockConfig(f"a lock name must be encodable as UTF-8 (no lone "
                                f"surrogate), got {name!r}")
    if not isinstance(prefix, str) or not prefix:
        raise InvalidLockConfig(f"prefix must be a non-empty string, got {prefix!r}",
                                lock_name=name)
    if "{" in prefix or "}" in prefix or not _encodable(prefix):
        raise InvalidLockConfig(f"prefix may not contain '{{' or '}}' (on Redis Cluster "
                                f"they would move the hash tag: every acquire would "
                                f"fail), got {prefix!r}", lock_name=name)
    if owner is not None and (not isinstance(owner, str) or not owner):
        raise InvalidLockConfig(f"owner must be a non-empty string, got {owner!r}",
                                lock_name=name)
    # NaN compares false with everything: refuse it rather than wait forever.
    if blocking_timeout is not None and (
            isinstance(blocking_timeout, bool)
            or not isinstance(blocking_timeout, (int, float))
            or not blocking_timeout >= 0):
        raise InvalidLockConfig(f"blocking_timeout must be a number >= 0 or None, got "
                                f"{blocking_timeout!r}", lock_name=name)
    if pause_budget is not None and (isinstance(pause_budget, bool)
                                     or not isinstance(pause_budget, (int, float))
                                     or not pause_budget >= 0):
        raise InvalidLockConfig(f"pause_budget must be a number of seconds >= 0 or "
                                f"None, got {pause_budget!r}", lock_name=name)
    info_args: list[str] = []
    for k, v in {"host": _HOST, **(info or {})}.items():
        if k in RESERVED_INFO:
            raise InvalidLockConfig(f"info may not set the reserved field {k!r}",
                                    lock_name=name)
        if v is not None:
            info_args += (str(k), str(v))
    return info_args


def acquire_timeout(blocking: bool, timeout: float | None,
                    blocking_timeout: float | None,
                    default: float | None) -> float | None:
    """How long an ``acquire(blocking, timeout, blocking_timeout=...)`` may wait (None:
    no limit), redis-py's ``Lock`` rules: ``blocking_timeout`` is another name for
    ``timeout``; neither given: the lock's ``default``; ``-1``: no limit."""
    if blocking_timeout is not None:
        if timeout is not None and timeout != blocking_timeout:
            raise ValueError("give timeout or blocking_timeout, not both")
        timeout = blocking_timeout
    if timeout is not None and timeout != -1:
        if not blocking:
            raise ValueError("can't specify a timeout for a non-blocking call")
        if not timeout >= 0:  # negative, or NaN (which would wait forever)
            raise ValueError("timeout must be >= 0, -1 or None")
        return timeout
    if timeout is None and blocking:
        return default
    return None


class Hold:
    """A lock object's hold and every rule about it (see the module text).

    :param name: the lock's name.
    :param ttl: seconds a hold lives after its last acquire, extend or renewal.
    :param owner: a fixed owner token, or None for the current context's owner.
    :param on_lost: called once per lost hold with this lock.
    :param scheduler: the renewal registry (default: this process's).
    :param auto_renew: renew the hold from the scheduler every ``ttl/3``.
    :param blocking_timeout: how long ``with lock:`` and a plain ``acquire()`` wait.
    :param pause_budget: seconds this holder may be frozen at its deadline and still
        be told first (default: :func:`~celery_dlock.core.deadline.pause_budget`).
    :param max_hold: seconds after which a hold is no longer renewed and is reported
        lost ("max hold ... reached"), however often it was renewed, re-entered or
        extended (None: unbounded; at least the ttl; see
        :mod:`celery_dlock.core.max_hold`).
    """

    #: Whether :attr:`fence` gives fencing tokens on this kind of lock.
    fences = True

    def __init__(self, name: str, ttl: float, *, owner: str | None,
                 on_lost: Callable[[Any], object] | None,
                 scheduler: RenewalScheduler | None, auto_renew: bool,
                 blocking_timeout: float | None,
                 pause_budget: float | None = None,
                 max_hold: float | None = None) -> None:
        self.name = name
        self.on_lost = on_lost
        self.ttl_ms = _ttl_to_ms(ttl, "ttl", name)
        self.max_hold = check_max_hold(max_hold, self.ttl_ms / 1000.0, name)
        #: When the current hold reaches its max hold (scheduler clock; None: never).
        self._bound: float | None = None
        self.auto_renew = auto_renew
        self.blocking_timeout = blocking_timeout
        self.pause_budget = pause_budget
        self._fixed_owner = owner
        self._scheduler = scheduler
        self._state = threading.Lock()
        self._depth = 0
        self._hold_id = 0
        self._hold_owner: str | None = None
        self._fence: int | None = None
        self._generation = _owner.generation()
        self._lost_reason: str | None = None
        # The owner and fence of this object's last hold reported lost: a server that
        # still has that hold (the holder could not confirm it in time, and its
        # release did not get through) would let the next acquire re-enter it.
        self._lost_hold: tuple[str, int] | None = None
        # The operation of a release (hold id, depth, op id) or extend (hold id, ttl,
        # op id) that raised: trying it again re-sends the same operation.
        self._release_op: tuple[int, int, str] | None = None
        self._extend_op: tuple[int, int, str] | None = None
        #: What the last failed acquire learned about the holder.
        self.last_holder: Holder | None = None

    # -- what a backend provides --------------------------------------------------------

    def _send_acquire(self, owner: str, op: str, *, queue: bool,
                      reentry: bool) -> Grant | Refused | int:
        """One try at the lock for ``owner``: a :class:`Grant`, a :class:`Refused`
        (after setting :attr:`last_holder`), or, when ``reentry`` says the owner
        expects to hold it already and the server no longer has that hold, ``GONE``
        or ``TAKEN`` (and nothing taken).  ``queue``: join the line of waiters.
        Raises a DLockError when the servers cannot tell."""
        raise NotImplementedError

    def _wait_turn(self, owner: str, refused: Refused, left: float | None) -> None:
        """Sleep until trying again may succeed, at most ``left`` seconds."""
        raise NotImplementedError

    def _leave_line(self, owner: str) -> None:
        """A blocked acquire gave up: leave the line of waiters (best effort)."""

    def _give_back(self, owner: str) -> None:
        """Undo a fresh grant that arrived after its own deadline (best effort)."""
        raise NotImplementedError

    def _send_release(self, owner: str, op: str) -> int:
        """Undo one acquire of ``owner``: ``OK`` (freed), ``STILL_HELD``, ``GONE`` or
        ``TAKEN``.  Raises a DLockError when the servers cannot tell."""
        raise NotImplementedError

    def _send_extend(self, owner: str, ttl_ms: int, op: str) -> int:
        """Make ``owner``'s hold expire at least ``ttl_ms`` from now: ``OK``, ``GONE``
        or ``TAKEN``."""
        raise NotImplementedError

    def _read_status(self, owner: str) -> int:
        """Whether ``owner`` holds the lock now: ``OK``, ``GONE`` (nobody) or
        ``TAKEN``."""
        raise NotImplementedError

    def _renew_target(self) -> RenewTarget | None:
        """Where the scheduler renews this lock's holds."""
        raise NotImplementedError

    def _acquire_ttl_ms(self, reentry: bool) -> int:
        """The ttl (ms) an acquire asks the server for: the lock's, or for a
        re-entry of a hold with a max hold, no more than the time left to it."""
        if not reentry or self._bound is None:
            return self.ttl_ms
        return max(1, capped_ms(self.ttl_ms, self._bound, self._get_scheduler().now()))

    def _renew_key(self) -> str:
        """The name the renew target knows the hold by."""
        return self.name

    def _drift_rate(self) -> float:
        """The share of the ttl allowed for clock drift."""
        return DRIFT_RATE

    def _gone_reason(self, code: int, owner: str) -> str:
        """Why a hold the server no longer has is gone (``code``: GONE or TAKEN)."""
        return "expired" if code == GONE else "taken by another owner"

    def locked(self) -> bool:
        raise NotImplementedError

    def holder(self) -> Holder | None:
        raise NotImplementedError

    # -- the local view -----------------------------------------------------------------

    @property
    def ttl(self) -> float:
        return self.ttl_ms / 1000.0

    def _margin(self, ttl_ms: int) -> float:
        return margin_of(ttl_ms, self.pause_budget, self._drift_rate())

    def _current_owner(self) -> str:
        return self._fixed_owner or _owner.current_owner()

    def _get_scheduler(self) -> RenewalScheduler:
        return self._scheduler if self._scheduler is not None else get_scheduler()

    def _sync_generation(self) -> None:
        # A forked child inherits this object's memory but not its hold.
        gen = _owner.generation()
        if self._generation != gen:
            self._generation = gen
            self._depth = 0
            self._hold_owner = None
            self._fence = None
            self._lost_reason = None
            self._lost_hold = None
            self._release_op = None
            self._extend_op = None

    def _caller_view(self) -> tuple[str, bool, int, str | None]:
        """The calling owner, whether it holds the lock through this object, the id of
        that hold and why it was lost (None: not lost)."""
        caller = self._current_owner()
        with self._state:
            self._sync_generation()
            held_here = self._depth > 0 and caller == self._hold_owner
            return caller, held_here, self._hold_id, (self._lost_reason if held_here
                                                      else None)

    @property
    def lost(self) -> bool:
        """Whether this object's last hold was found lost (it stays True after the
        release of a lost hold, until the next fresh hold)."""
        return self._lost_reason is not None

    @property
    def lost_reason(self) -> str | None:
        """Why this object's last hold was found lost (None: it was not)."""
        return self._lost_reason

    @property
    def depth(self) -> int:
        """How many acquires of this object are not yet released."""
        with self._state:
            self._sync_generation()
            return self._depth

    @property
    def fence(self) -> int | None:
        """The fencing token of this object's current hold (None when not held).

        Tokens strictly increase across holders, also after the server lost its data,
        and stay the same on re-entry: a resource that remembers the highest token it
        has seen can refuse a write from a holder whose lock has since passed on.
        """
        with self._state:
            self._sync_generation()
            return self._fence if self._depth > 0 else None

    def _mark_lost(self, reason: str, hold_id: int | None = None) -> bool:
        """Record that hold ``hold_id`` (default: the current one) is lost, whoever
        found out; ``on_lost`` runs once per hold.  A report about an older hold
        changes nothing."""
        with self._state:
            if self._depth == 0 or self._lost_reason is not None:
                return False
            if hold_id is not None and hold_id != self._hold_id:
                return False
            self._lost_reason = reason
            hold_id = self._hold_id
            if self._hold_owner is not None and self._fence is not None:
                self._lost_hold = (self._hold_owner, self._fence)
        self._get_scheduler().unregister(self, hold_id)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                logger.exception("on_lost callback for %r failed", self.name)
        return True

    def _why_gone(self, code: int, owner: str) -> str:
        with self._state:
            fence = self._fence
        return self._explain_loss(self._gone_reason(code, owner), owner, fence)

    def _explain_loss(self, default: str, owner: str, fence: int | None) -> str:
        """``default``, or a better reason the backend can find (who released the
        hold by force, and why)."""
        return default

    def _report_gone(self, code: int, owner: str, hold_id: int, what: str) -> LockLost:
        """The server no longer has this object's hold: report the loss (once) and
        return the LockLost (``what`` + the reason) for the caller to raise."""
        reason = self._why_gone(code, owner)
        if not self._mark_lost(reason, hold_id):
            reason = self._lost_reason or reason
        return LockLost(f"{what}{reason}", lock_name=self.name)

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
        self._hold_id = next(_hold_ids)
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

