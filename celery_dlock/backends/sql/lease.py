"""What every SQL dialect's lock shares: :class:`LeaseLock`, the lease-row lock.

A lease row per lock name (docs/backends.md): the holder's owner, its count of
acquires, the name's fence counter (kept past release), an expiry on the server's
clock, the latest operation ids and the last force release's note.  How a row is read
and written is the dialect's (PostgreSQL: :mod:`.postgres.lock`, MySQL/MariaDB:
:mod:`.mysql.lock`): a few ``_try_*`` methods, each one operation on one row, idempotent
under its operation id.  What the answers mean (granted, refused, gone, taken, a
re-sent release already applied, who released a hold by force) is decided here once,
for every dialect; the bookkeeping is :class:`~celery_dlock.core.hold.Hold`'s.

No driver is imported here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, Generic, NamedTuple, TypeVar

from ...core.errors import Holder
from ...core.hold import Hold
from ...core.holds import HoldInfo
from ...core.lock_args import DEFAULT_PREFIX
from ...core.lock_options import LockOptions
from ...core.protocol import GONE, OK, STILL_HELD, TAKEN, Grant, Refused, new_op_id
from ...core.scheduler import RenewalScheduler
from .released import forced_reason

__all__ = ["NAME_FIELD", "LeaseLock", "Status", "hold_info", "holder_of", "renew_key",
           "split_key"]

logger = logging.getLogger("celery_dlock.lock")

#: A dialect's server object (one per URL and process).
S = TypeVar("S")

#: The field of a row's ``info`` that keeps the lock's name when the row's key is
#: not the name itself (PostgreSQL's digested names, :mod:`.postgres.keys`).
NAME_FIELD = "dlock_name"


def renew_key(prefix: str, name: str) -> str:
    """The key the scheduler knows a hold by."""
    return json.dumps([prefix, name])


def split_key(key: str) -> tuple[str, str]:
    prefix, name = json.loads(key)
    return str(prefix), str(name)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _mapping(value: Any) -> Mapping[str, Any]:
    """A JSON object column as a mapping (a driver may give it parsed, or as text)."""
    if isinstance(value, (bytes, bytearray, str)):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, Mapping) else {}


def holder_of(row: tuple[Any, ...]) -> Holder:
    """The :class:`Holder` of a hold row: ``name, owner, count, fence, age (s), ttl
    left (s), info`` (and, on a read of holds, the longest ttl in ms it was taken or
    extended with)."""
    _, owner, count, fence, age, ttl, info = row[:7]
    return Holder(owner=_text(owner), count=int(count), fence=int(fence),
                  age=None if age is None else max(0.0, float(age)),
                  ttl=None if ttl is None else max(0.0, float(ttl)),
                  info={str(k): str(v) for k, v in _mapping(info).items()
                        if k != NAME_FIELD})


def hold_info(row: tuple[Any, ...]) -> HoldInfo:
    """The :class:`HoldInfo` (``celery dlock``'s view) of a hold row."""
    holder = holder_of(row)
    extra = dict(holder.info)
    key = _mapping(row[6]).get(NAME_FIELD)
    pid = extra.pop("pid", None)
    task_name = extra.pop("task_name", None)
    task_id = extra.pop("task_id", None)
    worker = extra.pop("worker", None)
    host = extra.pop("host", None)
    # The longest ttl it was taken or extended with (as Redis keeps it): less the ttl
    # left, how long ago the hold was renewed (``clear_locks`` judges a stopped
    # renewal by it).
    lease = float(row[7]) / 1000.0 if len(row) > 7 and row[7] else None
    return HoldInfo(key=str(key) if key is not None else _text(row[0]) or "",
                    task_name=task_name, task_id=task_id,
                    worker=worker, pid=int(pid) if pid and pid.isdigit() else None,
                    owner=holder.owner or "", count=holder.count, fence=holder.fence,
                    ttl=holder.ttl, held_for=holder.age, host=host, extra=extra,
                    lease=lease)


class Status(NamedTuple):
    """A lock's row as one owner sees it: who holds it (None: nobody), whether that
    hold is live, whether an operation id was applied, and the last force release's
    note."""

    owner: str | None
    live: bool
    applied: bool
    forced: Any


class LeaseLock(Hold, Generic[S]):
    """The lease-row lock of every SQL dialect (the dialect subclasses it).

    :param url: the server's URL, or the dialect's server object (``S``).
    Every other parameter is :class:`~celery_dlock.RedisLock`'s.

    A server that cannot be reached is :class:`BackendUnavailable`; a table of
    another application at the lease table's name :class:`LockKeyConflict`; a user
    who may not create the table (or write it) :class:`InvalidLockConfig` naming the
    GRANTs it needs.
    """

    prefix: str
    server: S
    #: A fresh hold's fence is ``max(last + fence_step, server µs * fence_step +
    #: fence_slot)``: a lock's row steps by 1; a semaphore's slot rows by the limit,
    #: each from its own slot, so no two slots give the same fence (:mod:`.slots`).
    fence_step = 1
    fence_slot = 0

    def __init__(
        self,
        url: str | S,
        name: str,
        ttl: float = 30.0,
        *,
        auto_renew: bool = True,
        owner: str | None = None,
        on_lost: Callable[[Any], object] | None = None,
        prefix: str = DEFAULT_PREFIX,
        info: Mapping[str, object] | None = None,
        blocking_timeout: float | None = None,
        scheduler: RenewalScheduler | None = None,
        pause_budget: float | None = None,
        max_hold: float | None = None,
    ) -> None:
        self._open(url, LockOptions(
            name, ttl, prefix=prefix, owner=owner, on_lost=on_lost, info=info,
            blocking_timeout=blocking_timeout, scheduler=scheduler,
            auto_renew=auto_renew, pause_budget=pause_budget, max_hold=max_hold))

    def _open(self, where: Any, options: LockOptions) -> None:
        super().__init__(options)
        self.server = self.server_of(where)
        self._info = options.info_fields
        self._prepare()

    # -- what a dialect provides --------------------------------------------------------

    @classmethod
    def server_of(cls, url: str | S) -> S:
        """The dialect's server object of ``url`` (a URL, or that object): this
        process's one for that URL."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """Set up what the dialect keeps beside the row (the server, prefix and name
        known)."""

    def _key_row(self, prefix: str, name: str) -> None:
        """Address the row of the lock ``(prefix, name)`` from now on (a lock's own
        at :meth:`_prepare`; a semaphore's slots: :mod:`.slots`)."""
        raise NotImplementedError

    def _try_acquire(self, owner: str, op: str, ttl_ms: int, queue: bool
                     ) -> tuple[int, int] | None:
        """Take the lock for ``owner`` (or re-enter its live hold) when free, expired
        or its own (and, on a dialect that keeps a line of waiters, nobody else is
        first in line): ``(fence, count)``; None when refused.  ``queue``: a refused
        caller joins the line (or keeps its place in it); a granted one leaves it."""
        raise NotImplementedError

    def _try_reenter(self, owner: str, op: str, ttl_ms: int,
                     fence: int | None) -> int | None:
        """Re-enter ``owner``'s live hold with ``fence`` (None: any): its fence, or
        None when that hold is gone."""
        raise NotImplementedError

    def _try_release(self, owner: str, op: str) -> int | None:
        """Undo one acquire of ``owner``'s live hold unless ``op`` was applied: the
        new count (0: freed, and the waiters told), or None."""
        raise NotImplementedError

    def _try_extend(self, owner: str, ttl_ms: int) -> bool:
        """Make ``owner``'s live hold expire no sooner than ``ttl_ms`` from now (only
        ever later): whether it was held."""
        raise NotImplementedError

    def _status_of(self, owner: str, op: str) -> Status | None:
        """The row's :class:`Status` (None: no row)."""
        raise NotImplementedError

    def _hold_row(self) -> tuple[Any, ...] | None:
        """The live hold's row (see :func:`holder_of`), or None."""
        raise NotImplementedError

    def _head(self, owner: str) -> tuple[str | None, float] | None:
        """The first live waiter in line and the seconds its place has left; None
        when nobody waits (or the dialect keeps no line)."""
        return None

    def _try_leave(self, owner: str) -> None:
        """Take ``owner`` out of the line of waiters (a dialect without one: nothing
        to do)."""

    def _line(self) -> list[str]:
        """The owners waiting in line, first in line first (no line: empty)."""
        return []

    def _sleep_turn(self, seconds: float) -> None:
        """Wait at most ``seconds`` for the lock to be freed."""
        raise NotImplementedError

    def _stop_waiting(self) -> None:
        """The acquire ended: let go of what waiting took."""

    # -- the lease row's answers -------------------------------------------------------

    def _line_wait(self, owner: str) -> float:
        """The lock is free but was refused to ``owner``: how long the first waiter
        in line (another owner) keeps its place, in seconds; 0.0 when nobody else
        is first."""
        head = self._head(owner)
        if head is None or head[0] == owner:
            return 0.0
        return max(0.0, head[1]) + 0.001

    def _status(self, owner: str, op: str = "") -> tuple[int, bool, Any]:
        """``OK``/``GONE``/``TAKEN`` for ``owner``, whether ``op`` was applied, and
        the last force release's note."""
        found = self._status_of(owner, op)
        if found is None:
            return GONE, False, None
        if found.owner is None or not found.live:
            return GONE, found.applied, found.forced
        return (OK if found.owner == owner else TAKEN), found.applied, found.forced

    def _send_acquire(self, owner: str, op: str, *, queue: bool,
                      reentry: bool) -> Grant | Refused | int:
        ttl = self._acquire_ttl_ms(reentry)  # never past a max_hold bound
        if reentry:
            fence = self._try_reenter(owner, op, ttl, self._fence)
            if fence is None:
                return TAKEN if self._status(owner)[0] == TAKEN else GONE
            return Grant(fence, True)
        granted = self._try_acquire(owner, op, ttl, queue)
        if granted is not None:
            self._stop_waiting()
            return Grant(granted[0], granted[1] > 1)
        held = self._hold_row()
        if held is None:
            # Free, but the first waiter in line (another owner) has its turn: try
            # again once its place lapses (it takes the lock long before, if alive).
            # Nobody else first: freed between the two statements, try again at once.
            self.last_holder = None
            return Refused(self._line_wait(owner))
        self.last_holder = holder_of(held)
        ttl_left = self.last_holder.ttl
        return Refused(None if ttl_left is None else ttl_left + 0.001)

    def _wait_turn(self, owner: str, refused: Refused, left: float | None) -> None:
        slice_ = self.wait_slice if left is None else min(self.wait_slice, left)
        if refused.retry_in is not None:
            slice_ = min(slice_, refused.retry_in)
        if slice_ > 0:
            self._sleep_turn(slice_)

    #: The longest single wait of a blocked acquirer before it tries again (seconds).
    wait_slice = 2.0

    def _leave_line(self, owner: str) -> None:
        try:
            self._try_leave(owner)
        except Exception as exc:  # its place lapses by itself
            logger.debug("could not leave the line of %r: %s", self.name, exc)
        finally:
            self._stop_waiting()

    def _give_back(self, owner: str) -> None:
        try:
            self._send_release(owner, new_op_id())
        except Exception as exc:  # it expires by itself
            logger.debug("could not give back %r: %s", self.name, exc)

    def _send_release(self, owner: str, op: str) -> int:
        count = self._try_release(owner, op)
        if count is not None:
            return OK if count == 0 else STILL_HELD
        code, applied, _ = self._status(owner, op)
        if applied:  # a re-sent release the server already applied
            return STILL_HELD if code == OK else OK
        return code

    def _send_extend(self, owner: str, ttl_ms: int, op: str) -> int:
        # Extending only ever moves the expiry later: a second execution changes
        # nothing.
        if self._try_extend(owner, ttl_ms):
            return OK
        return self._status(owner)[0]

    def _read_status(self, owner: str) -> int:
        return self._status(owner)[0]

    def _renew_key(self) -> str:
        return renew_key(self.prefix, self.name)

    def _explain_loss(self, default: str, owner: str, fence: int | None) -> str:
        """``default``, or who released this hold by force and why."""
        try:
            forced = self._status(owner)[2]
        except Exception:
            return default
        note = forced_reason(_mapping(forced) or None, owner, fence)
        return default if note is None else note[1]

    # -- reading ----------------------------------------------------------------------

    def locked(self) -> bool:
        """Whether anyone holds the lock."""
        return self._hold_row() is not None

    def holder(self) -> Holder | None:
        """Who holds the lock now (None when free)."""
        row = self._hold_row()
        return holder_of(row) if row is not None else None

    def waiting(self) -> list[str]:
        """The owners waiting in line for the lock, first in line first (their places
        live)."""
        return self._line()

    def waiting_count(self) -> int:
        """How many owners wait in line."""
        return len(self._line())

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r} ttl={self.ttl:g}s "
                f"depth={self._depth} fence={self._fence}>")
