"""The deadline rule: until when a holder may believe it holds its lock.

Every hold, renewed or not, has a *local deadline*: the send time of its last confirmed
acquire, renewal or extend, plus its ttl, minus a margin (:func:`lease_end`).  The
server cannot expire the hold before that moment, because it started counting the ttl
no earlier than the request was sent.  So a holder told at its deadline (the
scheduler's watchdog does that) is told before any other owner can acquire, as long as

* its clock runs at most :data:`DRIFT_RATE` (a backend may allow more) faster than the
  server's, and
* its process is not frozen at the deadline for longer than the *pause budget*
  (a stop-the-world GC pause, a SIGSTOP, a VM steal): the watchdog must get to run::

    sent_at            server starts counting           server expires the key
       |-----------------------|-------------------------------|
       |<-- ttl - drift - pause budget -->|  local deadline
                                          |<- pause budget ->|

The pause budget (:func:`pause_budget`) costs nothing while renewals succeed (they
come every ``ttl/3``); it only moves the moment a holder whose renewals fail is told.
Its default is a tenth of the ttl, at most :data:`MAX_PAUSE_BUDGET` (2 s at a ttl of
20 s or more; 1 s at 10 s); a lock may set its own (``pause_budget=``), at most half
its ttl.

Times are read from :func:`clock`: ``CLOCK_BOOTTIME`` on Linux, which goes on counting
while the machine is suspended, so a laptop or VM that resumes after its locks expired
finds its holds past their deadlines (``CLOCK_MONOTONIC`` stops during a suspend).
Where the platform has no such clock, :func:`time.monotonic` is used and a suspend
longer than the remaining deadline is not noticed until the next renewal (which finds
the hold gone and reports it lost).
"""

from __future__ import annotations

import time

__all__ = [
    "DRIFT_RATE",
    "MAX_PAUSE_BUDGET",
    "PAUSE_SHARE",
    "clock",
    "lease_end",
    "margin_of",
    "pause_budget",
]

#: The local clock may run this much faster than the server's (a fraction of the ttl).
DRIFT_RATE = 0.01
#: The default pause budget is this share of the ttl ...
PAUSE_SHARE = 0.1
#: ... and at most this many seconds.
MAX_PAUSE_BUDGET = 2.0

if hasattr(time, "CLOCK_BOOTTIME"):
    _BOOTTIME = time.CLOCK_BOOTTIME

    def clock() -> float:
        """Seconds on a clock that never goes back and counts suspended time."""
        return time.clock_gettime(_BOOTTIME)
else:  # pragma: no cover - not Linux
    clock = time.monotonic


def pause_budget(ttl: float, configured: float | None = None) -> float:
    """How long (seconds) a holder with this ``ttl`` may be frozen at its deadline and
    still be told first: ``configured``, or the default; never more than half the
    ttl (renewals come every third of it)."""
    budget = configured
    if budget is None:
        budget = min(ttl * PAUSE_SHARE, MAX_PAUSE_BUDGET)
    return min(budget, ttl / 2.0)


def margin_of(ttl_ms: int, configured_budget: float | None = None,
              drift_rate: float = DRIFT_RATE) -> float:
    """What a deadline keeps back from the ttl (seconds): the drift allowance plus the
    pause budget."""
    ttl = ttl_ms / 1000.0
    return ttl * drift_rate + pause_budget(ttl, configured_budget)


def lease_end(sent_at: float, ttl_ms: int, margin: float | None = None) -> float:
    """The local deadline of a hold confirmed by a request sent at ``sent_at``
    (``margin``: :func:`margin_of` the ttl by default)."""
    if margin is None:
        margin = margin_of(ttl_ms)
    return sent_at + ttl_ms / 1000.0 - margin
