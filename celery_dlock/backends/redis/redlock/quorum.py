"""What the answers of a Redlock's nodes say, and how a failed attempt is undone.

Pure functions over the per-node outcomes of
:func:`celery_dlock.backends.redis.redlock.nodes.fan_out` (a reply, a
:class:`NodeFailed`, or None for a node not waited for), used by
:mod:`celery_dlock.backends.redis.redlock`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError

from ....core.errors import BackendUnavailable, DLockError, Holder, InvalidLockConfig
from ....core.protocol import new_op_id
from ..keyspace import LockKeys, parse_holder
from ..refusals import refusal
from ..scripts import ACQUIRE, READ_HOLD, RELEASE
from .nodes import POOL_SLACK, NodeFailed, Outcome, fan_out, submit
from .report import describe, describe_error, warn_now_and_then
from .workers import NodeBusy, NotSent

__all__ = [
    "DEFAULT_NODE_TIMEOUT",
    "REDLOCK_NO_SEMAPHORE",
    "Holds",
    "answered",
    "check_redlock_limit",
    "check_timing",
    "failures",
    "give_back",
    "majority_holder",
    "op_id",
    "quorum_holder",
    "raise_conflict",
    "read_holds",
    "refused",
    "unavailable",
]

logger = logging.getLogger("celery_dlock.redlock")

#: The longest one node may take to answer (seconds; at most a tenth of the ttl).
DEFAULT_NODE_TIMEOUT = 0.5

#: Who holds the lock on the nodes that answered (by owner; None: free).
Holds = dict[str | None, list[Holder]]


op_id = new_op_id


def answered(reply: Any) -> bool:
    return reply is not None and not isinstance(reply, NodeFailed)


#: Why a Redlock keeps no semaphore (docs/deployments.md).
REDLOCK_NO_SEMAPHORE = (
    "lock_limit > 1 (a semaphore) is not supported with Redlock (several independent "
    "servers): each node would count the holders on its own, and a quorum of nodes "
    "can each grant a different set of holders, so more than lock_limit could run at "
    "once; use one Redis, a Cluster or Sentinel for tasks with lock_limit > 1")


def check_redlock_limit(limit: object, name: str | None = None) -> None:
    """InvalidLockConfig unless ``limit`` is 1: Redlock keeps no semaphores."""
    if limit != 1:
        raise InvalidLockConfig(REDLOCK_NO_SEMAPHORE, lock_name=name)


def check_timing(name: str, ttl: float, drift_factor: Any,
                 node_timeout: Any) -> tuple[float, float]:
    """``(drift_factor, node_timeout)`` checked (InvalidLockConfig naming them);
    ``node_timeout`` None: ``min(0.5, ttl / 10)``."""
    if isinstance(drift_factor, bool) or not isinstance(drift_factor, (int, float)) \
            or not 0 <= drift_factor < 0.5:
        raise InvalidLockConfig(f"drift_factor must be a number in [0, 0.5), got "
                                f"{drift_factor!r}", lock_name=name)
    if node_timeout is None:
        node_timeout = min(DEFAULT_NODE_TIMEOUT, ttl / 10)
    elif isinstance(node_timeout, bool) or \
            not isinstance(node_timeout, (int, float)) or \
            not math.isfinite(node_timeout) or not 0 < node_timeout < ttl:
        raise InvalidLockConfig(f"node_timeout must be a positive number of seconds "
                                f"below the ttl, got {node_timeout!r}", lock_name=name)
    return float(drift_factor), float(node_timeout)


def failures(out: Outcome) -> list[BaseException | None]:
    """Per node, the error its call raised (None: it answered, or no error known)."""
    return [r.error if isinstance(r, NodeFailed) else None for r in out]


def unavailable(name: str, what: str, out: Outcome, quorum: int,
                clients: Sequence[Any] = ()) -> BackendUnavailable:
    """The error for too few answers: how many answered, and each node's failure
    (named by ``clients`` when given, without credentials)."""
    count = sum(1 for r in out if answered(r))
    failed = [(i, r) for i, r in enumerate(out) if isinstance(r, NodeFailed)]
    if not failed:
        error = "no answer"
    elif not clients:
        error = describe_error(failed[0][1].error)
    else:
        error = "; ".join(f"{describe(clients[i], i)}: {describe_error(r.error)}"
                          for i, r in failed)
    return BackendUnavailable(
        f"Redlock unavailable during {what}: {count} of {len(out)} nodes answered, "
        f"{quorum} needed ({error})", lock_name=name)


def refused(nodes: Sequence[Any], keys: LockKeys, name: str, out: Outcome,
            i: int) -> DLockError | None:
    """What node ``i``'s refusal stands for (another application's data at a lock
    key: LockKeyConflict; a command its user may not run: InvalidLockConfig), or
    None."""
    reply = out[i]
    if isinstance(reply, NodeFailed) and reply.error is not None:
        return refusal(reply.error, nodes[i], keys, name)
    return None


def raise_conflict(nodes: Sequence[Any], keys: LockKeys, name: str,
                   out: Outcome, have: int, quorum: int) -> None:
    """LockKeyConflict when a node holds another application's data at a lock key,
    InvalidLockConfig when its user may not run a command of the scripts: for a call
    that did not get its quorum (``have`` of ``quorum`` said yes) because of such
    nodes, which did not grant (nothing was written there).  When the others decided
    the call (another owner holds the lock), they say what happened instead."""
    errors = [error for i in range(len(out))
              if (error := refused(nodes, keys, name, out, i)) is not None]
    if errors and have + len(errors) >= quorum:
        raise errors[0]


def majority_holder(out: Outcome, refused: Sequence[int]) -> Holder | None:
    """The holder named by most of the nodes that refused an acquire."""
    holders: Holds = {}
    for i in refused:
        reply = out[i]
        holder = parse_holder(reply[3:], int(reply[1]), int(reply[2]))
        holders.setdefault(holder.owner, []).append(holder)
    if not holders:
        return None
    return max(holders.values(), key=len)[0]


def give_back(nodes: Sequence[Any], keys: LockKeys, owner: str, args: Sequence[Any],
              out: Outcome, late: Mapping[int, cf.Future[Any]], timeout: float,
              name: str, ttl: float) -> None:
    """Undo an acquire attempt (``args``, with its operation id) on every node that
    granted it or did not answer.  A granted node gets a release, waited for.  A node
    that did not answer is undone in the background, once its first request ended
    (``late``): the same request again (if the first ran, this is its answer, else it
    runs now), then a release if it granted; acquire-then-release changes nothing
    whatever order it takes with the caller's next attempt, so a hung node costs the
    caller nothing more.  Each release names the acquire it undoes (its operation
    id), so it takes back only that acquire's count: one that reaches a node late
    (after the caller's next attempt took a new hold there) leaves that hold alone."""
    lock = (keys.lock,)
    granted = {i for i, r in enumerate(out) if answered(r) and int(r[0]) == 1}
    undoes = str(args[3])  # the attempt's operation id
    keep = args[5]  # the name's fence ttl (ms)

    def release(i: int, node: Any) -> Any:
        if i not in granted:
            return None
        return RELEASE(node, lock, (owner, op_id(), "", undoes, keep))

    def undo(i: int, node: Any) -> None:
        first = late.get(i)
        if first is not None:
            cf.wait([first], timeout=timeout + POOL_SLACK)
            if first.done() and isinstance(first.exception(), (NotSent, NodeBusy)):
                return  # never sent: nothing to undo
        try:
            if int(ACQUIRE(node, lock, args)[0]) == 1:
                RELEASE(node, lock, (owner, op_id(), "", undoes, keep))
        except RedisError as exc:
            where = describe(node, i)
            warn_now_and_then((where, "give-back", type(exc).__name__),
                              "lock %r: Redlock node %s did not confirm the give-back "
                              "(%s); a hold left there expires within %gs (reported "
                              "at most once a minute)", name, where, describe_error(exc),
                              ttl)

    def unsent(reply: Any) -> bool:
        return isinstance(reply, NodeFailed) and isinstance(reply.error,
                                                            (NotSent, NodeBusy))

    for i, reply in enumerate(out):
        if not answered(reply) and not unsent(reply):
            # Not sent when that node's workers are still busy past the wait: a hold
            # the first request left there expires within the ttl.
            submit(nodes[i], undo, i, nodes[i],
                   deadline=time.monotonic() + 2 * (timeout + POOL_SLACK))
    if granted:
        results = fan_out(nodes, release, timeout)
        missed = sum(1 for i in granted if isinstance(results[i], NodeFailed))
        if missed:
            logger.warning("lock %r: %d node(s) did not confirm the give-back; a hold "
                           "left there expires within %gs", name, missed, ttl)


def _group(out: Outcome) -> tuple[Holds, int]:
    found: Holds = {}
    for reply in out:
        if not answered(reply):
            continue
        pttl, secs, usecs = (int(x) for x in reply[:3])
        holder = (parse_holder(reply[3:], pttl, secs * 1000 + usecs // 1000)
                  if len(reply) > 3 else None)
        found.setdefault(holder.owner if holder is not None else None, []).append(
            holder or Holder())
    return found, len(out) - sum(len(v) for v in found.values())


def read_holds(nodes: Sequence[Any], keys: LockKeys, name: str, what: str,
               timeout: float, quorum: int, owner: str | None = None) -> Holds:
    """Who holds the lock on each node that answered; stops asking once the answer
    is settled (for ``owner`` when given, else for whoever holds a quorum).
    BackendUnavailable when the answers leave it open."""
    lock = (keys.lock,)

    def call(_: int, node: Any) -> Any:
        return READ_HOLD(node, lock, ())

    def settled(out: Outcome) -> bool:
        found, unknown = _group(out)
        if owner is not None:
            count = len(found.get(owner, ()))
        else:
            count = max((len(v) for k, v in found.items() if k is not None), default=0)
        return count >= quorum or count + unknown < quorum

    out = fan_out(nodes, call, timeout, settled)
    if not settled(out):
        raise_conflict(nodes, keys, name, out, quorum, quorum)
        raise unavailable(name, what, out, quorum)
    return _group(out)[0]


def quorum_holder(found: Holds, quorum: int) -> Holder | None:
    """The holder on a quorum of nodes (None: nobody); its ``ttl`` is how long that
    quorum lasts without renewal, and it has no fence."""
    for owner, holders in found.items():
        if owner is not None and len(holders) >= quorum:
            ttls = sorted((h.ttl or 0.0 for h in holders), reverse=True)
            first = holders[0]
            return Holder(owner=first.owner, count=first.count, fence=None,
                          age=first.age, ttl=ttls[quorum - 1], info=dict(first.info))
    return None
