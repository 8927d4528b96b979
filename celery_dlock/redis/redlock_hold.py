"""The local view of a Redlock hold: who holds it through this object, how deep, and
whether it was found lost (the part of :class:`~celery_dlock.redis.redlock.RedlockLock`
that needs no server).  Like RedisLock's: one hold id per fresh hold, the owner of the
calling context, reset in a forked child, ``on_lost`` once per lost hold.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..core import owner as _owner
from ..core.errors import Holder, InvalidLockConfig
from ..core.heartbeat import Heartbeat, get_heartbeat

__all__ = ["HoldView", "check_lock_options"]

logger = logging.getLogger("celery_dlock.redlock")

_HOST = socket.gethostname()
_RESERVED = frozenset({"owner", "count", "fence", "acquired_at", "ttl", "pid", "ops"})


def check_lock_options(name: Any, prefix: Any, owner: Any, blocking_timeout: Any,
                       info: Mapping[str, object] | None) -> list[str]:
    """InvalidLockConfig for a bad name, prefix, owner or blocking_timeout, or an info
    field that is reserved; else the metadata as flat field/value arguments."""
    if not isinstance(name, str) or not name:
        raise InvalidLockConfig(f"a lock needs a non-empty name, got {name!r}")
    if not isinstance(prefix, str) or not prefix:
        raise InvalidLockConfig(f"prefix must be a non-empty string, got {prefix!r}",
                                lock_name=name)
    if owner is not None and (not isinstance(owner, str) or not owner):
        raise InvalidLockConfig(f"owner must be a non-empty string, got {owner!r}",
                                lock_name=name)
    if blocking_timeout is not None and not blocking_timeout >= 0:
        raise InvalidLockConfig("blocking_timeout must be >= 0 or None", lock_name=name)
    info_args: list[str] = []
    for k, v in {"host": _HOST, **(info or {})}.items():
        if k in _RESERVED:
            raise InvalidLockConfig(f"info may not set the reserved field {k!r}",
                                    lock_name=name)
        if v is not None:
            info_args += (str(k), str(v))
    return info_args


class HoldView:
    """The local bookkeeping of a lock object's hold."""

    def __init__(self, name: str, owner: str | None,
                 on_lost: Callable[[Any], object] | None,
                 heartbeat: Heartbeat | None) -> None:
        self.name = name
        self.on_lost = on_lost
        self._fixed_owner = owner
        self._heartbeat = heartbeat
        self._state = threading.Lock()
        self._depth = 0
        self._hold_id = 0
        self._hold_owner: str | None = None
        self._generation = _owner.generation()
        self._lost_reason: str | None = None
        self._release_op: tuple[int, int, str] | None = None
        #: What the last failed acquire learned about the holder.
        self.last_holder: Holder | None = None

    def _current_owner(self) -> str:
        return self._fixed_owner or _owner.current_owner()

    def _get_heartbeat(self) -> Heartbeat:
        return self._heartbeat if self._heartbeat is not None else get_heartbeat()

    def _sync_generation(self) -> None:
        # A forked child inherits this object's memory but not its hold.
        gen = _owner.generation()
        if self._generation != gen:
            self._generation = gen
            self._depth = 0
            self._hold_owner = None
            self._lost_reason = None
            self._release_op = None

    def _caller_view(self) -> tuple[str, bool, int, str | None]:
        """The calling owner, whether it holds the lock through this object, the id of
        that hold and why it was lost (None: not lost)."""
        caller = self._current_owner()
        with self._state:
            self._sync_generation()
            held_here = self._depth > 0 and caller == self._hold_owner
            return caller, held_here, self._hold_id, (self._lost_reason if held_here
                                                      else None)

    @property
    def lost(self) -> bool:
        """Whether this object's last hold was found lost."""
        return self._lost_reason is not None

    @property
    def depth(self) -> int:
        """How many acquires of this object are not yet released."""
        with self._state:
            self._sync_generation()
            return self._depth

    def _mark_lost(self, reason: str, hold_id: int | None = None) -> bool:
        """Record that hold ``hold_id`` (default: the current one) is lost; on_lost
        runs once per hold, and a report about an older hold changes nothing."""
        with self._state:
            if self._depth == 0 or self._lost_reason is not None:
                return False
            if hold_id is not None and hold_id != self._hold_id:
                return False
            self._lost_reason = reason
            hold_id = self._hold_id
        self._get_heartbeat().unregister(self, hold_id)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                logger.exception("on_lost callback for %r failed", self.name)
        return True
