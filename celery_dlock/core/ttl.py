"""Bounds of a hold's ttl, shared by every backend."""

from __future__ import annotations

import math

from .errors import InvalidLockConfig

__all__ = ["MAX_TTL", "ttl_ms"]

#: The longest ttl a hold may have (seconds): 30 days.  Longer holds are refused with
#: InvalidLockConfig (Lua would print larger millisecond counts in a form PEXPIRE
#: refuses, and a lock that must outlive a month is a record, not a lock).
MAX_TTL = 30 * 86400.0


def ttl_ms(ttl: float, what: str, name: str) -> int:
    """``ttl`` seconds as whole milliseconds (at least 1); InvalidLockConfig naming
    ``what`` unless ``0 < ttl <= MAX_TTL``."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise InvalidLockConfig(f"{what} must be a number of seconds, got {ttl!r}",
                                lock_name=name)
    if not math.isfinite(ttl) or ttl <= 0:
        raise InvalidLockConfig(f"{what} must be a positive number of seconds, "
                                f"got {ttl!r}", lock_name=name)
    if ttl > MAX_TTL:
        raise InvalidLockConfig(f"{what} must be at most {MAX_TTL:g} seconds (30 days), "
                                f"got {ttl!r}", lock_name=name)
    return max(1, round(ttl * 1000))
