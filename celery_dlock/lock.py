"""``RedisLock``: a reentrant, renewed, owner-checked lock on one Redis.

Ownership, on a timeline (A and B are owners, see :mod:`celery_dlock.owner`)::

    t0  A.acquire()    hash {owner: A, count: 1, fence: 7}, expires at t0 + ttl
    t1  A.acquire()    re-entry: count 2, same fence 7
    t2  B.acquire()    contention: B learns A's remaining ttl and metadata, and (when
                       blocking) joins the line and sleeps on its doorbell
    t3  A.release()    count 1: still held
    t4  A.release()    count 0: key deleted, B's doorbell rings
    t5  B acquires     fence 8 (fences only grow)
    t6  A.release()    "not owner": raises LockNotOwned; B's hold is untouched

While held, the process's heartbeat renews the hold every ``ttl/3``; if the hold is
found gone or taken, it is marked lost, ``on_lost(lock)`` is called, :meth:`owned`
returns False and :meth:`ensure_held` raises :class:`LockLost`.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, NamedTuple

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import owner as _owner
from .errors import (
    BackendUnavailable,
    DLockError,
    Holder,
    InvalidLockConfig,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
)
from .heartbeat import Heartbeat, get_heartbeat
from .scripts import ACQUIRE, EXTEND, LEAVE_QUEUE, RELEASE, LuaScript
from .waiters import QUEUE_LEASE, ring_wait, wait_slice

__all__ = ["DEFAULT_PREFIX", "LockKeys", "RedisLock", "decode", "parse_holder"]

logger = logging.getLogger("celery_dlock.lock")

DEFAULT_PREFIX = "dlock"
_HOST = socket.gethostname()

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError)


class LockKeys(NamedTuple):
    """The Redis keys of one lock; all share the hash tag ``{name}``."""

    lock: str
    fence: str
    queue: str
    leases: str
    doorbell_prefix: str

    @classmethod
    def for_name(cls, prefix: str, name: str) -> LockKeys:
        base = f"{prefix}:{{{name}}}"
        return cls(base, base + ":fence", base + ":q", base + ":ql", base + ":w:")

    def doorbell(self, owner: str) -> str:
        return self.doorbell_prefix + owner


def decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_holder(flat: Sequence[Any], pttl_ms: int | None, now_ms: int | None) -> Holder:
    """Build a :class:`Holder` from a flat ``HGETALL`` reply."""
    fields = {decode(flat[i]): decode(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
    owner = fields.pop("owner", None)
    count = int(fields.pop("count", "0") or 0)
    fence_text = fields.pop("fence", None)
    acquired_at = fields.pop("acquired_at", None)
    fields.pop("ttl", None)
    age = None
    if acquired_at is not None and now_ms is not None:
        age = max(0.0, (now_ms - int(acquired_at)) / 1000.0)
    ttl = pttl_ms / 1000.0 if pttl_ms is not None and pttl_ms >= 0 else None
    return Holder(
        owner=owner,
        count=count,
        fence=int(fence_text) if fence_text else None,
        age=age,
        ttl=ttl,
        info=fields,
    )


def _ttl_ms(ttl: float, what: str, name: str) -> int:
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise InvalidLockConfig(f"{what} must be a number of seconds, got {ttl!r}",
                                lock_name=name)
    if not math.isfinite(ttl) or ttl <= 0:
        raise InvalidLockConfig(f"{what} must be a positive number of seconds, "
                                f"got {ttl!r}", lock_name=name)
    return max(1, round(ttl * 1000))


class RedisLock:
    """A reentrant distributed lock on one Redis (or one Redis Cluster slot).

    :param client: a ``redis.Redis`` (or ``RedisCluster``) client.
    :param name: the lock's name; any non-empty string.
    :param ttl: seconds a hold lives after its last acquire, extend or renewal.
    :param auto_renew: renew the hold from this process's heartbeat every ``ttl/3``.
    :param owner: a fixed owner token (processes that share it share the hold); by
        default the current context's owner, else a per-thread token.
    :param on_lost: called once with this lock when the hold is found lost, from the
        thread that found out (the heartbeat, or a caller of ensure_held or extend).
    :param prefix: the key prefix (``dlock``).
    :param info: metadata stored with each fresh hold (shown by ``celery dlock ls`` and
        in :class:`LockNotAcquired`); ``host`` and ``pid`` are always added.
    :param blocking_timeout: how long ``with lock:`` waits before raising
        :class:`LockNotAcquired` (None: forever).
    :param heartbeat: the renewal registry to use (default: this process's).

    Every Redis failure surfaces as :class:`BackendUnavailable` (connection refused or
    reset, timeouts, a read-only replica after failover).
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
        if not isinstance(name, str) or not name:
            raise InvalidLockConfig(f"a lock needs a non-empty name, got {name!r}")
        if not isinstance(prefix, str) or not prefix:
            raise InvalidLockConfig(f"prefix must be a non-empty string, got {prefix!r}",
                                    lock_name=name)
        if owner is not None and (not isinstance(owner, str) or not owner):
            raise InvalidLockConfig(f"owner must be a non-empty string, got {owner!r}",
                                    lock_name=name)
        # NaN compares false with everything: refuse it rather than wait forever.
        if blocking_timeout is not None and not blocking_timeout >= 0:
            raise InvalidLockConfig("blocking_timeout must be >= 0 or None",
                                    lock_name=name)
        if client is None:
            raise InvalidLockConfig("a lock needs a Redis client", lock_name=name)
        self.client = client
        self.name = name
        self.prefix = prefix
        self.ttl_ms = _ttl_ms(ttl, "ttl", name)
        self.auto_renew = auto_renew
        self.on_lost = on_lost
        self.blocking_timeout = blocking_timeout
        self.keys = LockKeys.for_name(prefix, name)
        self._fixed_owner = owner
        self._heartbeat = heartbeat
        info_args: list[str] = []
        for k, v in {"host": _HOST, **(info or {})}.items():
            if k in ("owner", "count", "fence", "acquired_at", "ttl", "pid"):
                raise InvalidLockConfig(f"info may not set the reserved field {k!r}",
                                        lock_name=name)
            if v is not None:
                info_args += (str(k), str(v))
        self._info_args = info_args
        self._state = threading.Lock()
        self._depth = 0
        self._hold_owner: str | None = None
        self._fence: int | None = None
        self._generation = _owner.generation()
        self._lost_reason: str | None = None
        #: What the last failed acquire learned about the holder.
        self.last_holder: Holder | None = None

    # -- helpers ------------------------------------------------------------------

    @property
    def ttl(self) -> float:
        return self.ttl_ms / 1000.0

    def _current_owner(self) -> str:
        return self._fixed_owner or _owner.current_owner()

    def _sync_generation(self) -> None:
        # A forked child inherits this object's memory but not its hold.
        gen = _owner.generation()
        if self._generation != gen:
            self._generation = gen
            self._depth = 0
            self._hold_owner = None
            self._fence = None
            self._lost_reason = None

    def _run(self, script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return script(self.client, keys, args)
        except _UNAVAILABLE as exc:
            raise BackendUnavailable(f"Redis unavailable during {script.name}: {exc}",
                                     lock_name=self.name) from exc

    def _command(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except _UNAVAILABLE as exc:
            raise BackendUnavailable(f"Redis unavailable: {exc}",
                                     lock_name=self.name) from exc

    def _get_heartbeat(self) -> Heartbeat:
        return self._heartbeat if self._heartbeat is not None else get_heartbeat()

    # -- acquire ------------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock (or re-enter it); True when held.

        ``blocking=False`` tries once.  Otherwise waits in line, woken by the release
        of the holder, for at most ``timeout`` seconds (``None`` or ``-1``: no limit).
        Raises :class:`BackendUnavailable` when Redis cannot be reached.
        """
        if timeout is not None and timeout != -1:
            if not blocking:
                raise ValueError("can't specify a timeout for a non-blocking call")
            if not timeout >= 0:  # negative, or NaN (which would wait forever)
                raise ValueError("timeout must be >= 0, -1 or None")
        else:
            timeout = None
        owner = self._current_owner()
        keys = self.keys
        key_list = (keys.lock,)
        lease_ms = int(QUEUE_LEASE * 1000) if blocking else 0
        args = [owner, self.ttl_ms, lease_ms, "pid", os.getpid(), *self._info_args]
        deadline = None if timeout is None else time.monotonic() + timeout
        queued = acquired = False
        try:
            while True:
                reply = self._run(ACQUIRE, key_list, args)
                if reply[0] == 1:
                    acquired = True
                    self._acquired(owner, int(reply[1]), int(reply[2]))
                    return True
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
                if pttl >= 0:
                    # An expiry rings no doorbell: wake up when the holder's ttl ends.
                    slice_ = min(slice_, pttl / 1000.0 + 0.001)
                if slice_ > 0:
                    self._command(ring_wait, self.client, keys.doorbell(owner), slice_)
        finally:
            if queued and not acquired:
                self._leave_queue(owner)

    def _leave_queue(self, owner: str) -> None:
        keys = self.keys
        try:
            LEAVE_QUEUE(self.client, (keys.lock,), (owner,))
        except RedisError as exc:  # our lease lapses by itself
            logger.debug("could not leave the line of %r: %s", self.name, exc)

    def _acquired(self, owner: str, fence: int, count: int) -> None:
        with self._state:
            self._sync_generation()
            if count == 1 and self._depth > 0:
                # A fresh hold in Redis while this object still counts an old one:
                # the old hold was lost. Start over with the new one.
                self._depth = 0
            if self._depth == 0:
                self._hold_owner = owner
                self._fence = fence
                self._lost_reason = None
                if self.auto_renew:
                    self._get_heartbeat().register(self, self.client, self.keys.lock,
                                                   owner, self.ttl_ms)
            self._depth += 1

    # -- release ------------------------------------------------------------------

    def release(self) -> None:
        """Undo one acquire; the lock is freed when releases match acquires.

        Raises :class:`LockNotOwned` when the caller's owner does not hold the lock
        (nothing is deleted), :class:`LockLost` when this object held it but it expired
        or passed to another owner meanwhile.
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
            lost_reason = self._lost_reason
            if held_here:
                self._depth -= 1
                if self._depth == 0:
                    # Unregister before the script runs: renewal never outlives a hold.
                    self._get_heartbeat().unregister(self)
                    self._hold_owner = None
                    self._fence = None
                    self._lost_reason = None
        keys = self.keys
        reply = self._run(RELEASE, (keys.lock,), (owner,))
        status = int(reply[0])
        if status in (1, 2):
            return
        if held_here:
            what = "expired" if status == 0 else "was taken by another owner"
            if lost_reason:
                what += f" ({lost_reason})"
            raise LockLost(f"lock {what} before it was released", lock_name=self.name)
        what = "is not held" if status == 0 else "is held by another owner"
        raise LockNotOwned(f"cannot release: lock {what}", lock_name=self.name)

    def release_all(self) -> int:
        """Release every acquire of this object's hold, whichever thread asks.

        For shutdown paths that must not leave holds to expire; returns how many
        acquires were undone.  Errors are logged, not raised.
        """
        with self._state:
            self._sync_generation()
            depth, owner = self._depth, self._hold_owner
            if depth == 0 or owner is None:
                return 0
            self._depth = 0
            self._hold_owner = None
            self._fence = None
            self._lost_reason = None
            self._get_heartbeat().unregister(self)
        keys = self.keys
        for _ in range(depth):
            try:
                reply = self._run(RELEASE, (keys.lock,), (owner,))
            except DLockError as exc:
                logger.warning("releasing %r at shutdown failed: %s", self.name, exc)
                break
            if int(reply[0]) != 2:
                break
        return depth

    # -- extend, inspect ------------------------------------------------------------

    def _owner_for_checks(self) -> tuple[str, bool]:
        with self._state:
            self._sync_generation()
            if self._depth > 0 and self._hold_owner is not None:
                return self._hold_owner, True
        return self._current_owner(), False

    def extend(self, ttl: float | None = None) -> None:
        """Make the hold expire ``ttl`` seconds from now (default: the lock's ttl).

        The new ttl is kept: later renewals use it too.
        """
        ttl_ms = self.ttl_ms if ttl is None else _ttl_ms(ttl, "ttl", self.name)
        owner, held_here = self._owner_for_checks()
        status = int(self._run(EXTEND, (self.keys.lock,), (owner, ttl_ms)))
        if status == 1:
            self.ttl_ms = ttl_ms
            if held_here and self.auto_renew:
                self._get_heartbeat().update_ttl(self, ttl_ms)
            return
        if held_here:
            reason = "expired" if status == 0 else "taken by another owner"
            self._mark_lost(reason)
            raise LockLost(f"cannot extend: lock {reason}", lock_name=self.name)
        what = "is not held" if status == 0 else "is held by another owner"
        raise LockNotOwned(f"cannot extend: lock {what}", lock_name=self.name)

    def locked(self) -> bool:
        """Whether anyone holds the lock."""
        return bool(self._command(self.client.exists, self.keys.lock))

    def owned(self) -> bool:
        """Whether the caller's owner holds the lock (one Redis round trip)."""
        owner, held_here = self._owner_for_checks()
        if held_here and self._lost_reason is not None:
            return False
        holder = self._command(self.client.hget, self.keys.lock, "owner")
        return holder is not None and decode(holder) == owner

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` unless the caller's owner still holds the lock.

        Asks Redis (one round trip), so it is authoritative at the moment it returns;
        pair it with :attr:`fence` for writes that must not come from a stale holder.
        """
        owner, held_here = self._owner_for_checks()
        if held_here and self._lost_reason is not None:
            raise LockLost(f"lock lost: {self._lost_reason}", lock_name=self.name)
        holder = self._command(self.client.hget, self.keys.lock, "owner")
        if holder is not None and decode(holder) == owner:
            return
        reason = "expired" if holder is None else "taken by another owner"
        if held_here:
            self._mark_lost(reason)
            raise LockLost(f"lock lost: {reason}", lock_name=self.name)
        raise LockLost(f"lock not held by this owner ({reason})", lock_name=self.name)

    def holder(self) -> Holder | None:
        """Who holds the lock now (None when free)."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(self.keys.lock)
            pipe.pttl(self.keys.lock)
            pipe.time()
            flat_map, pttl, (secs, usecs) = pipe.execute()
        except _UNAVAILABLE as exc:
            raise BackendUnavailable(f"Redis unavailable: {exc}",
                                     lock_name=self.name) from exc
        if not flat_map:
            return None
        flat: list[Any] = []
        for k, v in flat_map.items():
            flat += (k, v)
        return parse_holder(flat, int(pttl), int(secs) * 1000 + int(usecs) // 1000)

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

    @property
    def lost(self) -> bool:
        """Whether this object's hold was found lost (by renewal or a check)."""
        return self._lost_reason is not None

    @property
    def depth(self) -> int:
        """How many acquires of this object are not yet released."""
        with self._state:
            self._sync_generation()
            return self._depth

    # -- lost ---------------------------------------------------------------------

    def _mark_lost(self, reason: str) -> bool:
        """Record that the hold is lost, whoever found out; ``on_lost`` runs once."""
        with self._state:
            if self._depth == 0 or self._lost_reason is not None:
                return False
            self._lost_reason = reason
        self._get_heartbeat().unregister(self)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                logger.exception("on_lost callback for %r failed", self.name)
        return True

    # -- context manager ------------------------------------------------------------

    def __enter__(self) -> RedisLock:
        if not self.acquire(blocking=True, timeout=self.blocking_timeout):
            raise LockNotAcquired(lock_name=self.name, holder=self.last_holder)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except DLockError as release_error:
            if exc is None:
                raise
            # Never hide the body's exception behind a release problem.
            logger.warning("releasing %r after an error also failed: %s",
                           self.name, release_error)
            if hasattr(exc, "add_note"):
                exc.add_note(f"celery-dlock: releasing lock {self.name!r} also failed: "
                             f"{release_error}")

    def __repr__(self) -> str:
        return (f"<RedisLock {self.name!r} ttl={self.ttl:g}s depth={self._depth} "
                f"fence={self._fence}>")
