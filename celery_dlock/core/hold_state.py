"""What a lock object knows of its hold without asking a server, and how a loss is
reported: :class:`HoldState`, the base of :class:`~celery_dlock.core.hold.Hold`.

It keeps which owner holds the lock through this object, how many acquires are not yet
released (re-entry), the hold's id (one per fresh hold, so a late report about an older
hold never touches a newer one), its fencing token, the operation ids of a call that
failed, the hold's max-hold bound, and whether it was found lost, why, and who was
told.  It also names what a backend provides (the ``_send_*`` methods and a few more).
The calls that change the state (acquire, release, extend) are
:class:`~celery_dlock.core.hold.Hold`'s.
"""

from __future__ import annotations

import itertools
import logging
import threading

from . import owner as _owner
from .deadline import DRIFT_RATE, margin_of
from .errors import Holder, LockLost
from .lock_options import LockOptions
from .max_hold import capped_ms, check_max_hold, first_lease_ms
from .protocol import GONE, Grant, Refused
from .renew_target import RenewTarget
from .scheduler import RenewalScheduler, get_scheduler
from .ttl import ttl_ms as _ttl_to_ms

__all__ = ["HoldState", "next_hold_id"]

logger = logging.getLogger("celery_dlock.lock")

_hold_ids = itertools.count(1)


def next_hold_id() -> int:
    """A new hold id, unique in this process."""
    return next(_hold_ids)


class HoldState:
    """A lock object's hold as this process knows it (see the module text), made
    with its :class:`~celery_dlock.core.lock_options.LockOptions`: a ``max_hold`` is
    the seconds after which a hold is no longer renewed and is reported lost ("max
    hold ... reached"), however often it was renewed, re-entered or extended (None:
    unbounded; shorter than the ttl, it cuts the first grant; see
    :mod:`celery_dlock.core.max_hold`); a ``pause_budget`` of None is
    :func:`~celery_dlock.core.deadline.pause_budget`."""

    #: Whether :attr:`fence` gives fencing tokens on this kind of lock.
    fences = True

    def __init__(self, options: LockOptions) -> None:
        #: What this lock was made with (checked: :class:`LockOptions`).
        self.options = options
        name = options.name
        self.name = name
        self.prefix = options.prefix
        self.on_lost = options.on_lost
        self.ttl_ms = _ttl_to_ms(options.ttl, "ttl", name)
        self.max_hold = check_max_hold(options.max_hold, name)
        #: When the current hold reaches its max hold (scheduler clock; None: never).
        self._bound: float | None = None
        self.auto_renew = options.auto_renew
        self.blocking_timeout = options.blocking_timeout
        self.pause_budget = options.pause_budget
        #: The metadata stored with each hold, as flat field/value arguments.
        self._info_args = list(options.info_args)
        self._fixed_owner = options.owner
        self._scheduler = options.scheduler
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
        """The ttl (ms) an acquire asks the server for: the lock's (a max hold shorter
        than it for a fresh hold), or for a re-entry of a hold with a max hold, no more
        than the time left to it."""
        if not reentry or self._bound is None:
            return first_lease_ms(self.ttl_ms, self.max_hold)
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
        # A max hold shorter than the ttl is the longest lease a hold ever has: the
        # margin (drift, and the default pause budget, a tenth) is of that lease.
        lease = first_lease_ms(ttl_ms, self.max_hold)
        return margin_of(lease, self.pause_budget, self._drift_rate())

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
