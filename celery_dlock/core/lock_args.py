"""A lock's arguments, checked where the lock is made (every lock kind shares these
rules): its name, prefix, owner, timeouts, pause budget and metadata, and how an
``acquire``'s ``blocking``/``timeout``/``blocking_timeout`` combine."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

from .errors import InvalidLockConfig

__all__ = ["DEFAULT_PREFIX", "RESERVED_INFO", "acquire_timeout", "check_lock_options"]

#: The key prefix of every backend unless told otherwise.
DEFAULT_PREFIX = "dlock"

_HOST = socket.gethostname()
#: Fields of a hold that ``info`` may not set.
RESERVED_INFO = frozenset({"owner", "count", "fence", "acquired_at", "ttl", "pid", "ops",
                           "prev", "line"})


def _encodable(text: str) -> bool:
    if text.isascii():  # (known without encoding it: most names and metadata)
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_lock_options(name: Any, prefix: Any, owner: Any, blocking_timeout: Any,
                       info: Mapping[str, object] | None,
                       pause_budget: Any = None) -> list[str]:
    """InvalidLockConfig for a bad name, prefix, owner, blocking_timeout or pause
    budget, or an info field that is reserved; else the metadata (``host`` added) as
    flat field/value arguments."""
    if not isinstance(name, str) or not name:
        raise InvalidLockConfig(f"a lock needs a non-empty name, got {name!r}")
    if not _encodable(name):
        raise InvalidLockConfig(f"a lock name must be encodable as UTF-8 (no lone "
                                f"surrogate), got {name!r}")
    if not isinstance(prefix, str) or not prefix:
        raise InvalidLockConfig(f"prefix must be a non-empty string, got {prefix!r}",
                                lock_name=name)
    if "{" in prefix or "}" in prefix or not _encodable(prefix):
        raise InvalidLockConfig(f"prefix may not contain '{{' or '}}' (on Redis Cluster "
                                f"they would move the hash tag: every acquire would "
                                f"fail), got {prefix!r}", lock_name=name)
    if owner is not None and (not isinstance(owner, str) or not owner):
        raise InvalidLockConfig(f"owner must be a non-empty string, got {owner!r}",
                                lock_name=name)
    if owner is not None and not _encodable(owner):
        raise InvalidLockConfig(f"owner must be encodable as UTF-8 (no lone "
                                f"surrogate), got {owner!r}", lock_name=name)
    # NaN compares false with everything: refuse it rather than wait forever.
    if blocking_timeout is not None and (
            isinstance(blocking_timeout, bool)
            or not isinstance(blocking_timeout, (int, float))
            or not blocking_timeout >= 0):
        raise InvalidLockConfig(f"blocking_timeout must be a number >= 0 or None, got "
                                f"{blocking_timeout!r}", lock_name=name)
    if pause_budget is not None and (isinstance(pause_budget, bool)
                                     or not isinstance(pause_budget, (int, float))
                                     or not pause_budget >= 0):
        raise InvalidLockConfig(f"pause_budget must be a number of seconds >= 0 or "
                                f"None, got {pause_budget!r}", lock_name=name)
    info_args: list[str] = []
    for k, v in {"host": _HOST, **(info or {})}.items():
        if k in RESERVED_INFO:
            raise InvalidLockConfig(f"info may not set the reserved field {k!r}",
                                    lock_name=name)
        if v is not None:
            field, value = str(k), str(v)
            if not (_encodable(field) and _encodable(value)):
                raise InvalidLockConfig(f"info field {field!r} must be encodable as "
                                        f"UTF-8 (no lone surrogate), with its value "
                                        f"{value!r}", lock_name=name)
            info_args += (field, value)
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
