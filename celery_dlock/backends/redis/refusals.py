"""What a refusal from Redis says about a lock: another application's data under its
keys (:class:`LockKeyConflict`).

The scripts (:mod:`celery_dlock.backends.redis.scripts`) stop before writing anything
when a key of the lock is not what they would have written: Redis's own ``WRONGTYPE``
for a key of another type, and an error of their own, with the texts below, for a
hash at the lock's key that is no hold (:data:`NOT_A_HOLD`) and a fence counter that
is not an integer (:data:`NOT_A_FENCE`).  This module turns those into errors that
name the key.
"""

from __future__ import annotations

import re
from typing import Any

from redis.exceptions import ResponseError

from ...core.errors import DLockError, LockKeyConflict
from .keyspace import UNTOUCHED, LockKeys, foreign_keys

__all__ = ["NOT_A_FENCE", "NOT_A_HOLD", "refusal"]

#: The scripts' error for a hash at the lock's key that is not one of their holds,
#: followed by `` (no FIELD)``: the first field of a hold it lacks.
NOT_A_HOLD = "not a celery-dlock hold"
#: The scripts' error for a fence counter that is not an integer.
NOT_A_FENCE = "not an integer fence counter"

_MISSING = re.compile(re.escape(NOT_A_HOLD) + r" \(no (\w+)\)")


def refusal(exc: BaseException, client: Any, keys: LockKeys,
            name: str | None) -> DLockError | None:
    """The error a script's refusal ``exc`` stands for (None: not a refusal of the
    lock's keys; the caller decides)."""
    if not isinstance(exc, ResponseError):
        return None
    text = str(exc)
    if "WRONGTYPE" in text:
        return LockKeyConflict(foreign_keys(client, keys), lock_name=name)
    missing = _MISSING.search(text)
    if missing:
        return LockKeyConflict(
            f"{keys.lock!r} holds a hash that is {NOT_A_HOLD} (it has no "
            f"{missing[1]!r} field): {UNTOUCHED}", lock_name=name)
    if NOT_A_FENCE in text:
        return LockKeyConflict(
            f"{keys.fence!r} does not hold an integer fence counter: {UNTOUCHED}",
            lock_name=name)
    return None
