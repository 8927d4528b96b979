"""The local view of a lock object's hold, shared by every backend.

What a lock object knows without asking a server: which owner holds it through this
object, how many acquires are not yet released (re-entry), the hold's id (one per fresh
hold, so a late report about an older hold never touches a newer one), its fencing
token, and whether it was found lost.  A forked child inherits the object's memory but
not its hold: the view resets itself when the process's owner generation changes.

A backend (:class:`~celery_dlock.RedisLock`, :class:`~celery_dlock.RedlockLock`)
subclasses :class:`HoldView` and adds the server side: ``acquire``, ``release`` and the
checks.  ``on_lost`` runs once per lost hold, whoever found out (the heartbeat's
watchdog, or a caller of a check).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

from . import owner as _owner
from .errors import DLockError, Holder, InvalidLockConfig, LockNotAcquired
from .heartbeat import Heartbeat, get_heartbeat

__all__ = ["RESERVED_INFO", "HoldView", "acquire_timeout", "check_lock_options"]

logger = logging.getLogger("celery_dlock.lock")

_HOST = socket.gethostname()
#: Fields of a hold that ``info`` may not set.
RESERVED_INFO = frozenset({"owner", "count", "fence", "acquired_at", "ttl", "pid", "ops"})

_Self = TypeVar("_Self", bound="HoldView")


def check_lock_options(name: Any, prefix: Any, owner: Any, blocking_timeout: Any,
                       info: Mapping[str, object] | None) -> list[str]:
    """InvalidLockConfig for a bad name, prefix, owner or blocking_timeout, or an info
    field that is reserved; else the metadata (``host`` added) as flat field/value
    arguments."""
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
        raise InvalidLockConfig("blocking_timeout must be >= 0 or None", lock_name=name)
    info_args: list[str] = []
    for k, v in {"host": _HOST, **(info or {})}.items():
        if k in RESERVED_INFO:
            raise InvalidLockConfig(f"info may not set the reserved field {k!r}",
                                    lock_name=name)
        if v is not None:
            info_args += (str(k), str(v))
    return info_args


def acquire_timeout(blocking: bool, timeout: float | None,
                    blocking_timeout: float | None,
                    default: float | None) -> float | None:
    """How long an ``acquire(blocking, timeout, blocking_timeout=...)`` may wait (None:
    no limit), redis-py's ``Lock`` rules: ``blocking_timeout`` is another name for
    ``timeout``; neither given: the lock's ``default``; ``-1``: no limit."""
    if blocking_timeout is not None:
        if timeout is not None and timeout != blocking_timeout:
            raise ValueError("give timeout or blocking_timeout, not both")
        timeout = blocking_timeout
    if timeout is not None and timeout != -1:
        if not blocking:
            raise ValueError("can't specify a timeout for a non-blocking call")
        if not timeout >= 0:  # negative, or NaN (which would wait forever)
            raise ValueError("timeout must be >= 0, -1 or None")
        return timeout
    if timeout is None and blocking:
        return default
    return None


class HoldView:
    """The local bookkeeping of a lock object's hold (see the module text)."""

    #: Set by the backend: how long ``with lock:`` waits (None: forever).
    blocking_timeout: float | None = None

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
        self._fence: int | None = None
        self._generation = _owner.generation()
        self._lost_reason: str | None = None
        self._release_op: tuple[int, int, str] | None = None
        #: What the last failed acquire learned about the holder.
        self.last_holder: Holder | None = None

    # -- what the backend provides ------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    # -- the local view -------------------------------------------------------------

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
            self._fence = None
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
        """Whether this object's last hold was found lost (it stays True after the
        release of a lost hold, until the next fresh hold)."""
        return self._lost_reason is not None

    @property
    def depth(self) -> int:
        """How many acquires of this object are not yet released."""
        with self._state:
            self._sync_generation()
            return self._depth

    def _mark_lost(self, reason: str, hold_id: int | None = None) -> bool:
        """Record that hold ``hold_id`` (default: the current one) is lost, whoever
        found out; ``on_lost`` runs once per hold.  A report about an older hold
        changes nothing."""
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

    # -- context manager ------------------------------------------------------------

    def __enter__(self: _Self) -> _Self:
        if not self.acquire(blocking=True, timeout=self.blocking_timeout):
            raise LockNotAcquired(lock_name=self.name, holder=self.last_holder)
        return self

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
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
