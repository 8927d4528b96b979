"""``RedisLock``: a reentrant, renewed, owner-checked lock on one Redis.

Ownership, on a timeline (A and B are owners, see :mod:`celery_dlock.core.owner`)::

    t0  A.acquire()    hash {owner: A, count: 1, fence: 7}, expires at t0 + ttl
    t1  A.acquire()    re-entry: count 2, same fence 7
    t2  B.acquire()    contention: B learns A's remaining ttl and metadata, and (when
                       blocking) joins the line and sleeps on its doorbell
    t3  A.release()    count 1: still held
    t4  A.release()    count 0: key deleted, B's doorbell rings
    t5  B acquires     fence 8 (fences only grow)
    t6  A.release()    "not owner": raises LockNotOwned; B's hold is untouched

While held, the process's heartbeat renews the hold every ``ttl/3`` and watches its
local deadline (see :mod:`celery_dlock.core.heartbeat`); when the deadline passes without
a confirmed renewal, or the hold is found gone or taken, it is marked lost,
``on_lost(lock)`` is called, :meth:`owned` returns False and :meth:`ensure_held`
raises :class:`LockLost`, all before any other owner can acquire it.

Every call that changes a hold carries a fresh operation id, so a command that redis-py
re-sends after a lost reply changes nothing the second time, and the local view (hold
count, deadline) changes only after the server has confirmed.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ...core.deadline import lease_end
from ...core.errors import (
    BackendUnavailable,
    DLockError,
    Holder,
    LockKeyConflict,
    LockLost,
    LockNotOwned,
)
from ...core.heartbeat import Heartbeat
from ...core.hold import HoldView, acquire_timeout, check_lock_options
from ...core.ttl import ttl_ms as _ttl_to_ms
from .keyspace import LockKeys, check_client, decode, foreign_keys, parse_holder
from .released import read_loss_reason
from .renewal import renew_target
from .scripts import ACQUIRE, EXTEND, LEAVE_QUEUE, READ_HOLD, RELEASE, LuaScript
from .server_checks import check_server
from .waiters import QUEUE_LEASE, WAKE_GRACE, ring_wait, wait_slice

__all__ = ["DEFAULT_PREFIX", "RedisLock"]

logger = logging.getLogger("celery_dlock.lock")

DEFAULT_PREFIX = "dlock"
_hold_ids = itertools.count(1)


def _op_id() -> str:
    """A fresh operation id: lets a script recognise a call it already ran."""
    return os.urandom(8).hex()


class RedisLock(HoldView):
    """A reentrant distributed lock on one Redis (or one Redis Cluster slot).

    :param client: a synchronous ``redis.Redis`` (or ``RedisCluster``) client.
    :param name: the lock's name; any non-empty string.
    :param ttl: seconds a hold lives after its last acquire, extend or renewal (at most
        :data:`MAX_TTL`).
    :param auto_renew: renew the hold from this process's heartbeat every ``ttl/3``.
    :param owner: a fixed owner token (processes that share it share the hold); by
        default the current context's owner, else a per-thread token.
    :param on_lost: called once per lost hold with this lock, from the thread that found
        out (the heartbeat's watchdog at the hold's deadline, or a caller of
        ensure_held, extend or release).  Keep it short: it runs before other holds'
        news.
    :param prefix: the key prefix (``dlock``).
    :param info: metadata stored with each fresh hold (shown by ``celery dlock ls`` and
        in :class:`LockNotAcquired`); ``host`` and ``pid`` are always added.
    :param blocking_timeout: how long a blocking :meth:`acquire` (and ``with lock:``)
        waits when the call gives no timeout (None: forever), as in redis-py's ``Lock``.
    :param heartbeat: the renewal registry to use (default: this process's).

    Every Redis failure surfaces as :class:`BackendUnavailable` (connection refused or
    reset, timeouts, a read-only replica after failover, a refused command), and data of
    another application under a lock's key as :class:`LockKeyConflict`.
    """

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
        heartbeat: Heartbeat | None = None,
    ) -> None:
        info_args = check_lock_options(name, prefix, owner, blocking_timeout, info)
        check_client(client, name)
        super().__init__(name, owner, on_lost, heartbeat)
        self.client = client
        self.prefix = prefix
        self.ttl_ms = _ttl_to_ms(ttl, "ttl", name)
        self.auto_renew = auto_renew
        self.blocking_timeout = blocking_timeout
        self.keys = LockKeys.for_name(prefix, name)
        self._info_args = info_args

    # -- helpers ------------------------------------------------------------------

    @property
    def ttl(self) -> float:
        return self.ttl_ms / 1000.0

    def _error(self, exc: RedisError, what: str) -> DLockError:
        """The DLockError for a failed Redis call."""
        if isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc):
            return LockKeyConflict(foreign_keys(self.client, self.keys),
                                   lock_name=self.name)
        return BackendUnavailable(f"Redis unavailable during {what}: {exc}",
                                  lock_name=self.name)

    def _run(self, script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return script(self.client, keys, args)
        except RedisError as exc:
            raise self._error(exc, script.name) from exc

    def _command(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except RedisError as exc:
            raise self._error(exc, getattr(fn, "__name__", "a command")) from exc

    # -- acquire ------------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None, *,
                blocking_timeout: float | None = None) -> bool:
        """Take the lock (or re-enter it); True when held.

        ``blocking=False`` tries once.  Otherwise waits in line, woken by the release
        of the holder, for at most ``timeout`` seconds (``blocking_timeout`` is
        redis-py's name for it; neither given: the constructor's ``blocking_timeout``;
        ``None`` or ``-1`` there: no limit).  Raises :class:`BackendUnavailable` when
        Redis cannot be reached.
        """
        timeout = acquire_timeout(blocking, timeout, blocking_timeout,
                                  self.blocking_timeout)
        check_server(self.client)
        owner = self._current_owner()
        keys = self.keys
        key_list = (keys.lock,)
        lease_ms = int(QUEUE_LEASE * 1000) if blocking else 0
        args = [owner, self.ttl_ms, lease_ms, _op_id(), "pid", os.getpid(),
                *self._info_args]
        deadline = None if timeout is None else time.monotonic() + timeout
        heartbeat = self._get_heartbeat()
        queued = acquired = False
        try:
            while True:
                sent_at = heartbeat.now()
                reply = self._run(ACQUIRE, key_list, args)
                if reply[0] == 1:
                    if int(reply[2]) > 1 or heartbeat.now() < lease_end(sent_at,
                                                                        self.ttl_ms):
                        acquired = True
                        self._acquired(owner, int(reply[1]), int(reply[2]), sent_at)
                        return True
                    # A fresh hold confirmed after its own deadline may be gone
                    # already: nobody can vouch for it, so give it back and go on
                    # as if it had not been granted.
                    self._give_back(owner)
                    pttl = -1
                    self.last_holder = None
                    args[3] = _op_id()
                else:
                    pttl = int(reply[1])
                    self.last_holder = parse_holder(reply[3:], pttl, int(reply[2]))
                if not blocking:
                    return False
                queued = True
                slice_ = wait_slice(self.client)
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    slice_ = min(slice_, left)
                # An expiry rings no doorbell: wake up when the holder's ttl ends, or
                # when the first in line's grace to take a free lock does.
                slice_ = min(slice_, (pttl / 1000.0 if pttl >= 0 else WAKE_GRACE) + 0.001)
                if slice_ > 0:
                    self._command(ring_wait, self.client, keys.doorbell(owner), slice_)
        finally:
            if queued and not acquired:
                self._leave_queue(owner)

    def _give_back(self, owner: str) -> None:
        logger.warning("lock %r was confirmed after its deadline (a slow link or a "
                       "paused process): giving it back", self.name)
        try:
            self._run(RELEASE, (self.keys.lock,), (owner, _op_id()))
        except DLockError as exc:  # it expires by itself
            logger.debug("could not give back %r: %s", self.name, exc)

    def _leave_queue(self, owner: str) -> None:
        keys = self.keys
        try:
            LEAVE_QUEUE(self.client, (keys.lock,), (owner,))
        except RedisError as exc:  # our lease lapses by itself
            logger.debug("could not leave the line of %r: %s", self.name, exc)

    def _acquired(self, owner: str, fence: int, count: int, sent_at: float) -> None:
        heartbeat = self._get_heartbeat()
        with self._state:
            self._sync_generation()
            if (self._depth == 0 or count == 1 or self._lost_reason is not None
                    or owner != self._hold_owner):
                # A fresh hold (a hold of this object that Redis no longer knows, or
                # that was lost, is over: start anew with a new hold id).
                self._depth = 0
                self._hold_id = next(_hold_ids)
                self._hold_owner = owner
                self._fence = fence
                self._lost_reason = None
                target = (renew_target(self.client, self.keys.lock) if self.auto_renew
                          else None)
                heartbeat.register(self, self._hold_id, target, self.keys.lock, owner,
                                   self.ttl_ms, sent_at, fence=fence)
            else:
                # Re-entry: the expiry is now at least ttl from the send time.
                heartbeat.confirmed(self, self._hold_id, self.ttl_ms, sent_at)
            self._depth += 1

    # -- release ------------------------------------------------------------------

    def release(self) -> None:
        """Undo one acquire; the lock is freed when releases match acquires.

        Raises :class:`LockNotOwned` when the caller's owner does not hold the lock
        (nothing is deleted), :class:`LockLost` when this object held it but it was lost
        (expired, taken, or past its deadline) meanwhile, :class:`BackendUnavailable`
        when Redis did not confirm: then nothing changed, locally either, and the
        release may be tried again.
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
            hold_id, lost_reason = self._hold_id, self._lost_reason
            final = held_here and self._depth == 1
        heartbeat = self._get_heartbeat()
        if final and lost_reason is None:
            heartbeat.set_releasing(self, hold_id, True)
        try:
            reply = self._run(RELEASE, (self.keys.lock,), (owner, _op_id()))
        except DLockError:
            if lost_reason is None:
                if final:
                    heartbeat.set_releasing(self, hold_id, False)
                raise
            reply = (0,)  # a lost hold: the loss is the answer, best effort was made
        status = int(reply[0])
        if not held_here:
            if status in (1, 2):
                return
            what = "is not held" if status == 0 else "is held by another owner"
            raise LockNotOwned(f"cannot release: lock {what}", lock_name=self.name)
        if lost_reason is None and status not in (1, 2):
            lost_reason = self._why_gone(
                "expired" if status == 0 else "was taken by another owner", owner)
            self._mark_lost(lost_reason, hold_id)
        with self._state:
            if self._hold_id == hold_id and self._depth > 0:
                self._depth -= 1
                if self._depth == 0:
                    self._hold_owner = None
                    self._fence = None
        if final:
            heartbeat.unregister(self, hold_id)
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
        self._get_heartbeat().unregister(self, hold_id)
        keys = self.keys
        for _ in range(depth):
            try:
                reply = self._run(RELEASE, (keys.lock,), (owner, _op_id()))
            except DLockError as exc:
                logger.warning("releasing %r at shutdown failed: %s", self.name, exc)
                break
            if int(reply[0]) != 2:
                break
        return depth

    # -- extend, inspect ------------------------------------------------------------

    def extend(self, ttl: float | None = None) -> None:
        """Make the hold expire at least ``ttl`` seconds from now (default: the lock's
        ttl); an extend never brings the expiry closer.

        The new ttl is kept: later renewals use it too.  Answers for the calling owner:
        :class:`LockNotOwned` when it does not hold the lock.
        """
        ttl_ms = self.ttl_ms if ttl is None else _ttl_to_ms(ttl, "ttl", self.name)
        owner, held_here, hold_id, lost_reason = self._caller_view()
        if lost_reason is not None:
            raise LockLost(f"cannot extend: lock lost ({lost_reason})",
                           lock_name=self.name)
        heartbeat = self._get_heartbeat()
        sent_at = heartbeat.now()
        status = int(self._run(EXTEND, (self.keys.lock,), (owner, ttl_ms)))
        if status == 1:
            self.ttl_ms = ttl_ms
            if held_here:
                heartbeat.confirmed(self, hold_id, ttl_ms, sent_at)
            return
        if held_here:
            reason = self._why_gone(
                "expired" if status == 0 else "taken by another owner", owner)
            self._mark_lost(reason, hold_id)
            raise LockLost(f"cannot extend: lock {reason}", lock_name=self.name)
        what = "is not held" if status == 0 else "is held by another owner"
        raise LockNotOwned(f"cannot extend: lock {what}", lock_name=self.name)

    def locked(self) -> bool:
        """Whether anyone holds the lock."""
        return bool(self._command(self.client.exists, self.keys.lock))

    def owned(self) -> bool:
        """Whether the calling owner holds the lock (one Redis round trip, none when
        this object's hold is known to be lost)."""
        owner, _, _, lost_reason = self._caller_view()
        if lost_reason is not None:
            return False
        holder = self._command(self.client.hget, self.keys.lock, "owner")
        return holder is not None and decode(holder) == owner

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` unless the calling owner still holds the lock.

        Asks Redis (one round trip), so it is authoritative at the moment it returns;
        pair it with :attr:`fence` for writes that must not come from a stale holder.
        A hold known to be lost raises without asking.
        """
        owner, held_here, hold_id, lost_reason = self._caller_view()
        if lost_reason is not None:
            raise LockLost(f"lock lost: {lost_reason}", lock_name=self.name)
        holder = self._command(self.client.hget, self.keys.lock, "owner")
        if holder is not None and decode(holder) == owner:
            return
        reason = "expired" if holder is None else "taken by another owner"
        if held_here:
            reason = self._why_gone(reason, owner)
            self._mark_lost(reason, hold_id)
            raise LockLost(f"lock lost: {reason}", lock_name=self.name)
        raise LockLost(f"lock not held by this owner ({reason})", lock_name=self.name)

    def holder(self) -> Holder | None:
        """Who holds the lock now (None when free)."""
        reply = self._run(READ_HOLD, (self.keys.lock,), ())
        if len(reply) <= 3:
            return None
        pttl, secs, usecs = (int(x) for x in reply[:3])
        return parse_holder(reply[3:], pttl, secs * 1000 + usecs // 1000)

    @property
    def fence(self) -> int | None:
        """The fencing token of this object's current hold (None when not held).

        Tokens strictly increase across holders and stay the same on re-entry: a
        resource that remembers the highest token it has seen can refuse a write from
        a holder whose lock has since passed to someone else.
        """
        with self._state:
            self._sync_generation()
            return self._fence if self._depth > 0 else None

    # -- lost ---------------------------------------------------------------------

    def _why_gone(self, default: str, owner: str) -> str:
        """``default``, or who released this hold by force and why, when a force
        release left its marker (one more round trip, only once the hold is gone)."""
        with self._state:
            fence = self._fence
        return read_loss_reason(self.client, self.keys.lock, owner, fence) or default

    def __repr__(self) -> str:
        return (f"<RedisLock {self.name!r} ttl={self.ttl:g}s depth={self._depth} "
                f"fence={self._fence}>")
