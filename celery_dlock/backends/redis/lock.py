"""``RedisLock``: a reentrant, renewed, owner-checked lock on one Redis.

Ownership, on a timeline (A and B are owners, see :mod:`celery_dlock.core.owner`)::

    t0  A.acquire()    hash {owner: A, count: 1, fence: 7}, expires at t0 + ttl
    t1  A.acquire()    re-entry: count 2, same fence 7
    t2  B.acquire()    contention: B learns A's remaining ttl and metadata, and (when
                       blocking) joins the line and sleeps on its doorbell
    t3  A.release()    count 1: still held
    t4  A.release()    count 0: key deleted, B's doorbell rings
    t5  B acquires     fence 9 (fences only grow, also across a data loss)
    t6  A.release()    "not owner": raises LockNotOwned; B's hold is untouched

While held, the process's scheduler renews the hold every ``ttl/3`` and watches its
local deadline (see :mod:`celery_dlock.core.scheduler`); when the deadline passes without
a confirmed renewal, or the hold is found gone or taken, it is marked lost,
``on_lost(lock)`` is called, :meth:`owned` returns False and :meth:`ensure_held`
raises :class:`LockLost`, all before any other owner can acquire it.

Every call that changes a hold carries an operation id, so a command that redis-py
re-sends after a lost reply changes nothing the second time.  The bookkeeping (depth,
deadline, kept operation ids, losses) is the one every lock kind shares,
:class:`~celery_dlock.core.hold.Hold`; this module only says how to talk to Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from redis.exceptions import RedisError

from ...core.errors import DLockError, Holder, InvalidLockConfig
from ...core.lock_args import DEFAULT_PREFIX, acquire_timeout
from ...core.lock_options import LockOptions
from ...core.protocol import new_op_id
from ...core.renew_target import RenewTarget
from ...core.scheduler import RenewalScheduler
from .calls import RedisHold
from .keyspace import LockKeys, check_client, decode, parse_holder
from .released import read_loss_reason
from .renewal import renew_target
from .scripts import ACQUIRE, EXTEND, LEAVE_QUEUE, READ_HOLD, RELEASE

__all__ = ["DEFAULT_PREFIX", "RedisLock", "acquire_timeout"]

logger = logging.getLogger("celery_dlock.lock")


class RedisLock(RedisHold):
    """A reentrant distributed lock on one Redis (or one Redis Cluster slot).

    :param client: a synchronous ``redis.Redis`` (or ``RedisCluster``) client.
    :param name: the lock's name; any non-empty string.
    :param ttl: seconds a hold lives after its last acquire, extend or renewal (at most
        :data:`MAX_TTL`).
    :param auto_renew: renew the hold from this process's scheduler every ``ttl/3``.
    :param owner: a fixed owner token (processes that share it share the hold); by
        default the current context's owner, else a per-thread token.
    :param on_lost: called once per lost hold with this lock, from the thread that found
        out (the scheduler's watchdog at the hold's deadline, or a caller of acquire,
        ensure_held, owned, extend or release).  Keep it short: it runs before other
        holds' news.
    :param prefix: the key prefix (``dlock``).
    :param info: metadata stored with each fresh hold (shown by ``celery dlock ls`` and
        in :class:`LockNotAcquired`); ``host`` and ``pid`` are always added.
    :param blocking_timeout: how long a blocking :meth:`acquire` (and ``with lock:``)
        waits when the call gives no timeout (None: forever), as in redis-py's ``Lock``.
    :param scheduler: the renewal registry to use (default: this process's).
    :param pause_budget: seconds this holder may be frozen at its deadline and still be
        told first (default: a tenth of the ttl, at most 2 s; see
        :mod:`celery_dlock.core.deadline`).
    :param max_hold: seconds after which the hold is no longer renewed and is reported
        lost with the reason "max hold of ...s reached" (None: unbounded; at least
        ``ttl``; see :mod:`celery_dlock.core.max_hold`).
    :param fence_ttl: seconds the name's fence counter is kept after its last grant or
        release (at least ``ttl``; None: a day, or ``ttl`` when longer): fences
        strictly increase unless the server's clock steps back by more than this
        (docs/fencing.md).

    Every Redis failure surfaces as :class:`BackendUnavailable` (connection refused or
    reset, timeouts, a read-only replica after failover, a refused command), and data of
    another application under a lock's key as :class:`LockKeyConflict`.
    """

    keys: LockKeys
    _acquire_script = ACQUIRE
    _extend_script = EXTEND

    def __init__(
        self,
        client: Any,
        name: str,
        ttl: float = 30.0,
        *,
        auto_renew: bool = True,
        owner: str | None = None,
        on_lost: Callable[[RedisLock], object] | None = None,
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
            fence_ttl=fence_ttl))

    def _open(self, where: Any, options: LockOptions) -> None:
        if options.limit != 1:
            raise InvalidLockConfig(f"a RedisLock has one holder, got limit "
                                    f"{options.limit!r} (a RedisSemaphore has several)",
                                    lock_name=options.name)
        check_client(where, options.name)
        super().__init__(options)
        self.client = where
        self.keys = LockKeys.for_name(options.prefix, options.name)

    # -- talking to Redis (the rest: RedisHold) -------------------------------------

    def _lock_keys(self) -> LockKeys:
        return self.keys

    def _leave_line(self, owner: str) -> None:
        try:
            LEAVE_QUEUE(self.client, (self.keys.lock,), (owner,))
        except RedisError as exc:  # our lease lapses by itself
            logger.debug("could not leave the line of %r: %s", self.name, exc)

    def _give_back(self, owner: str) -> None:
        try:
            self._run(RELEASE, (owner, new_op_id(), "", "", self.options.fence_ttl_ms))
        except DLockError as exc:  # it expires by itself
            logger.debug("could not give back %r: %s", self.name, exc)

    def _send_release(self, owner: str, op: str) -> int:
        # The hold's fence lets a re-send of the final release (its reply lost) learn
        # that it freed the lock: no marker key is left behind for it.
        fence = "" if self._fence is None else str(self._fence)
        return int(self._run(RELEASE, (owner, op, fence, "",
                                        self.options.fence_ttl_ms))[0])

    def _read_status(self, owner: str) -> int:
        holder = self._command(self.client.hget, self.keys.lock, "owner")
        if holder is None:
            return 0
        return 1 if decode(holder) == owner else -1

    def _renew_target(self) -> RenewTarget | None:
        target: RenewTarget = renew_target(self.client, self.keys.lock)
        return target

    def _renew_key(self) -> str:
        return self.keys.lock

    def _explain_loss(self, default: str, owner: str, fence: int | None) -> str:
        """``default``, or who released this hold by force and why, when a force
        release left its marker (one more round trip, only once the hold is gone)."""
        return read_loss_reason(self.client, self.keys.lock, owner, fence) or default

    # -- reading --------------------------------------------------------------------

    def locked(self) -> bool:
        """Whether anyone holds the lock."""
        return bool(self._command(self.client.exists, self.keys.lock))

    def holder(self) -> Holder | None:
        """Who holds the lock now (None when free)."""
        reply = self._run(READ_HOLD, ())
        if len(reply) <= 3:
            return None
        pttl, secs, usecs = (int(x) for x in reply[:3])
        return parse_holder(reply[3:], pttl, secs * 1000 + usecs // 1000)

    def __repr__(self) -> str:
        return (f"<RedisLock {self.name!r} ttl={self.ttl:g}s depth={self._depth} "
                f"fence={self._fence}>")
