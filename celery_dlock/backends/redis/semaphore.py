"""``RedisSemaphore``: ``limit`` leased, renewed, fenced slots on one Redis.

Each slot is a hold with everything a :class:`~celery_dlock.RedisLock` hold has (an
owner, a count for re-entry, its own fencing token, its ttl on the server's clock,
operation ids), so the bookkeeping is the one every lock kind shares,
:class:`~celery_dlock.core.hold.Hold`: re-entry by the same owner takes no second
slot, a loss is reported once, the heartbeat renews it, a re-sent script changes
nothing twice.  With ``limit=1`` it behaves as a lock.  Blocked acquirers wait in one
FIFO line and are woken by a release (the doorbells of
:mod:`celery_dlock.backends.redis.waiters`), never by polling.  The keys and scripts:
:mod:`celery_dlock.backends.redis.semaphore_scripts`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ...core.errors import (
    DLockError,
    Holder,
    LockKeyConflict,
)
from ...core.lock_args import DEFAULT_PREFIX
from ...core.lock_options import LockOptions, check_limit
from ...core.process import after_fork
from ...core.protocol import new_op_id
from ...core.scheduler import RenewalScheduler
from .calls import RedisHold
from .keyspace import (
    UNTOUCHED,
    LockKeys,
    check_client,
    decode,
    parse_holder,
)
from .released import read_loss_reason
from .renewal import RedisRenewTarget, shared_by
from .semaphore_scripts import (
    SEM_ACQUIRE,
    SEM_EXTEND,
    SEM_LEAVE_QUEUE,
    SEM_READ,
    SEM_RELEASE,
    SEM_RENEW_MANY,
    SEM_STATUS,
)

__all__ = ["RedisSemaphore", "check_limit", "read_holders"]

logger = logging.getLogger("celery_dlock.lock")


def _parse_read(reply: Sequence[Any]) -> tuple[int, list[tuple[int, list[Any]]]]:
    """SEM_READ's reply: the server's clock (ms) and each live holder's (pttl, hash)."""
    now_ms = int(reply[0]) * 1000 + int(reply[1]) // 1000
    out: list[tuple[int, list[Any]]] = []
    i = 3
    for _ in range(int(reply[2])):
        pttl, n = int(reply[i]), int(reply[i + 1])
        out.append((pttl, list(reply[i + 2:i + 2 + n])))
        i += 2 + n
    return now_ms, out


def read_holders(client: Any, key: str) -> tuple[int, list[tuple[int, list[Any]]]]:
    """The live holders of the semaphore whose sorted set is ``key``: the server's
    clock (ms) and, soonest expiry first, each one's remaining ttl (ms) and hash
    (flat field/value list)."""
    return _parse_read(SEM_READ(client, (key,), ()))


class RedisSemaphore(RedisHold):
    """``limit`` holders at once of one name, on one Redis (or one Cluster slot).

    The same surface as :class:`~celery_dlock.RedisLock` (``acquire(blocking,
    timeout)``, ``release``, ``extend``, ``owned``, ``ensure_held``, ``fence``, a
    context manager), and the same parameters, plus ``limit``: how many owners may
    hold it at once.  Each hold has its own fencing token; the same owner re-enters
    its own slot.  Every process that uses one name must give it the same limit.
    """

    keys: LockKeys
    _acquire_script = SEM_ACQUIRE
    _extend_script = SEM_EXTEND

    def __init__(
        self,
        client: Any,
        name: str,
        limit: int,
        ttl: float = 30.0,
        *,
        auto_renew: bool = True,
        owner: str | None = None,
        on_lost: Callable[[RedisSemaphore], object] | None = None,
        prefix: str = DEFAULT_PREFIX,
        info: Mapping[str, object] | None = None,
        blocking_timeout: float | None = None,
        scheduler: RenewalScheduler | None = None,
        pause_budget: float | None = None,
        max_hold: float | None = None,
        fence_ttl: float | None = None,
    ) -> None:
        self._open(client, LockOptions(
            name, ttl, prefix=prefix, owner=owner, on_lost=on_lost, info=info,
            blocking_timeout=blocking_timeout, scheduler=scheduler,
            auto_renew=auto_renew, pause_budget=pause_budget, max_hold=max_hold,
            limit=check_limit(limit, name), fence_ttl=fence_ttl))

    def _open(self, where: Any, options: LockOptions) -> None:
        self.limit = options.limit
        check_client(where, options.name)
        super().__init__(options)
        self.client = where
        self.keys = LockKeys.for_name(options.prefix, options.name)

    # -- talking to Redis -----------------------------------------------------------

    def _extra_args(self) -> tuple[Any, ...]:
        return (self.limit, self.options.fence_ttl_ms)

    def _lock_keys(self) -> LockKeys:
        return self.keys

    def _error(self, exc: RedisError, what: str) -> DLockError:
        if isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc):
            return LockKeyConflict(self._foreign_keys(), lock_name=self.name)
        return super()._error(exc, what)

    def _foreign_keys(self) -> str:
        """A sentence naming the keys of this semaphore that hold another kind of
        data (a lock's hash of the same name, another application's)."""
        found = []
        for key, expected in ((self.keys.lock, "zset"), (self.keys.fence, "string"),
                              (self.keys.queue, "zset"), (self.keys.leases, "zset")):
            try:
                kind = decode(self.client.type(key))
            except RedisError:
                continue
            if kind not in ("none", expected):
                found.append(f"{key!r} holds a {kind}, not a {expected}")
        what = "; ".join(found) or \
            f"a key of semaphore {self.keys.lock!r} holds another kind of data"
        return f"{what} (a lock of the same name, or another application's): " \
            f"{UNTOUCHED}"

    def _leave_line(self, owner: str) -> None:
        try:
            SEM_LEAVE_QUEUE(self.client, (self.keys.lock,), (owner, self.limit))
        except RedisError as exc:  # our lease lapses by itself
            logger.debug("could not leave the line of %r: %s", self.name, exc)

    def _give_back(self, owner: str) -> None:
        try:
            self._run(SEM_RELEASE, (owner, new_op_id(), self.limit))
        except DLockError as exc:  # it expires by itself
            logger.debug("could not give back %r: %s", self.name, exc)

    def _send_release(self, owner: str, op: str) -> int:
        return int(self._run(SEM_RELEASE, (owner, op, self.limit))[0])

    def _read_status(self, owner: str) -> int:
        return int(self._run(SEM_STATUS, (owner,)))

    def _renew_target(self) -> Any:
        return semaphore_renew_target(self.client)

    def _renew_key(self) -> str:
        return self.keys.lock

    def _explain_loss(self, default: str, owner: str, fence: int | None) -> str:
        """``default``, or who released this hold by force and why (the marker a
        force release of one hold leaves, as a lock's)."""
        return read_loss_reason(self.client, self.keys.lock, owner, fence) or default

    # -- reading --------------------------------------------------------------------

    def holders(self) -> list[Holder]:
        """Every live holder now, soonest expiry first."""
        now_ms, live = _parse_read(self._run(SEM_READ, ()))
        return [parse_holder(fields, pttl, now_ms) for pttl, fields in live]

    def locked(self) -> bool:
        """Whether anyone holds a slot."""
        return bool(self.holders())

    def holder(self) -> Holder | None:
        """The holder whose slot frees first (None when nobody holds one)."""
        found = self.holders()
        return found[0] if found else None

    def __repr__(self) -> str:
        return (f"<RedisSemaphore {self.name!r} limit={self.limit} ttl={self.ttl:g}s "
                f"depth={self._depth} fence={self._fence}>")


class SemaphoreRenewTarget(RedisRenewTarget):
    """Renews semaphore holds on the server of one client with ``SEM_RENEW_MANY``
    (on its own connection, as :class:`~.renewal.RedisRenewTarget`)."""

    script = SEM_RENEW_MANY


_targets: weakref.WeakKeyDictionary[Any, SemaphoreRenewTarget] = \
    weakref.WeakKeyDictionary()
_targets_lock = threading.Lock()


def semaphore_renew_target(client: Any) -> SemaphoreRenewTarget:
    """The semaphore renew target of ``client`` (one per connection pool, see
    :func:`.renewal.shared_by`, and process)."""
    owner = shared_by(client)
    with _targets_lock:
        try:
            return _targets[owner]
        except KeyError:
            target = _targets[owner] = SemaphoreRenewTarget(client)
            return target
        except TypeError:
            return SemaphoreRenewTarget(client)


def _after_fork_in_child() -> None:
    global _targets, _targets_lock
    _targets = weakref.WeakKeyDictionary()
    _targets_lock = threading.Lock()


after_fork(_after_fork_in_child)


def decode_all(flat: Sequence[Any]) -> dict[str, str]:
    """A flat field/value list as a dict of text."""
    return {decode(flat[i]): decode(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
