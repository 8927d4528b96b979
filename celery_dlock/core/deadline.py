"""The deadline rule: until when a holder may believe it holds its lock.

Every hold, renewed or not, has a *local deadline* on the monotonic clock: the send
time of its last confirmed acquire, renewal or extend, plus its ttl, minus a margin for
clock drift and scheduling (:func:`lease_end`).  The server cannot expire the hold
before that moment, because it started counting the ttl no earlier than the request
was sent.  So a holder told at its deadline (the heartbeat's watchdog does that) is told
before any other owner can acquire, as long as its process is not paused for longer
than the margin and its clock runs at most :data:`DRIFT_RATE` faster than the server's::

    sent_at            server starts counting           server expires the key
       |-----------------------|-------------------------------|
       |<---------------- ttl * (1 - DRIFT_RATE) - margin ----->|  local deadline
"""

from __future__ import annotations

__all__ = ["DRIFT_RATE", "MAX_MARGIN", "lease_end"]

#: The local clock may run this much faster than the server's (a fraction of the ttl).
DRIFT_RATE = 0.01
#: Time the watchdog gets to wake and tell the holder (seconds; at most 10% of the ttl).
MAX_MARGIN = 0.05


def lease_end(sent_at: float, ttl_ms: int) -> float:
    """The local deadline of a hold confirmed by a request sent at ``sent_at``."""
    ttl = ttl_ms / 1000.0
    return sent_at + ttl * (1.0 - DRIFT_RATE) - min(MAX_MARGIN, ttl * 0.1)
