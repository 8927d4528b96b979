"""What a refusal from Redis says about a lock: another application's data under its
keys (:class:`LockKeyConflict`), or a command the connection's user may not run
(:class:`InvalidLockConfig`: the ACL is configuration).

The scripts (:mod:`celery_dlock.backends.redis.scripts`) stop before writing anything
when a key of the lock is not what they would have written: Redis's own ``WRONGTYPE``
for a key of another type, and an error of their own, with the texts below, for a
hash at the lock's key that is no hold (:data:`NOT_A_HOLD`) and a fence counter that
is not an integer (:data:`NOT_A_FENCE`).  A command refused by the user's ACL stops a
script with :data:`REFUSED` and the command's name (the scripts make their writes in an
order that leaves nothing without its expiry then: :mod:`.lua`).  This module turns
those into errors that name the key or the command.
"""

from __future__ import annotations

import re
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from ...core.errors import DLockError, InvalidLockConfig, LockKeyConflict
from .keyspace import UNTOUCHED, LockKeys, foreign_keys

__all__ = ["NOT_A_FENCE", "NOT_A_HOLD", "REFUSED", "acl_refusal", "refusal"]

#: The scripts' error for a hash at the lock's key that is not one of their holds,
#: followed by `` (no FIELD)``: the first field of a hold it lacks.
NOT_A_HOLD = "not a celery-dlock hold"
#: The scripts' error for a fence counter that is not an integer.
NOT_A_FENCE = "not an integer fence counter"
#: The scripts' error for a command the connection's user may not run (ACL), followed
#: by `` CMD (what Redis said)``: Redis's own error does not name the command.
REFUSED = "celery-dlock: refused"

_MISSING = re.compile(re.escape(NOT_A_HOLD) + r" \(no (\w+)\)")
_REFUSED = re.compile(re.escape(REFUSED) + r" ([\w|-]+) \((.*?)\)")
# What Redis puts around its words: the error code, and the script's position.
_NOISE = re.compile(r"^(?:ERR |NOPERM )|@?user_script: ?\d+: ")
#: What to do about a refused command.
ACL_HINT = ("allow it in the user's ACL rule (docs/deployments.md, 'ACL: the least "
            "privilege')")


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
    return acl_refusal(exc, "the lock's scripts need it, and stopped before writing "
                            "anything that would not expire", name)


def acl_refusal(exc: BaseException, what: str, name: str | None) -> DLockError | None:
    """:class:`InvalidLockConfig` naming the command when ``exc`` is a command the
    connection's user may not run (a script's :data:`REFUSED`, or Redis's own
    ``NOPERM``); ``what`` says who needs it.  None for any other error."""
    text = str(exc)
    refused = _REFUSED.search(text)
    if refused:
        said = _NOISE.sub("", refused[2]).strip()
        return InvalidLockConfig(
            f"Redis refused {refused[1]} to this connection's user ({said}): {what}; "
            f"{ACL_HINT}", lock_name=name)
    if isinstance(exc, NoPermissionError):
        return InvalidLockConfig(f"Redis refused a command to this connection's "
                                 f"user ({text}): {ACL_HINT}", lock_name=name)
    return None
