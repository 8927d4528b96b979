"""The queue markers' steps over one name's document (:class:`~.expiring.
ExpiringKeys`): claim, confirm, undo, hand-over, redelivery and clear, with exactly
the rules and replies of the Redis scripts (``celery_dlock.backends.redis.
marker_scripts``, where each rule is argued; ``model/markers.pml`` checks them).

The stores that keep a name's markers as one document (a SQL row, a znode) read it
with the server's clock and the name's hold, run a step here, and write the document
back by compare-and-set when the step changed it (a re-sent write then fails its
compare-and-set, and the step, run again on what the first one wrote, answers as a
re-sent Redis script does).  The keys, as on Redis (``P:{NAME}:m`` and its
neighbours): ``m`` the marker (the queued call's task id), ``r`` the replaced calls,
``c`` the claim record, ``w`` the retries waiting, ``b`` the replaces taken back.

No store is imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .expiring import ExpiringKeys

__all__ = ["MARKER", "TAKEN_BACK_MS", "Holder", "claim", "clear", "confirm", "hand_over",
           "redelivery", "undo"]

#: How long a replace taken back that leaves the replacing call queued is known to
#: that call's confirm (ms).
TAKEN_BACK_MS = 60_000

MARKER, REPLACED, RECORD, WAITING, TAKEN_BACK = "m", "r", "c", "w", "b"
_PENDING = ("pend", "pold", "pdl", "pop", "pcode", "pother")


class Holder(NamedTuple):
    """The name's live hold: its task id (None when the holder is not a task) and
    its ms left."""

    task_id: str | None
    left_ms: int


def _remember(k: ExpiringKeys, key: str, member: str, deadline: int) -> None:
    """Keep ``member`` in the sorted set ``key`` until ``deadline`` at least (the set
    lives as long as its longest-lived member); past members dropped first."""
    k.zremrangebyscore_upto(key, k.now)
    was = k.zscore(key, member)
    if was is None or was < deadline:
        k.zadd(key, deadline, member)
    keep = deadline - k.now
    if k.pttl(key) < keep:
        k.pexpire(key, keep)


def _expire_record(k: ExpiringKeys, ttl: int) -> None:
    if k.pttl(RECORD) < ttl:
        k.pexpire(RECORD, ttl)


def _go_on(k: ExpiringKeys, task_id: str, keep: int) -> Callable[[], tuple[int, str]]:
    def go_on() -> tuple[int, str]:
        if keep > 0:
            _remember(k, WAITING, task_id, k.now + keep)
        return 1, ""
    return go_on


def claim(k: ExpiringKeys, hold: Holder | None, task_id: str, ttl: int, *,
          running_counts: bool, replace: bool, requeue: bool, op: str,
          started: bool, waits: bool) -> tuple[int, str, int]:
    """A send's (or re-queue's) claim of the marker: ``(code, other task id, ms
    left)`` (the codes of ``celery_dlock.task.markers``)."""
    now, current = k.now, k.get(MARKER)
    (r_op, r_code, r_other, r_pend, r_pold, r_pdl, r_x, r_run) = k.hmget(
        RECORD, "op", "code", "other", "pend", "pold", "pdl", "x", "run")
    if r_x == op:
        return 2, "", 0  # taken back before it ran
    if requeue and not (started or waits):  # a started call's message come back
        found = k.zscore(WAITING, task_id)
        if found is not None and found > now:
            started, waits = running_counts, not running_counts
    if waits:
        _remember(k, WAITING, task_id, now + ttl)
        return 1, task_id, 0
    until = k.zscore(REPLACED, task_id)
    if until is not None and until <= now:
        until = None
    if requeue and until is not None:
        _remember(k, REPLACED, task_id, now + ttl)
        if r_pend is not None and r_pold == task_id and \
                (0 if r_pdl is None else int(r_pdl)) < now + ttl:
            k.hset(RECORD, {"pdl": now + ttl})
            _expire_record(k, ttl)
        return 2, current or "", k.pttl(MARKER)

    def holds_from_now() -> None:  # a started call's re-queue is never replaced
        if started:
            k.hset(RECORD, {"run": task_id})
            _expire_record(k, ttl)

    if current == task_id:
        if requeue:
            if r_pend == task_id:  # delivered: its publish went through
                k.hdel(RECORD, *_PENDING)
            k.pexpire(MARKER, ttl)
            holds_from_now()
            return 1, task_id, 0
        if r_op == op:
            return int(r_code or 0), r_other or "", 0  # a re-sent claim
        return 2, task_id, k.pttl(MARKER)
    if not requeue:  # a started call (running, or waiting for its retry): that call
        waiting = k.zscore(WAITING, task_id)
        if waiting is not None and waiting > now and not (
                hold is not None and hold.task_id == task_id):
            return 2, task_id, waiting - now  # (running: the holder's answer below)
    if until is not None:
        return 2, current or "", k.pttl(MARKER)
    if not requeue and hold is not None and (
            hold.task_id == task_id or (running_counts and current is None)):
        return 3, hold.task_id or "", hold.left_ms
    if current is not None:
        if requeue:
            return 2, current, k.pttl(MARKER)
        if replace and r_run != current and r_pend == current:
            return 5, current, k.pttl(MARKER)  # a replace not settled yet: wait
        if replace and r_run != current:
            left = k.pttl(MARKER)
            if left < 0:
                left = ttl
            _remember(k, REPLACED, current, now + max(left, ttl))
            k.set(MARKER, task_id, ttl)
            k.hdel(RECORD, "pold", "pdl", "conf", "back", "pop", "pcode", "pother")
            k.hset(RECORD, {"op": op, "code": 4, "other": current, "pend": task_id,
                            "pold": current, "pdl": now + left})
            if r_op is not None:  # the claim that wrote the replaced call's marker
                k.hset(RECORD, {"pop": r_op, "pcode": r_code or 0,
                                "pother": r_other or ""})
            _expire_record(k, ttl)
            return 4, current, 0
        return 2, current, k.pttl(MARKER)
    k.set(MARKER, task_id, ttl)
    if all(v is None for v in (r_op, r_pend, r_pold, r_x, r_run)):
        k.hset(RECORD, {"op": op, "code": 0, "other": ""})
        k.pexpire(RECORD, ttl)
    else:
        k.hdel(RECORD, "pend", "pold", "pdl", "conf", "back", "pop", "pcode", "pother")
        k.hset(RECORD, {"op": op, "code": 0, "other": ""})
        _expire_record(k, ttl)
    holds_from_now()
    return 0, "", 0


def confirm(k: ExpiringKeys, task_id: str) -> int:
    """The publish of a replace went through: 1 the replace stands; 0 revoke nothing
    (the replaced call started first, or this call is replaced itself); -1 nothing
    is known of it (revoke all the same)."""
    if k.hdel(TAKEN_BACK, task_id) == 1:
        return 0
    pend, conf, back = k.hmget(RECORD, "pend", "conf", "back")
    if conf == task_id:
        return 1
    if back == task_id:
        return 0
    if pend != task_id:
        until = k.zscore(REPLACED, task_id)
        return 0 if until is not None and until > k.now else -1
    k.hdel(RECORD, *_PENDING)
    k.hset(RECORD, {"conf": task_id})
    return 1


def undo(k: ExpiringKeys, task_id: str, op: str, ttl: int) -> int:
    """Take back the claim ``op`` of ``task_id`` (its publish failed, or its reply
    never came): 1 taken back, 0 nothing of it was left; a re-sent take-back gets the
    first reply."""
    current = k.get(MARKER)
    (r_op, r_pend, r_pold, r_pdl, r_x, r_xr, r_pop, r_pcode, r_pother) = k.hmget(
        RECORD, "op", "pend", "pold", "pdl", "x", "xr", "pop", "pcode", "pother")
    if r_x == op:
        return int(r_xr or 0)
    undone = 0
    if r_op == op:
        back = False
        if r_pend == task_id and r_pold is not None:
            k.zrem(REPLACED, r_pold)
            left = int(r_pdl or 0) - k.now
            if current == task_id:
                if left > 0:
                    k.set(MARKER, r_pold, left)
                    back = True
                else:
                    k.delete(MARKER)
        elif current == task_id:
            k.delete(MARKER)
        k.hdel(RECORD, "op", "code", "other", *_PENDING)
        if back and r_pop is not None:
            k.hset(RECORD, {"op": r_pop, "code": r_pcode or 0, "other": r_pother or ""})
        undone = 1
    elif r_pold == task_id:
        k.hdel(RECORD, "pold", "pdl")  # never published, replaced by a pending one
    k.hset(RECORD, {"x": op, "xr": undone})
    _expire_record(k, ttl)
    return undone


def hand_over(k: ExpiringKeys, task_id: str, *, remove: bool, replaced_check: bool,
              running_counts: bool, keep: int = 0) -> tuple[int, str]:
    """At a call's start: ``(1, '')`` go on (kept among the started calls waiting
    for ``keep`` ms, or until its end); ``(0, by)`` it was replaced."""
    go_on = _go_on(k, task_id, keep)
    current = k.get(MARKER)
    pend, pold = k.hmget(RECORD, "pend", "pold")
    until = k.zscore(REPLACED, task_id)
    waited = k.zrem(WAITING, task_id) == 1
    check = replaced_check and not waited
    if pend is not None and pend == task_id:
        k.hdel(RECORD, *_PENDING)
        k.hset(RECORD, {"conf": task_id})
    elif pend is not None and pold == task_id and check and not running_counts:
        # the replacing call stays queued; its confirm revokes nothing
        if k.pttl(TAKEN_BACK) < TAKEN_BACK_MS:
            k.pexpire(TAKEN_BACK, TAKEN_BACK_MS)
        k.hset(TAKEN_BACK, {pend: 1})
        if k.pttl(TAKEN_BACK) < TAKEN_BACK_MS:
            k.pexpire(TAKEN_BACK, TAKEN_BACK_MS)
        k.zrem(REPLACED, task_id)
        k.hdel(RECORD, *_PENDING)
        k.hset(RECORD, {"back": pend})
        return go_on()
    elif pend is not None and pold == task_id and check:
        left = max(k.pttl(MARKER), 0)
        k.zrem(REPLACED, task_id)
        _remember(k, REPLACED, pend, k.now + max(left, 1))
        if remove and current == pend:
            k.delete(MARKER)
        k.hdel(RECORD, "op", "code", "other", *_PENDING)
        k.hset(RECORD, {"back": pend})
        return go_on()
    if check and until is not None and until > k.now:
        return 0, current or "a later call"
    if current == task_id:
        if remove:
            k.delete(MARKER, RECORD)
        return go_on()
    if current is not None and check:
        return 0, current
    return go_on()


def redelivery(k: ExpiringKeys, task_id: str, ttl: int, *, running_counts: bool
               ) -> int:
    """The worker process running ``task_id`` died and its message will come back:
    a call that had started is kept live as its retry would be (1), else nothing is
    written (0)."""
    current = k.get(MARKER)
    if current == task_id:
        return 0
    until = k.zscore(REPLACED, task_id)
    if until is not None and until > k.now:
        return 0
    if running_counts:
        if current is not None:
            return 0
        k.set(MARKER, task_id, ttl)
        k.hset(RECORD, {"run": task_id})
        _expire_record(k, ttl)
        return 1
    _remember(k, WAITING, task_id, k.now + ttl)
    return 1


def clear(k: ExpiringKeys, task_id: str) -> int:
    """The call ends (or ends without running): its marker removed (1), and its task
    id from the retries waiting."""
    current = k.get(MARKER)
    k.zrem(WAITING, task_id)
    if current == task_id:
        return k.delete(MARKER)
    return 0
