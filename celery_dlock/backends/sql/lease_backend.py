"""What every SQL dialect's backend shares: :class:`LeaseBackend`, the place that
keeps lease-row locks behind :class:`~celery_dlock.core.protocol.Backend`
(PostgreSQL: :mod:`.postgres.backend`, MySQL/MariaDB: :mod:`.mysql.backend`).  How
a hold is read, listed and freed by force is the dialect's.

No driver is imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar, cast

from ...core.errors import InvalidLockConfig
from ...core.holds import HoldChanged, HoldInfo
from ...core.lock_options import LockOptions
from ...core.registry import entry_named
from ...core.store_check import Problem, probe
from .lease import LeaseLock
from .markers import SqlMarkers
from .rates import SqlRates

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


    def lock(self, options: LockOptions) -> L:
        if options.limit != 1:
            raise InvalidLockConfig(
                f"lock_limit={options.limit!r}: the {self.kind} backend keeps locks of "
                f"one holder; semaphores (lock_limit > 1) need a Redis backend "
                f"(docs/backends.md)", lock_name=options.name)
        return self.lock_class.with_options(self.server, options)

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
