"""What every SQL dialect's backend shares: :class:`LeaseBackend`, the place that
keeps lease-row locks behind :class:`~celery_dlock.core.protocol.Backend`
(PostgreSQL: :mod:`.postgres.backend`, MySQL/MariaDB: :mod:`.mysql.backend`).  How
a hold is read, listed and freed by force is the dialect's.

No driver is imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar, cast

from ...core.holds import HoldChanged, HoldInfo
from ...core.lock_options import LockOptions
from ...core.registry import entry_named
from ...core.store_check import Problem, probe
from .lease import LeaseLock
from .markers import SqlMarkers
from .rates import SqlRates
from .slots import semaphores, shown_key, slot_name, slot_of, slot_prefix

__all__ = ["LeaseBackend"]


class Server(Protocol):
    """What the shared part asks of a dialect's server object."""

    @property
    def shown(self) -> str: ...

    @property
    def table_name(self) -> str: ...


S = TypeVar("S", bound=Server)
L = TypeVar("L", bound=LeaseLock[Any])


class LeaseBackend(Generic[S, L]):
    """The locks kept in one SQL server's lease table (the dialect subclasses it)."""

    #: The dialect's name in the backend registry (:mod:`celery_dlock.core.registry`).
    kind = ""
    fences = True
    #: What it can do: its registry entry's capabilities, read once per dialect.
    capabilities: frozenset[str] = frozenset()
    server: S

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.capabilities = entry_named(cls.kind).capabilities

    def __init__(self, url: str | S) -> None:
        self.server = cast(S, self.lock_class.server_of(url))

    #: The dialect's lock class (it knows the dialect's server objects).
    lock_class: type[L]
    #: The dialect's semaphore class (``lock_limit`` above 1: :mod:`.slots`).
    semaphore_class: type[LeaseLock[Any]]
    #: The dialect's rates (``lock_rate``), made of its server object.
    rates_class: Callable[[Any], SqlRates]

    #: The dialect's queue markers (a ``lock_mode``), made of its server object.
    markers_class: Callable[[Any], SqlMarkers]

    def rates(self) -> SqlRates:
        """Per-name rates (``lock_rate``), in the lease table's ``_rates`` table
        (made at the first take of a process)."""
        found: SqlRates | None = getattr(self, "_rates", None)
        if found is None:
            found = self._rates = self.rates_class(self.server)
        return found

    def markers(self) -> SqlMarkers:
        """Queue markers (a ``lock_mode`` other than ``while_running``), in the
        lease table's ``_markers`` table (made at the first marker step of a
        process)."""
        found: SqlMarkers | None = getattr(self, "_markers", None)
        if found is None:
            found = self._markers = self.markers_class(self.server)
        return found


    def lock(self, options: LockOptions) -> LeaseLock[Any]:
        """A lock of ``options``; with ``limit`` above 1 a semaphore of that many
        slots (:mod:`.slots`)."""
        if options.limit != 1:
            return self.semaphore_class.with_options(self.server, options)
        return self.lock_class.with_options(self.server, options)

    # -- what the dialect provides: a lock's row read, listed, freed ------------------

    def _read_lock(self, prefix: str, name: str) -> HoldInfo | None:
        """The live hold of the lock row of ``(prefix, name)`` (None: free)."""
        raise NotImplementedError

    def _lock_holds(self, prefix: str) -> Iterator[HoldInfo]:
        """Every live hold of a lock row under ``prefix``."""
        raise NotImplementedError

    def _force_lock(self, prefix: str, name: str, *, fence: int | None,
                    by: str | None, reason: str | None,
                    conditions: Mapping[str, str] | None,
                    waiters: tuple[str, str] | None = None) -> HoldInfo | None:
        """Free the lock row of ``(prefix, name)``, as :meth:`force_release` says;
        ``waiters``: the (prefix, name) whose waiters are told (None: its own)."""
        raise NotImplementedError

    # -- locks and semaphores, as the operators' tools see them ------------------------

    def read(self, prefix: str, name: str) -> HoldInfo | None:
        """The hold of ``name``: a lock's, or a semaphore's with its holders."""
        found = self._read_lock(prefix, name)
        return found if found is not None else next(iter(
            semaphores(self._slots_of(prefix, name))), None)

    def holds(self, prefix: str) -> Iterator[HoldInfo]:
        """Every hold under ``prefix``: each lock, and each semaphore once."""
        found = [*self._lock_holds(prefix),
                 *semaphores(self._lock_holds(slot_prefix(prefix)))]
        yield from sorted(found, key=lambda info: info.key)

    def _slots_of(self, prefix: str, name: str) -> list[HoldInfo]:
        """The live slot holds of semaphore ``name``."""
        key = shown_key(name)
        return [info for info in self._lock_holds(slot_prefix(prefix))
                if info.key == key and slot_of(info) is not None]

    def force_release(self, prefix: str, name: str, *, fence: int | None = None,
                      by: str | None = None, reason: str | None = None,
                      conditions: Mapping[str, str] | None = None) -> HoldInfo | None:
        """Free ``name``: a lock's hold, or a semaphore's holds that match (``fence``,
        ``conditions``; neither: every holder), returned as the semaphore with the
        freed holds as its ``holders`` (None: nothing freed)."""
        found = self._force_lock(prefix, name, fence=fence, by=by, reason=reason,
                                 conditions=conditions)
        if found is not None:
            return found
        freed = []
        for slot in self._slots_of(prefix, name):
            if fence is not None and slot.fence != fence:
                continue
            try:
                got = self._force_lock(
                    slot_prefix(prefix), slot_name(name, cast(int, slot_of(slot))),
                    fence=slot.fence, by=by, reason=reason, conditions=conditions,
                    waiters=(prefix, name))
            except HoldChanged:
                continue  # the slot changed hands meanwhile: not the hold asked for
            if got is not None:
                freed.append(got)
        return next(iter(semaphores(freed)), None)

    def storage_key(self, prefix: str, name: str) -> str:
        return f"{self.server.table_name}[{prefix}, {name}]"

    def check(self, prefix: str) -> list[Problem]:
        """The probe lock: a table it cannot create or use, a missing grant, a server
        that refuses show there, in the dialect's words."""
        return probe(self, prefix)

    @staticmethod
    def _not_freed(name: str, found: HoldInfo, fence: int | None) -> None:
        """A force release that freed nothing: :class:`HoldChanged` when the hold
        found is not the one of ``fence``."""
        if fence is not None and found.fence != fence:
            raise HoldChanged(f"lock {name!r} is now held by another hold (fence "
                              f"{found.fence}, not {fence}): nothing was freed",
                              lock_name=name, current=found)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.server.shown}>"
