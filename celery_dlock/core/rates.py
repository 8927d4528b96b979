"""A per-name rate (``lock_rate="5/s"``): what it means, how it is written, and what a
backend that keeps rates answers.  Backend-neutral; the Celery face is
:mod:`celery_dlock.task.rate`, the Redis keeper :mod:`celery_dlock.backends.redis.rate`.

**The rule: GCRA** (the generic cell rate algorithm, a token bucket kept as one
timestamp).  A rate of ``R`` per period ``P`` has the *interval* ``T = P / R``; a
*burst* ``B`` (default 1) lets ``B`` calls through at once after a quiet spell.  The
server keeps, per name, the *theoretical arrival time* ``tat`` (on the server's clock):

* a call at ``now`` may start when ``max(tat, now) - (B - 1) * T <= now``; it then
  moves ``tat`` to ``max(tat, now) + T``;
* otherwise it is given the *slot* ``max(tat, now) - (B - 1) * T`` (the first moment it
  may start) and ``tat`` moves on by ``T`` all the same: the slot is reserved for it, so
  calls parked one after another get successive slots, in the order they asked;
* a parked call that comes back at its slot (no earlier, at most one interval later)
  starts without asking again, and the slot is spent; one that comes back later than
  that asks afresh (its slot passed unused; it is never dropped), and so does one whose
  slot was spent already (the same message delivered again after a worker died while
  running it, or a retry whose message kept the slot): a slot starts one body.

So at most ``R + B - 1`` starts are granted in any period-long window, and, as a
parked call may start up to one interval after its slot, at most ``R + B`` calls start
in any window of one period.  That holds for the *starts of bodies* only if a grant is
asked for right before the body starts: the Celery face asks with the call's lock
held (after any wait for it), never before it is taken.  Every time is the server's
(``TIME`` inside the script): the workers' clocks matter only to when a parked
message comes back.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from .errors import InvalidLockConfig

__all__ = ["PERIODS", "Rate", "RateDecision", "RateState", "parse_rate"]

#: The periods a rate may name, in seconds.
PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)/([smh])")
#: The most calls per second a rate may allow (its interval is counted in whole
#: microseconds on the server).
MAX_PER_SECOND = 100_000


class Rate(NamedTuple):
    """``calls`` per ``period`` seconds, ``burst`` of them at once."""

    calls: float
    period: float
    burst: int = 1
    text: str = ""

    @property
    def interval(self) -> float:
        """Seconds between two calls at the steady rate."""
        return self.period / self.calls

    def __str__(self) -> str:
        return self.text or f"{self.calls:g}/{self.period:g}s"


class RateDecision(NamedTuple):
    """A backend's answer to a call under a rate: ``run`` now, or wait ``delay``
    seconds for the ``slot`` reserved for it (server microseconds, to give back when
    it comes: :meth:`~celery_dlock.core.protocol.RateStore.take`)."""

    run: bool
    delay: float = 0.0
    slot: int | None = None


class RateState(NamedTuple):
    """A name's rate as the server keeps it (for ``celery dlock show``):
    ``interval`` and ``burst`` of the last call, how many calls may start now
    (``available``), and in how many seconds the next slot is free (``next_in``: 0
    when a call may start now)."""

    interval: float
    burst: int
    available: int
    next_in: float

    def as_dict(self) -> dict[str, Any]:
        return self._asdict()


def parse_rate(value: Any, burst: Any = 1, where: str = "lock_rate") -> Rate:
    """``"5/s"``, ``"100/m"``, ``"0.5/h"`` as a :class:`Rate`; InvalidLockConfig,
    naming ``where``, for anything else (no spaces, no other unit, a count > 0)."""
    if isinstance(value, Rate):
        return value._replace(burst=check_burst(burst)) if burst != value.burst \
            else value
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    count = float(match.group(1)) if match else 0.0
    if not match or count <= 0:
        raise InvalidLockConfig(f"{where} must be a rate like '5/s', '100/m' or '2/h' "
                                f"(a number > 0, '/', then s, m or h), got {value!r}")
    period = PERIODS[match.group(2)]
    if count / period > MAX_PER_SECOND:
        raise InvalidLockConfig(f"{where} may allow at most {MAX_PER_SECOND} calls a "
                                f"second, got {value!r}")
    return Rate(count, period, check_burst(burst), value)


def check_burst(value: Any, where: str = "lock_rate_burst") -> int:
    """A burst: a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidLockConfig(f"{where} must be a whole number >= 1, got {value!r}")
    return value
