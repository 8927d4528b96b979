"""Semaphores (``lock_limit`` above 1) on a SQL lease table: ``limit`` slot rows.

A semaphore of name ``N`` under prefix ``P`` with limit ``L`` is ``L`` lease rows, slot
``i`` keyed as the lock ``(slot_prefix(P), slot_name(N, i))``.  Each slot row is a
lease row like a lock's (:mod:`.lease`), so a slot's hold has everything a lock's hold
has, in the dialect's statements already proven for locks: an owner and a count for
re-entry, its own fence (the row's counter, kept past release), an expiry on the
server's clock, operation ids that make a re-sent step harmless, renewal in the
process's one statement per interval, the force release's note.  The slots' prefix
holds a NUL, which no lock's prefix of a user's does in practice, so a slot row never
meets a lock's row; ``celery dlock`` lists a semaphore once, with its holders
(:func:`semaphores`).

Fences: slot ``i``'s fences are ``i`` modulo the limit (the row steps by the limit,
from the server's clock in µs times the limit plus ``i``), so two holders never have
the same fence, also when two slots are granted in the same microsecond; each slot's
fences grow, and a later hold of the name has a larger fence than every earlier one
as long as the grants are a microsecond apart (the lock's assumptions otherwise,
docs/fencing.md).  Every process must give a name the same limit (as on Redis).

A fresh acquire reads the live slots of the name (one statement), re-enters the
owner's own live slot if it has one (re-entry takes no second slot, whichever object
of the owner asks), else tries the free slots, in random order, each with the
dialect's acquire (the row decides: a slot taken meanwhile by another owner is
refused, and the next is tried).  All slots live: refused, with the soonest expiry as
the time to try again.  A slot is held through one row for the whole hold: release,
extend, renewal and the loss checks address that row only.

What a semaphore here does not do that a lock does: blocked acquirers stand in no
line.  They wait (PostgreSQL: woken by a release's ``NOTIFY`` on the semaphore's
channel; MySQL/MariaDB: polling) and try again; a freed slot goes to whichever waiter
tries first, not to the one that waited longest (docs/backends.md).

No driver is imported here.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from ...core.errors import Holder
from ...core.holds import HoldInfo
from ...core.lock_options import LockOptions, check_limit
from ...core.protocol import Grant, Refused
from .lease import NAME_FIELD, LeaseLock, holder_of

__all__ = ["LIMIT_FIELD", "SLOT_FIELD", "SlotLease", "semaphores", "shown_key",
           "slot_name", "slot_prefix"]

#: The fields of a slot row's ``info`` that say which semaphore (its limit) and
#: which slot it is (the semaphore's name is :data:`~.lease.NAME_FIELD`).
LIMIT_FIELD = "dlock_limit"
SLOT_FIELD = "dlock_slot"
#: What a semaphore's slots' prefix adds to the semaphore's prefix.
_SLOTS = "\x00slots"


def slot_prefix(prefix: str) -> str:
    """The prefix of the slot rows of the semaphores under ``prefix``."""
    return prefix + _SLOTS


def slot_name(name: str, slot: int) -> str:
    """The name of slot ``slot`` of semaphore ``name`` (under :func:`slot_prefix`)."""
    return f"{slot}:{name}"


def shown_key(name: str) -> str:
    """``name`` as a slot row's info shows it (a NUL as ``\\0``: PostgreSQL's
    ``jsonb`` keeps none)."""
    return name.replace("\x00", "\\0")


def _ttl_left(row: tuple[Any, ...]) -> float:
    return 0.0 if row[5] is None else max(0.0, float(row[5]))


S = TypeVar("S")


class SlotLease(LeaseLock[S]):
    """The slots of a semaphore, before a dialect's lease lock in its semaphore's
    bases (``class PostgresSemaphore(SlotLease[PgServer], PostgresLock)``).

    The dialect's lock provides ``_key_row`` (:class:`~.lease.LeaseLock`'s), its
    semaphore :meth:`_slot_rows` (the live hold rows of some slot names, in one
    statement).  Everything else is the lease lock's.
    """

    limit: int

    def _open(self, where: Any, options: LockOptions) -> None:
        self.limit = self.fence_step = check_limit(options.limit, options.name)
        super()._open(where, options)
        self._info[NAME_FIELD] = shown_key(self.name)
        self._info[LIMIT_FIELD] = str(self.limit)
        self._slot_names = [slot_name(self.name, i) for i in range(self.limit)]
        self._use_slot(0)

    # -- what the dialect provides -----------------------------------------------------

    def _slot_rows(self, prefix: str, names: list[str]) -> dict[str, tuple[Any, ...]]:
        """The live hold rows (see :func:`~.lease.holder_of`) of the locks ``names``
        under ``prefix``, by name: one statement."""
        raise NotImplementedError

    # -- the slots ----------------------------------------------------------------------

    def _use_slot(self, slot: int) -> None:
        self._slot = self.fence_slot = slot
        self._info[SLOT_FIELD] = str(slot)
        self._key_row(slot_prefix(self.prefix), self._slot_names[slot])

    def _live_slots(self) -> dict[int, tuple[Any, ...]]:
        """The live slots now: slot -> its hold row."""
        rows = self._slot_rows(slot_prefix(self.prefix), self._slot_names)
        return {i: rows[n] for i, n in enumerate(self._slot_names) if n in rows}

    def _send_acquire(self, owner: str, op: str, *, queue: bool,
                      reentry: bool) -> Grant | Refused | int:
        if reentry:  # the row is the slot held
            return super()._send_acquire(owner, op, queue=False, reentry=True)
        kept = self._slot
        live = self._live_slots()
        own = [i for i, row in live.items() if holder_of(row).owner == owner]
        free = [i for i in range(self.limit) if i not in live]
        random.shuffle(free)  # acquirers spread over the free slots
        ttl = self._acquire_ttl_ms(False)
        for slot in own + free:
            self._use_slot(slot)
            granted = self._try_acquire(owner, op, ttl, False)
            if granted is not None:
                self._stop_waiting()
                return Grant(int(granted[0]), int(granted[1]) > 1)
        self._use_slot(kept)
        if not live:  # the free slots were taken meanwhile and freed again
            self.last_holder = None
            return Refused(0.01)
        soonest = min(live.values(), key=_ttl_left)
        self.last_holder = holder_of(soonest)
        return Refused(_ttl_left(soonest) + 0.001)

    # -- reading ------------------------------------------------------------------------

    def holders(self) -> list[Holder]:
        """Every live holder now, soonest expiry first."""
        return [holder_of(row) for row in sorted(self._live_slots().values(),
                                                  key=_ttl_left)]

    def locked(self) -> bool:
        """Whether anyone holds a slot."""
        return bool(self._live_slots())

    def holder(self) -> Holder | None:
        """The holder whose slot frees first (None when nobody holds one)."""
        found = self.holders()
        return found[0] if found else None

    def waiting(self) -> list[str]:
        """Nobody waits in line for a semaphore's slot here (waiters poll)."""
        return []

    def waiting_count(self) -> int:
        """0: see :meth:`waiting`."""
        return 0

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r} limit={self.limit} "
                f"ttl={self.ttl:g}s depth={self._depth} fence={self._fence}>")


def semaphores(slots: Iterable[HoldInfo]) -> Iterator[HoldInfo]:
    """The live slot holds under a slots' prefix as one :class:`HoldInfo` per
    semaphore (by name): the fields of its holder whose slot frees first, ``limit``
    (the largest its holders were made with) and every holder."""
    by_name: dict[str, list[HoldInfo]] = {}
    for info in slots:
        by_name.setdefault(info.key, []).append(info)
    for name in sorted(by_name):
        holds = sorted((_plain(h) for h in by_name[name]),
                       key=lambda h: (h.ttl is None, h.ttl or 0.0))
        limit = max(_limit_of(h) for h in by_name[name])
        yield dataclasses.replace(holds[0], limit=limit, holders=tuple(holds))


def slot_of(info: HoldInfo) -> int | None:
    """The slot of a slot hold (None: not one)."""
    text = info.extra.get(SLOT_FIELD)
    return int(text) if text is not None and text.isdigit() else None


def _limit_of(info: HoldInfo) -> int:
    text = info.extra.get(LIMIT_FIELD)
    return int(text) if text is not None and text.isdigit() else 1


def _plain(info: HoldInfo) -> HoldInfo:
    """A slot hold without the slot's own fields in ``extra``."""
    extra = {k: v for k, v in info.extra.items() if k not in (LIMIT_FIELD, SLOT_FIELD)}
    return dataclasses.replace(info, extra=extra)
