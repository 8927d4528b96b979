"""The contract between the Celery face (and the operators' tools) and a backend.

Two protocols, and the reply codes every backend speaks:

* :class:`Lock` is what a user, :class:`~celery_dlock.LockedTask`, the CLI and the
  scheduler may ask of a lock object, whatever keeps it (one Redis, a Redlock quorum,
  later a database or ZooKeeper).  Every lock kind gets it from
  :class:`~celery_dlock.core.hold.Hold`, the one hold state machine.
* :class:`Backend` is what the Celery face and ``celery dlock`` ask of a place that
  keeps locks: make a lock for a name, read a holder, list holds, free one by force.
  ``task/`` and ``ops/`` reach a backend through this protocol only (import-linter
  checks that the only module of theirs that names a backend is the one that chooses
  it from the configuration).

What a backend can do beyond locks of one holder is in its ``capabilities``
(:mod:`celery_dlock.core.registry`): one with ``rates`` has a ``rates()`` method
returning a :class:`RateStore` (``lock_rate``), one with ``markers`` a ``markers()``
method (enqueue-time uniqueness); one without refuses them.

Nothing here imports a driver or Celery.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, NamedTuple, Protocol, runtime_checkable

from .errors import Holder
from .holds import HoldInfo
from .lock_options import LockOptions
from .rates import Rate, RateDecision, RateState
from .store_check import Problem

__all__ = [
    "GONE",
    "NOT_GRANTED",
    "OK",
    "STILL_HELD",
    "TAKEN",
    "Backend",
    "Grant",
    "Lock",
    "RateStore",
    "Refused",
    "new_op_id",
]

# -- reply codes, named once --------------------------------------------------------
# Every server-side operation answers with one of these (the Redis scripts return them
# as the first element of their reply; see celery_dlock/backends/redis/scripts.py, whose
# test holds the Lua literals equal to these).

#: Acquired, released (the hold is gone), renewed or extended.
OK = 1
#: A release that undid one acquire of several: the owner still holds the lock.
STILL_HELD = 2
#: Nobody holds the lock (it expired, was released by force, or its data was lost);
#: for an acquire that expected to re-enter, the owner's hold is no longer there.
GONE = 0
#: Another owner holds the lock.
TAKEN = -1
#: An acquire that was not granted (the lock is held by another owner, or promised to
#: the first waiter in line).
NOT_GRANTED = 0


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


@runtime_checkable
class Lock(Protocol):
    """A reentrant, renewed, owner-checked lock (:class:`~celery_dlock.RedisLock`'s
    surface).  ``fence`` raises :class:`~celery_dlock.FencingUnavailable` on a kind
    that gives no fencing token; :attr:`fences` says which."""

    name: str
    on_lost: Callable[[Any], object] | None
    #: What the last failed acquire learned about the holder (None: nothing).
    last_holder: Holder | None

    @property
    def ttl(self) -> float: ...

    @property
    def fences(self) -> bool:
        """Whether :attr:`fence` gives fencing tokens on this kind of lock."""
        ...

    @property
    def depth(self) -> int: ...

    @property
    def lost(self) -> bool: ...

    @property
    def lost_reason(self) -> str | None:
        """Why the current (or last) hold was found lost; None when it was not."""
        ...

    @property
    def fence(self) -> int | None: ...

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool: ...

    def release(self) -> None: ...

    def release_all(self) -> int: ...

    def extend(self, ttl: float | None = None) -> None: ...

    def locked(self) -> bool: ...

    def owned(self) -> bool: ...

    def ensure_held(self) -> None: ...

    def holder(self) -> Holder | None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None: ...


class Backend(Protocol):
    """A place that keeps locks (one Redis server, a Cluster, a Redlock quorum, ...).

    Names are lock names (``stock:42``), never a backend's own keys; ``prefix`` is the
    namespace (``dlock_key_prefix``).
    """

    #: Short name for messages and ``celery dlock`` (``redis``, ``redlock``).
    kind: str
    #: Whether its locks give fencing tokens.
    fences: bool
    #: What it can do beyond locks of one holder (:mod:`celery_dlock.core.registry`:
    #: markers, limit, rates, fencing, inspect, history); the Celery face checks these,
    #: never the URL.
    capabilities: frozenset[str]

    def lock(self, options: LockOptions) -> Lock:
        """A lock object made with ``options`` (no server call); ``max_hold``: see
        :mod:`celery_dlock.core.max_hold`; with ``limit`` > 1 a semaphore: that many
        owners may hold it at once, each hold with the whole surface of a lock (a
        backend that cannot raises InvalidLockConfig)."""
        ...

    def read(self, prefix: str, name: str) -> HoldInfo | None:
        """The hold of ``name`` as the server shows it now (None: free)."""
        ...

    def holds(self, prefix: str) -> Iterator[HoldInfo]:
        """Every hold under ``prefix``, each once."""
        ...

    def waiting(self, prefix: str, names: Iterable[str]) -> dict[str, int]:
        """How many owners wait in line for each of ``names``."""
        ...

    def storage_key(self, prefix: str, name: str) -> str:
        """Where the server keeps the hold of ``name`` (shown to operators)."""
        ...

    def check(self, prefix: str) -> list[Problem]:
        """Whether the store can keep locks under ``prefix``: one problem each (none:
        usable); :class:`BackendUnavailable` when it does not answer
        (:mod:`celery_dlock.core.store_check`)."""
        ...

    def force_release(self, prefix: str, name: str, *, fence: int | None = None,
                      by: str | None = None, reason: str | None = None,
                      conditions: Mapping[str, str] | None = None) -> HoldInfo | None:
        """Free ``name`` whoever holds it (only the hold with ``fence``, or whose
        metadata matches ``conditions``, when given); the hold freed, or None.  The
        holder is told at its next contact, with ``by`` and ``reason``."""
        ...


class RateStore(Protocol):
    """Per-name rates kept on a backend's servers (``lock_rate``; the rule is
    :mod:`celery_dlock.core.rates`), every time on the server's clock."""

    def take(self, prefix: str, name: str, rate: Rate,
             slot: int | None = None) -> RateDecision:
        """May a call of ``name`` start now under ``rate``?  Either it may, or the
        next free slot is reserved for it.  ``slot``: the slot a parked call was given
        and comes back for (it may start from then until one interval later; before,
        it is told to wait again for the same slot; after, it asks afresh)."""
        ...

    def state(self, prefix: str, name: str) -> RateState | None:
        """The rate of ``name`` as the server keeps it now (None: no call lately)."""
        ...

    def states(self, prefix: str) -> Iterator[tuple[str, RateState]]:
        """Every name under ``prefix`` with a rate state, each once."""
        ...
