"""A hold's maximum length (``max_hold``): the bound renewal never passes.

A lock made with ``max_hold=S`` is renewed as usual, but never past ``S`` seconds after
the send time of the acquire that took the hold (its *bound*, on the holder's clock)::

    t0            acquire sent: bound = t0 + S
    ...           renewals every ttl/3, each asking for the full ttl
    b - ttl/3..   the renewal that would pass the bound asks only for the time left
                  (bound - its send time): the server's hold ends at the bound (plus
                  the request's one-way delay); no renewal follows
    b - margin    the holder's deadline: reported lost, reason "max hold of Ss
                  reached" (on_lost, lost, LockLost from ensure_held); the margin is
                  the usual one (drift allowance + pause budget), so the holder is told
                  before the server could grant the lock to anyone else
    b             the server's hold expires: another owner may acquire

The hold is not released at the bound: it expires by itself on the server, so the rule
that tells a holder before its lock can pass on is the one of every deadline
(:mod:`celery_dlock.core.deadline`), and a holder that is frozen or cut off at the
bound changes nothing.  Re-entries and ``extend`` never move the bound either (they
are cut short like a renewal).  A ``max_hold`` shorter than the ttl cuts the first
grant itself to the bound (as Redisson's ``leaseTime`` does): the hold is never
renewed, its deadline (and so the moment its holder is told) is the bound less the
margin of that shorter lease, and the server's hold expires at the bound.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import InvalidLockConfig
from .ttl import MAX_TTL

__all__ = ["capped_ms", "check_max_hold", "first_lease_ms", "reached_reason"]


def check_max_hold(max_hold: Any, name: str | None = None,
                   what: str = "max_hold") -> float | None:
    """``max_hold`` as seconds (None: unbounded); InvalidLockConfig unless it is a
    finite positive number of seconds (at least a millisecond)."""
    if max_hold is None:
        return None
    if isinstance(max_hold, bool) or not isinstance(max_hold, (int, float)) or \
            not math.isfinite(max_hold) or max_hold <= 0:
        raise InvalidLockConfig(f"{what} must be a positive number of seconds or None, "
                                f"got {max_hold!r}", lock_name=name)
    if max_hold > MAX_TTL * 12:
        raise InvalidLockConfig(f"{what} must be at most {MAX_TTL * 12:g} seconds, got "
                                f"{max_hold!r}", lock_name=name)
    if max_hold < 0.001:
        raise InvalidLockConfig(f"{what} must be at least 0.001 seconds, got "
                                f"{max_hold!r}", lock_name=name)
    return float(max_hold)


def first_lease_ms(ttl_ms: int, max_hold: float | None) -> int:
    """The ttl (ms) a fresh hold is granted: the lock's, or a shorter max hold."""
    if max_hold is None:
        return ttl_ms
    return max(1, min(ttl_ms, math.floor(max_hold * 1000)))


def capped_ms(ttl_ms: int, bound: float | None, sent_at: float) -> int:
    """The ttl (ms) a renewal, re-entry or extend sent at ``sent_at`` may ask for:
    ``ttl_ms``, or only the whole milliseconds left to ``bound`` (0: reached)."""
    if bound is None:
        return ttl_ms
    return max(0, min(ttl_ms, math.floor((bound - sent_at) * 1000)))


def reached_reason(max_hold: float) -> str:
    """Why a hold at its bound is lost (the words of ``lost_reason``)."""
    return f"max hold of {max_hold:g}s reached"
