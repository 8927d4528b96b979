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

**The decision, once** (:func:`gcra_take`, pure): what a store keeps per name (a
:class:`RateDocument`: ``tat``, ``interval``, ``tau`` = ``(B - 1) * T``, the last
:data:`OPS_KEPT` operation ids with their answers, the reserved slots not yet claimed,
and when it lapses, all server microseconds) and what a call gets.  The Redis script
(:mod:`celery_dlock.backends.redis.rate`) is the same rule in Lua, run inside the
server; the SQL stores read the document, decide here, and write it back by
compare-and-set.  :func:`rate_state` is what ``celery dlock show`` reads of it, for
every store.
"""

from __future__ import annotations

import math
import re
import uuid
from typing import Any, NamedTuple

from .errors import InvalidLockConfig

__all__ = ["OPS_KEPT", "PERIODS", "Rate", "RateDecision", "RateDocument", "RateState",
           "RateTake", "TakesByOperation", "gcra_take", "interval_tau", "ops_of",
           "ops_text", "parse_rate", "rate_state", "slots_of", "slots_text"]

#: The periods a rate may name, in seconds.
PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)/([smh])")
#: The most calls per second a rate may allow (its interval is counted in whole
#: microseconds on the server).
MAX_PER_SECOND = 100_000
#: How many operation ids (with their answers) a name's rate state keeps: a call
#: re-sent after more than this many others were answered takes a second slot.
OPS_KEPT = 8
#: How long a name's state outlives its ``tat`` (us): a quiet name keeps nothing.
LINGER_US = 1_000_000


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


class RateDocument(NamedTuple):
    """A name's rate state as a store keeps it (server microseconds): ``ops`` the
    last :data:`OPS_KEPT` answers, newest first, each ``(op id, code, slot)``;
    ``slots`` the reserved slots not yet claimed, in the order given; ``expires``
    when the whole state lapses."""

    tat: int
    interval: int
    tau: int
    ops: tuple[tuple[str, int, int], ...] = ()
    slots: tuple[int, ...] = ()
    expires: int = 0


class RateTake(NamedTuple):
    """:func:`gcra_take`'s answer: ``code`` 1 start now, 0 parked (wait ``wait_us``
    for the slot ``given_us``), 2 back too early for its slot (wait again); the
    ``document`` to store, or None when nothing changes."""

    code: int
    wait_us: int
    given_us: int
    document: RateDocument | None


def _remember(ops: tuple[tuple[str, int, int], ...], op: str, code: int,
              given: int) -> tuple[tuple[str, int, int], ...]:
    return ((op, code, given), *ops[:OPS_KEPT - 1])


def gcra_take(document: RateDocument | None, now_us: int, interval: int, tau: int,
              slot: int | None, op: str) -> RateTake:
    """The answer to the call ``op`` (a parked one coming back for ``slot``, or
    None) under a rate of ``interval`` and ``tau`` (us) at ``now_us``, given the
    name's live ``document`` (None: no state, or it lapsed).  Exactly the Redis
    script's rule: a re-sent op gets its first answer and changes nothing; a slot is
    claimed once, by a call back no earlier than it and at most one interval late;
    slots past their last moment are dropped at every write; a grant and a parking
    both move ``tat`` on by one interval; the state lapses :data:`LINGER_US` (rounded
    up to a whole millisecond) after the new ``tat``, a claim leaving that as it
    was."""
    if slot is not None and now_us < slot:
        return RateTake(2, slot - now_us, slot, None)
    ops = document.ops if document is not None else ()
    if op:
        for seen, code, given in ops:
            if seen == op:
                if code == 1 or given <= now_us:
                    return RateTake(code, 0, given, None)
                return RateTake(0, given - now_us, given, None)
    pending: list[int] = []
    mine = False
    for reserved in document.slots if document is not None else ():
        if reserved == slot:
            mine = True
        elif reserved + interval >= now_us:
            pending.append(reserved)
    if mine and document is not None and slot is not None and \
            now_us <= slot + interval:
        return RateTake(1, 0, slot, document._replace(
            ops=_remember(ops, op, 1, slot), slots=tuple(pending)))
    tat = max(document.tat if document is not None else 0, now_us)
    at = max(tat - tau, now_us)
    new = tat + interval
    lapse = (math.ceil((new - now_us) / 1000) * 1000) + LINGER_US
    code = 1 if at <= now_us else 0
    if not code:
        pending.append(at)
    stored = RateDocument(new, interval, tau, _remember(ops, op, code, at),
                          tuple(pending), now_us + lapse)
    if code:
        return RateTake(1, 0, now_us, stored)
    return RateTake(0, at - now_us, at, stored)


def interval_tau(rate: Rate) -> tuple[int, int]:
    """``rate``'s interval and tau (``(burst - 1) * interval``) in whole
    microseconds (at least 1 for the interval), as every store counts them."""
    interval = max(1, round(rate.interval * 1_000_000))
    return interval, interval * (rate.burst - 1)


def rate_state(tat: int, interval: int, tau: int, now_us: int) -> RateState:
    """What a name's state (``tat``, ``interval``, ``tau``: server us) means at
    ``now_us``: how many calls may start now (the burst left, as GCRA counts it) and
    in how long the next may."""
    interval = max(1, interval)
    tat = max(tat, now_us)
    available = (now_us + tau - tat) // interval + 1 if tat - tau <= now_us else 0
    return RateState(interval=interval / 1_000_000, burst=tau // interval + 1,
                     available=int(available),
                     next_in=max(0, tat - tau - now_us) / 1_000_000)


def ops_text(ops: tuple[tuple[str, int, int], ...]) -> str:
    """``ops`` as the Redis hash keeps them (`` id:code:slot`` each, newest first)."""
    return "".join(f" {op}:{code}:{given}" for op, code, given in ops)


def ops_of(text: str) -> tuple[tuple[str, int, int], ...]:
    """:func:`ops_text` read back."""
    found = []
    for entry in text.split():
        op, code, given = entry.rsplit(":", 2)
        found.append((op, int(code), int(given)))
    return tuple(found)


def slots_text(slots: tuple[int, ...]) -> str:
    """``slots`` as the Redis hash keeps them (`` slot`` each)."""
    return "".join(f" {slot}" for slot in slots)


def slots_of(text: str) -> tuple[int, ...]:
    """:func:`slots_text` read back."""
    return tuple(int(entry) for entry in text.split())


class TakesByOperation:
    """What every rate store shares: :meth:`take` is one new operation id (a store
    answers a re-sent call of it as it answered the first, and takes no second
    slot)."""

    def take(self, prefix: str, name: str, rate: Rate,
             slot: int | None = None) -> RateDecision:
        return self.take_op(prefix, name, rate, slot, uuid.uuid4().hex)

    def take_op(self, prefix: str, name: str, rate: Rate, slot: int | None,
                op: str) -> RateDecision:
        """:meth:`take` as the call ``op`` (the same op twice takes one slot)."""
        raise NotImplementedError
