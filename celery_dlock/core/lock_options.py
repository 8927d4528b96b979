"""A lock's options, as one frozen, checked object: :class:`LockOptions`.

A lock's name, ttl, prefix, owner, metadata, timeouts, renewal, pause budget, max
hold and limit are checked once, where the object is made (a task's settings, a
standalone ``RedisLock(...)``, ``lock_from_url(...)``), and every lock kind and
backend reads them from it: ``Backend.lock(options)`` takes one, each lock kind's
``with_options(where, options)`` makes a lock of it, and the hold state machine
(:class:`~celery_dlock.core.hold_state.HoldState`) keeps it.  A bad option is an
:class:`~celery_dlock.core.errors.InvalidLockConfig` naming the lock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .errors import InvalidLockConfig
from .lock_args import DEFAULT_PREFIX, check_lock_options
from .max_hold import check_max_hold
from .ttl import ttl_ms

if TYPE_CHECKING:
    from .scheduler import RenewalScheduler

__all__ = ["DEFAULT_FENCE_TTL", "LockOptions", "check_fence_ttl", "check_limit"]

#: Seconds a name's fence counter is kept after its last hold (docs/fencing.md).
DEFAULT_FENCE_TTL = 86400.0


def check_limit(limit: Any, name: str | None = None) -> int:
    """``limit`` when it is an int >= 1 (how many holders at once), else
    InvalidLockConfig."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidLockConfig(f"a semaphore's limit must be an int >= 1 (how many "
                                f"holders at once), got {limit!r}", lock_name=name)
    return limit


def check_fence_ttl(fence_ttl: Any, ttl: float, name: str) -> int:
    """The fence ttl in ms: ``fence_ttl`` seconds when it is a number in (0, 30 days]
    not shorter than ``ttl`` (else InvalidLockConfig naming both), or for None a day,
    or ``ttl`` when that is longer."""
    if fence_ttl is None:
        return max(round(DEFAULT_FENCE_TTL * 1000), ttl_ms(ttl, "ttl", name))
    fence_ms = ttl_ms(fence_ttl, "fence_ttl", name)
    if fence_ttl < ttl:
        raise InvalidLockConfig(
            f"fence_ttl ({fence_ttl!r} s, how long a name's fence counter is kept after "
            f"its last hold) may not be shorter than the lock's ttl ({ttl!r} s)",
            lock_name=name)
    return fence_ms


@dataclasses.dataclass(frozen=True)
class LockOptions:
    """What a lock is made with (see :class:`~celery_dlock.RedisLock` for each).

    :param name: the lock's name (non-empty, UTF-8).
    :param ttl: seconds a hold lives after its last acquire, extend or renewal.
    :param prefix: the namespace of the lock's keys, rows or nodes.
    :param owner: a fixed owner token, or None for the current context's owner.
    :param on_lost: called once per lost hold with the lock.
    :param info: metadata stored with each hold (``host`` is added).
    :param blocking_timeout: how long ``with lock:`` and a plain ``acquire()`` wait.
    :param scheduler: the renewal registry (default: this process's).
    :param auto_renew: renew the hold from the scheduler every ``ttl/3``.
    :param pause_budget: seconds a holder may be frozen at its deadline and still be
        told first (None: a tenth of the ttl, at most 2 s).
    :param max_hold: seconds after which a hold is no longer renewed (None: never).
    :param limit: how many holders at once (above 1: a semaphore, on a backend that
        keeps them).
    :param fence_ttl: seconds the name's fence counter is kept after its last grant
        or release (Redis; at least ``ttl``; None: a day, or ``ttl`` when longer;
        see docs/fencing.md).
    """

    name: str
    ttl: float = 30.0
    prefix: str = DEFAULT_PREFIX
    owner: str | None = None
    on_lost: Callable[[Any], object] | None = None
    info: Mapping[str, object] | None = None
    blocking_timeout: float | None = None
    scheduler: RenewalScheduler | None = None
    auto_renew: bool = True
    pause_budget: float | None = None
    max_hold: float | None = None
    limit: int = 1
    fence_ttl: float | None = None
    #: ``info`` with ``host`` added, as flat field/value strings (set when made).
    info_args: tuple[str, ...] = dataclasses.field(init=False, default=())
    #: The fence ttl in whole milliseconds (set when made).
    fence_ttl_ms: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        info_args = check_lock_options(self.name, self.prefix, self.owner,
                                       self.blocking_timeout, self.info,
                                       self.pause_budget)
        ttl_ms(self.ttl, "ttl", self.name)
        check_max_hold(self.max_hold, self.name)
        check_limit(self.limit, self.name)
        object.__setattr__(self, "fence_ttl_ms",
                           check_fence_ttl(self.fence_ttl, self.ttl, self.name))
        frozen = None if self.info is None else MappingProxyType(dict(self.info))
        object.__setattr__(self, "info", frozen)
        object.__setattr__(self, "info_args", tuple(info_args))

    @property
    def info_fields(self) -> dict[str, str]:
        """The metadata stored with each hold (``host`` included), by field."""
        args = self.info_args
        return dict(zip(args[::2], args[1::2], strict=True))

    def replace(self, **changes: Any) -> LockOptions:
        """These options with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)
