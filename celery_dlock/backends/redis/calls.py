"""``RedisHold``: how a hold kept in Redis talks to its server, for
:class:`~celery_dlock.RedisLock` and :class:`~celery_dlock.RedisSemaphore` alike.

Both keep each hold as a hash with the same fields and the same operation ids, take
and give them back with a Lua script each, wait in the same FIFO line on a doorbell,
and read the same refusal; what differs is which scripts they run and the arguments a
semaphore adds (its limit), given by :meth:`RedisHold._extra_args`.  The bookkeeping
itself (depth, deadline, losses) is :class:`~celery_dlock.core.hold.Hold`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from redis.exceptions import DataError, RedisError

from ...core.errors import BackendUnavailable, DLockError, InvalidLockConfig
from ...core.hold import Hold
from ...core.protocol import Grant, Refused
from .keyspace import LockKeys, parse_holder
from .lua import LuaScript
from .refusals import refusal
from .server_checks import check_server
from .waiters import QUEUE_LEASE, WAKE_GRACE, ring_wait, wait_slice

__all__ = ["REENTRY_GONE", "HoldKeys", "RedisHold"]

#: ACQUIRE's first reply element for a re-entry whose hold is gone.
REENTRY_GONE = 2


class HoldKeys(Protocol):
    """The keys of a hold's name the calls use (a lock's or a semaphore's)."""

    @property
    def lock(self) -> str: ...

    def doorbell(self, owner: str) -> str: ...


class RedisHold(Hold):
    """The Redis calls of a hold (see the module text).  A subclass sets ``client``,
    ``prefix``, ``keys`` and ``_info_args`` in its constructor, and names its scripts
    in the class attributes."""

    #: The scripts of this kind (ACQUIRE, EXTEND).
    _acquire_script: LuaScript
    _extend_script: LuaScript

    client: Any
    prefix: str
    keys: HoldKeys

    def _extra_args(self) -> tuple[Any, ...]:
        """What this kind's acquire takes after the operation's own arguments: the
        name's fence ttl (ms) for a lock."""
        return (self.options.fence_ttl_ms,)

    def _lock_keys(self) -> LockKeys:
        """The keys as a lock's (what :func:`.refusals.refusal` reads)."""
        raise NotImplementedError

    def _error(self, exc: RedisError, what: str) -> DLockError:
        """The DLockError for a failed Redis call."""
        refused = refusal(exc, self.client, self._lock_keys(), self.name)
        if refused is not None:
            return refused
        return BackendUnavailable(f"Redis unavailable during {what}: {exc}",
                                  lock_name=self.name)

    def _run(self, script: LuaScript, args: Sequence[Any]) -> Any:
        try:
            return script(self.client, (self.keys.lock,), args)
        except (UnicodeError, DataError) as exc:
            # redis-py refused to encode an argument (in the client's encoding) before
            # sending anything: the lock's arguments are wrong, not the server.
            raise InvalidLockConfig(f"an argument of {script.name} cannot be sent with "
                                    f"this client's encoding: {exc}",
                                    lock_name=self.name) from exc
        except RedisError as exc:
            raise self._error(exc, script.name) from exc

    def _command(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except RedisError as exc:
            raise self._error(exc, getattr(fn, "__name__", "a command")) from exc

    def _send_acquire(self, owner: str, op: str, *, queue: bool,
                      reentry: bool) -> Grant | Refused | int:
        check_server(self.client)
        lease_ms = int(QUEUE_LEASE * 1000) if queue else 0
        expect = ""
        if reentry:
            fence = self._fence
            expect = "*" if fence is None else str(fence)
        ttl_ms = self._acquire_ttl_ms(reentry)  # never past a max_hold bound
        reply = self._run(self._acquire_script,
                          (owner, ttl_ms, lease_ms, op, expect, *self._extra_args(),
                           "pid", os.getpid(), *self._info_args))
        code = int(reply[0])
        if code == 1:
            return Grant(int(reply[1]), int(reply[2]) > 1)
        if code == REENTRY_GONE:
            return int(reply[1])
        pttl = int(reply[1])
        self.last_holder = parse_holder(reply[3:], pttl, int(reply[2]))
        # An expiry rings no doorbell: wake up when the holder's ttl ends, or when the
        # first in line's grace to take a free lock does.
        return Refused((pttl / 1000.0 if pttl >= 0 else WAKE_GRACE) + 0.001)

    def _wait_turn(self, owner: str, refused: Refused, left: float | None) -> None:
        slice_ = wait_slice(self.client)
        if left is not None:
            slice_ = min(slice_, left)
        if refused.retry_in is not None:
            slice_ = min(slice_, refused.retry_in)
        if slice_ > 0:
            self._command(ring_wait, self.client, self.keys.doorbell(owner), slice_)

    def _send_extend(self, owner: str, ttl_ms: int, op: str) -> int:
        # Extend only ever moves the expiry later: a second execution changes
        # nothing, so it needs no operation id.
        return int(self._run(self._extend_script, (owner, ttl_ms)))
