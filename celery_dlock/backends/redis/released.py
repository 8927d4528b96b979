"""Why a hold is gone when it was released by force: the marker a force release leaves.

``FORCE_RELEASE`` (:mod:`celery_dlock.backends.redis.scripts`), in the same script that
frees a hold, writes the hash ``P:{NAME}:released``: the owner and fence of the hold it
freed, who freed it (``by``), why (``reason``), when (``at``, server ms) and the call's
operation id.  It lives as long as the freed hold had left (at least a minute, at most
an hour).  A holder that finds its hold gone (renewal, ``extend``, ``ensure_held``,
``release``) reads it, and when it names that holder's owner and fence, says so in the
loss reason: ``released by alice@host with celery dlock release --force: disk full``.

The key ends with ``:released``, not ``}``: ``celery dlock ls`` never lists it as a
lock (see :mod:`celery_dlock.backends.redis.hashtag`).  Its text is given by people: it
is made one line, capped at :data:`REASON_MAX` characters, and any ``user:password@`` in
it is masked, both when it is written and when it is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError

from ...core.text import REASON_MAX, clean_text
from .keyspace import RELEASED_SUFFIX, decode

__all__ = ["REASON_MAX", "SUFFIX", "clean_text", "loss_reason", "marker_key", "names",
           "read_loss_reason", "read_loss_reasons"]

#: The suffix of the marker's key after the lock hash's key.
SUFFIX = RELEASED_SUFFIX


def marker_key(lock_key: str) -> str:
    """The marker's key for the lock hash ``lock_key`` (same hash tag)."""
    return lock_key + SUFFIX


def loss_reason(fields: Mapping[str, str]) -> str:
    """The loss reason a marker's fields give (``released by ...``)."""
    by = clean_text(fields.get("by")) or "someone"
    reason = clean_text(fields.get("reason"))
    return f"released by {by}: {reason}" if reason else f"released by {by}"


def _fields(raw: Any) -> dict[str, str]:
    if isinstance(raw, Mapping):
        return {decode(k): decode(v) for k, v in raw.items()}
    flat = list(raw or ())
    return {decode(flat[i]): decode(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def names(fields: Mapping[str, str], owner: str, fence: int | None) -> bool:
    """Whether a marker's fields name the hold of ``owner`` with ``fence`` (any fence
    of that owner when ``fence`` is None)."""
    if fields.get("owner") != owner:
        return False
    return fence is None or fields.get("fence") == str(fence)


def read_loss_reasons(client: Any, holds: Sequence[tuple[str, str]]
                      ) -> list[tuple[int, str] | None]:
    """For each ``(lock key, owner)``: ``(fence, reason)`` when the lock's marker names
    that owner, else None.  One pipeline; None for all when it fails (the caller keeps
    its generic reason)."""
    if not holds:
        return []
    try:
        pipe = client.pipeline(transaction=False)
        for key, _ in holds:
            pipe.hgetall(marker_key(key))
        replies: Iterable[Any] = pipe.execute(raise_on_error=False)
    except Exception:  # whatever it is, the loss itself must still be reported
        return [None] * len(holds)
    out: list[tuple[int, str] | None] = []
    for (_, owner), raw in zip(holds, replies, strict=True):
        if isinstance(raw, Exception):
            out.append(None)
            continue
        fields = _fields(raw)
        fence = fields.get("fence", "")
        if fields.get("owner") == owner and fence.isdigit():
            out.append((int(fence), loss_reason(fields)))
        else:
            out.append(None)
    return out


def read_loss_reason(client: Any, lock_key: str, owner: str,
                     fence: int | None) -> str | None:
    """The loss reason of the hold ``owner``/``fence`` of ``lock_key`` when a force
    release left its marker (None otherwise, or when Redis does not answer)."""
    try:
        raw = client.hgetall(marker_key(lock_key))
    except RedisError:
        return None
    fields = _fields(raw)
    return loss_reason(fields) if fields and names(fields, owner, fence) else None
