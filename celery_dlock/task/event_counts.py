"""Events counted per minute, for the operators' page's chart (``celery dlock web``).

When an app sets ``dlock_record_events``, every recorded event (a contention, a
duplicate call, a parked call, a lost lock, a release by hand:
:mod:`celery_dlock.task.events`) and every lock acquired by a task is also counted in
a hash per minute, ``<prefix>:counts:<minute>`` (the minute since the epoch, on the
recording worker's clock), one field per kind, kept for :data:`COUNTS_TTL`.  The
history list keeps the newest events only (:data:`~celery_dlock.task.events.EVENTS_MAX`);
the counts keep every event of the last hour, whatever their number, in at most 61
small hashes.

An acquisition costs one pipelined round trip (``HINCRBY``, ``EXPIRE``), only when the
app records events; acquisitions are not kept in the history list.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

__all__ = ["COUNTED", "COUNTS_TTL", "count_into", "counts_key", "minute_counts"]

#: The kinds counted, in the chart's order.
COUNTED = ("acquired", "contended", "duplicate", "parked", "lost", "released")
#: How long a minute's counts are kept (seconds): the hour shown, and some.
COUNTS_TTL = 2 * 3600


def counts_key(prefix: str, minute: int) -> str:
    """The hash counting the events of ``minute`` (minutes since the epoch)."""
    return f"{prefix}:counts:{minute}"


def count_into(pipe: Any, prefix: str, kind: str, at: float | None = None) -> None:
    """Queue on ``pipe`` the counting of one ``kind`` event at ``at`` (now)."""
    key = counts_key(prefix, int((time.time() if at is None else at) // 60))
    pipe.hincrby(key, kind, 1)
    pipe.expire(key, COUNTS_TTL)


def minute_counts(client: Any, prefix: str, now: float, minutes: int = 60,
                  kinds: Iterable[str] = COUNTED) -> dict[str, list[int]]:
    """Per kind, the count of each of the last ``minutes`` minutes, the oldest first
    (the last one is the minute of ``now``).  One pipelined round trip; Redis
    errors propagate."""
    last = int(now // 60)
    pipe = client.pipeline(transaction=False)
    for minute in range(last - minutes + 1, last + 1):
        pipe.hgetall(counts_key(prefix, minute))
    out = {kind: [0] * minutes for kind in kinds}
    for i, fields in enumerate(pipe.execute()):
        for raw_kind, raw_count in (fields or {}).items():
            kind = raw_kind.decode() if isinstance(raw_kind, bytes) else str(raw_kind)
            if kind in out:
                try:
                    out[kind][i] = int(raw_count)
                except ValueError:
                    continue  # not ours to read
    return out
