"""``RedlockLock``: the lock of :class:`~celery_dlock.RedisLock` held on a quorum of N
independent Redis servers (the Redlock algorithm of the Redis distributed-lock page).

Opt-in, for when no single Redis (with a replica) may be a single point of failure.
On each node the hold is exactly a RedisLock's (the same scripts and keys: owner
checks, re-entry counts, operation ids), and the lock is held while a quorum
(``N // 2 + 1``) of nodes holds it for its owner::

    t0  send ACQUIRE to nodes 1..3 at once (each call bounded by node_timeout)
    t1  nodes 1 and 3 granted, node 2 hangs      quorum (2 of 3) at t1
        validity = ttl - (t1 - t0) - drift > 0    granted; deadline t0 + ttl - drift
    t2  the scheduler renews on every node at once; the deadline moves when a quorum
        confirmed; a quorum that can no longer be reached is a lost hold (on_lost)

A grant short of a quorum, or whose validity ran out before the quorum answered, is
given back on every node, those that did not answer included (their request is
re-sent with its operation id first, so a give-back never undoes an earlier acquire).

**No fencing token**: :attr:`RedlockLock.fence` raises :class:`FencingUnavailable`.
Each node has its own counter, and a node that restarts without its data starts it
again, so the highest counter of a quorum can go backwards across holders.  See
docs/deployments.md ("Redlock") for the assumptions (bounded clock drift and pauses,
persistence or delayed restarts) and why fencing still matters.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ....core.deadline import pause_budget
from ....core.errors import FencingUnavailable, Holder, InvalidLockConfig
from ....core.hold import Hold
from ....core.lock_args import DEFAULT_PREFIX
from ....core.lock_options import LockOptions
from ....core.max_hold import first_lease_ms
from ....core.protocol import GONE, OK, STILL_HELD, TAKEN, Grant, Refused, new_op_id
from ....core.renew_target import RenewTarget
from ....core.scheduler import RenewalScheduler
from ..keyspace import LockKeys
from ..scripts import ACQUIRE, EXTEND, RELEASE
from ..server_checks import check_server
from .nodes import (
    POOL_SLACK,
    Outcome,
    check_distinct,
    check_nodes,
    fan_out,
    learn_run_id,
    node_client,
    quorum_of,
    renew_target,
)
from .quorum import (
    DEFAULT_NODE_TIMEOUT,
    Holds,
    answered,
    check_redlock_limit,
    check_timing,
    failures,
    give_back,
    majority_holder,
    quorum_holder,
    raise_conflict,
    read_holds,
    unavailable,
)
from .report import report_refusals

__all__ = ["DEFAULT_NODE_TIMEOUT", "FENCE_REFUSAL", "RETRY_DELAY", "RedlockLock"]

logger = logging.getLogger("celery_dlock.redlock")

#: A blocked acquire tries again after a random delay of up to this (seconds).
RETRY_DELAY = 0.2
#: Fixed part of the drift allowance (seconds), as on the Redis distributed-lock page.
DRIFT_FLOOR = 0.002
#: Why :attr:`RedlockLock.fence` raises.
FENCE_REFUSAL = (
    "Redlock gives no fencing token: each node counts on its own and a node that "
    "restarts without its data starts again from 0, so the highest count of a quorum "
    "can go backwards; use a monotonic token of your own (a database sequence)")
_LOST_ON_MAJORITY = "expired or taken on a majority of its nodes"


class RedlockLock(Hold):
    """A reentrant lock held on a quorum of N independent Redis servers.

    The interface is :class:`~celery_dlock.RedisLock`'s (acquire, release, extend,
    locked, owned, ensure_held, holder, context manager), with these differences:

    :param clients: 3 or more ``redis.Redis`` clients of independent servers (not a
        cluster client; not one server twice).  ``N // 2 + 1`` of them make a quorum.
    :param drift_factor: the share of the ttl allowed for clock drift between this
        process and the servers; a hold is valid for ``ttl - elapsed - drift`` with
        ``drift = ttl * drift_factor + 2 ms`` (never less than RedisLock's margin),
        less the pause budget.
    :param node_timeout: the longest one node may take to answer a call (default
        ``min(0.5, ttl / 10)``): a node that hangs never costs more.
    :param max_hold: seconds after which the hold is no longer renewed and is reported
        lost (None: unbounded; see :mod:`celery_dlock.core.max_hold`).
    :param fence_ttl: seconds each node keeps the name's fence counter after its last
        grant or release (None: a day, or ``ttl`` when longer; see RedisLock).

    :attr:`fence` raises :class:`FencingUnavailable` (see the module docs).
    """

    fences = False

    def __init__(
        self,
        clients: Sequence[Any],
        name: str,
        ttl: float = 30.0,
        *,
        auto_renew: bool = True,
        owner: str | None = None,
        on_lost: Callable[[RedlockLock], object] | None = None,
        prefix: str = DEFAULT_PREFIX,
        info: Mapping[str, object] | None = None,
        blocking_timeout: float | None = None,
        scheduler: RenewalScheduler | None = None,
        drift_factor: float = 0.01,
        node_timeout: float | None = None,
        pause_budget: float | None = None,
        max_hold: float | None = None,
        fence_ttl: float | None = None,
    ) -> None:
        self._open(clients, LockOptions(
            name, ttl, prefix=prefix, owner=owner, on_lost=on_lost, info=info,
            blocking_timeout=blocking_timeout, scheduler=scheduler,
            auto_renew=auto_renew, pause_budget=pause_budget, max_hold=max_hold,
            fence_ttl=fence_ttl), drift_factor, node_timeout)

    def _open(self, where: Any, options: LockOptions, drift_factor: float = 0.01,
              node_timeout: float | None = None) -> None:
        name = options.name
        check_redlock_limit(options.limit, name)
        super().__init__(options)
        self.clients = check_nodes(where, name)
        self.quorum = quorum_of(len(self.clients))
        self.drift_factor, self.node_timeout = check_timing(name, self.ttl, drift_factor,
                                                            node_timeout)
        self._nodes = tuple(node_client(c, self.node_timeout) for c in self.clients)
        self.keys = LockKeys.for_name(options.prefix, name)
        # Calls of a granted acquire still out to slow nodes: a release waits for them
        # (at most node_timeout), so it never reaches a node before its acquire.
        self._in_flight: dict[int, list[cf.Future[Any]]] = {}
        # Per node, the fence of this object's fresh hold there (None: no answer).
        self._node_fences: tuple[int | None, ...] = ()
        # The operation id of the last acquire sent: a give-back names it.
        self._last_acquire_op = ""
        # The operation id of the acquire that took this object's fresh hold: a release
        # names it on a node whose fence is unknown.
        self._grant_op = ""

    # -- helpers ------------------------------------------------------------------

    def _margin(self, ttl_ms: int) -> float:
        """The drift allowance (``ttl * drift_factor + 2 ms``, never less than the
        single server's) plus the pause budget, of the longest lease a hold has (a
        max hold shorter than the ttl cuts it)."""
        ttl = first_lease_ms(ttl_ms, self.max_hold) / 1000.0
        drift = max(ttl * self._drift_rate(), ttl * self.drift_factor + DRIFT_FLOOR)
        return drift + pause_budget(ttl, self.pause_budget)

    def _call_all(self, script: Any, args: Sequence[Any] | Callable[[int], Sequence[Any]],
                  decided: Callable[[Outcome], bool] | None = None,
                  after: Mapping[int, list[cf.Future[Any]]] | None = None) -> Outcome:
        """``script`` on every node at once; on a node with calls ``after`` still
        running (a granted acquire's late calls), once they ended (at most
        node_timeout), so a release never overtakes its acquire on a slow node."""
        keys = (self.keys.lock,)

        def call(i: int, node: Any) -> Any:
            if after and after.get(i):
                cf.wait(after[i], timeout=self.node_timeout + POOL_SLACK)
            return script(node, keys, args(i) if callable(args) else args)

        return fan_out(self._nodes, call, self.node_timeout, decided)

    # -- what the hold state machine asks -------------------------------------------

    def _send_acquire(self, owner: str, op: str, *, queue: bool,
                      reentry: bool) -> Grant | Refused | int:
        # An operation id per attempt, not per acquire() call: a node whose give-back
        # of the last attempt has not landed yet would answer a retry under the same id
        # with that attempt's remembered grant, which the give-back then takes away.
        # (The nodes' calls are never re-sent, so nothing relies on the id repeating.)
        op = new_op_id()
        self._last_acquire_op = op
        args = [owner, self._acquire_ttl_ms(reentry), 0, op, "",
                self.options.fence_ttl_ms, "pid", os.getpid(),
                *self._info_args]
        keys = (self.keys.lock,)
        quorum, n = self.quorum, len(self._nodes)
        # A re-entry names, per node, the hold it expects by that node's fence (its
        # counter is no fencing token across nodes, but it tells this hold from a
        # newer one of the same owner there); "*" where the node never answered.
        expected = self._node_fences if reentry else ()

        def call(i: int, node: Any) -> Any:
            check_server(node)
            learn_run_id(node)  # once per node: two names of one server are refused
            mine = list(args)
            if reentry:
                known = expected[i] if i < len(expected) else None
                mine[4] = "*" if known is None else str(known)
            return ACQUIRE(node, keys, mine)

        def with_code(out: Outcome, code: int) -> list[int]:
            return [i for i, r in enumerate(out) if answered(r) and int(r[0]) == code]

        scheduler = self._get_scheduler()
        sent_at = scheduler.now()
        leftover: dict[int, cf.Future[Any]] = {}
        # Back as soon as a quorum granted, or can no longer grant.
        # No call starts once the grant could no longer be valid.
        lease = self._acquire_ttl_ms(False) / 1000.0
        left = lease - self._margin(self.ttl_ms)
        out = fan_out(self._nodes, call, self.node_timeout,
                      lambda o: len(with_code(o, 1)) >= quorum
                      or len(with_code(o, 0)) + len(with_code(o, 2)) > n - quorum,
                      leftover, budget=left if left > 0 and not reentry else None)
        now = scheduler.now()
        yes, no, gone = with_code(out, 1), with_code(out, 0), with_code(out, 2)
        valid = now < sent_at + lease - self._margin(self.ttl_ms)
        # A node that answered with an error (out of memory, a read-only replica, a
        # missing ACL permission) refused: it did not grant, and vetoes nothing.
        report_refusals(self.name, "acquire", self.clients, failures(out))
        # Two nodes that are one server would grant twice: nothing is kept.
        again = args if not reentry else [*args[:4], "*", *args[5:]]
        try:
            check_distinct(self._nodes, self.clients, self.name)
        except InvalidLockConfig:
            give_back(self._nodes, self.keys, owner, again, out, leftover,
                      self.node_timeout, self.name, self.ttl)
            raise
        if len(yes) >= quorum and (reentry or valid):
            for i, future in leftover.items():
                self._in_flight.setdefault(i, []).append(future)
            reentered = reentry or sum(1 for i in yes if int(out[i][2]) > 1) >= quorum
            if not reentered:
                self._grant_op = op
                self._node_fences = tuple(int(out[i][1]) if i in yes else None
                                          for i in range(n))
            return Grant(None, reentered)
        # A node that did not answer gets the same request again before its give-back:
        # a re-entry's again expects the owner's hold ("*"), so a node without it
        # takes nothing.
        give_back(self._nodes, self.keys, owner, again, out, leftover, self.node_timeout,
                  self.name, self.ttl)
        raise_conflict(self._nodes, self.keys, self.name, out, len(yes), quorum)
        if reentry and len(gone) > n - quorum:
            taken = sum(1 for i in gone if int(out[i][1]) == TAKEN)
            return TAKEN if taken > len(gone) // 2 else GONE
        if len(yes) >= quorum:
            logger.warning("lock %r: a quorum granted it after its validity ended "
                           "(%.3fs for a ttl of %gs, %.3fs of drift allowance): given "
                           "back", self.name, now - sent_at, self.ttl,
                           self._margin(self.ttl_ms))
            self.last_holder = None
            return Refused()
        if len(yes) + len(no) + len(gone) < quorum:
            raise unavailable(self.name, "acquire", out, self.quorum, self.clients)
        holder = majority_holder(out, no)
        # One node's counter is not a fencing token.
        self.last_holder = None if holder is None else dataclasses.replace(holder,
                                                                           fence=None)
        return Refused()

    def _wait_turn(self, owner: str, refused: Refused, left: float | None) -> None:
        delay = random.uniform(0.1, 1.0) * RETRY_DELAY
        if left is not None:
            delay = min(delay, left)
        time.sleep(delay)

    def _give_back(self, owner: str) -> None:
        # Named after the acquire it undoes: a node where that acquire did not count
        # (it never ran there) keeps whatever hold the owner has there.
        out = self._call_all(RELEASE, (owner, new_op_id(), "", self._last_acquire_op,
                                       self.options.fence_ttl_ms))
        if sum(1 for r in out if answered(r)) < len(self._nodes):
            logger.debug("lock %r: not every node confirmed the give-back", self.name)

    def _send_release(self, owner: str, op: str) -> int:
        late, self._in_flight = self._in_flight, {}
        n, quorum = len(self._nodes), self.quorum

        def tally(out: Outcome) -> tuple[int, int]:
            ours = sum(1 for r in out if answered(r) and int(r[0]) in (OK, STILL_HELD))
            return ours, sum(1 for r in out if answered(r) and int(r[0]) in (GONE, TAKEN))

        def decided(out: Outcome) -> bool:
            ours, others = tally(out)
            return ours >= quorum or others > n - quorum

        # Back once the answers decide; a node that hangs gets the release later.
        # (None of this object's: a release of a hold it does not have, by its owner.)
        mine = self._depth > 0
        fences = list(self._node_fences) if mine else []
        grant_op = self._grant_op if mine else ""

        keep = str(self.options.fence_ttl_ms)

        def args(i: int) -> tuple[str, ...]:
            # Each node's fence of this hold (a grant's late answer there included:
            # the call waited for it): a release that reaches the node late finds any
            # later hold of the owner there by another fence and leaves it, and a
            # re-send of the final release learns from the counter that it freed the
            # lock.  Where no fence is known, it names the acquire that took the hold.
            if mine and i < len(fences) and fences[i] is None:
                fences[i] = _granted_fence(late.get(i, ()))
            fence = fences[i] if i < len(fences) else None
            if fence is not None:
                return owner, op, str(fence), "", keep
            return owner, op, "", grant_op, keep

        out = self._call_all(RELEASE, args, decided, late)
        if mine and len(fences) == len(self._node_fences):
            self._node_fences = tuple(fences)  # what the late answers taught
        report_refusals(self.name, "release", self.clients, failures(out))
        ours, others = tally(out)
        if ours >= quorum:
            still = any(answered(r) and int(r[0]) == STILL_HELD for r in out)
            return STILL_HELD if still else OK
        if others > n - quorum:
            taken = any(answered(r) and int(r[0]) == TAKEN for r in out)
            return TAKEN if taken else GONE
        raise_conflict(self._nodes, self.keys, self.name, out, ours, quorum)
        raise unavailable(self.name, "release", out, self.quorum, self.clients)

    def _send_extend(self, owner: str, ttl_ms: int, op: str) -> int:
        quorum, n = self.quorum, len(self._nodes)

        def tally(out: Outcome) -> tuple[int, int]:
            ok = sum(1 for r in out if answered(r) and int(r) == OK)
            no = sum(1 for r in out if answered(r) and int(r) != OK)
            return ok, no

        def decided(out: Outcome) -> bool:
            ok, no = tally(out)
            return ok >= quorum or no > n - quorum

        out = self._call_all(EXTEND, (owner, ttl_ms), decided)
        report_refusals(self.name, "extend", self.clients, failures(out))
        ok, no = tally(out)
        if ok >= quorum:
            return OK
        if no > n - quorum:
            return GONE
        raise_conflict(self._nodes, self.keys, self.name, out, ok, quorum)
        raise unavailable(self.name, "extend", out, self.quorum, self.clients)

    def _read(self, what: str, owner: str | None = None) -> Holds:
        return read_holds(self._nodes, self.keys, self.name, what, self.node_timeout,
                          self.quorum, owner)

    def _read_status(self, owner: str) -> int:
        found = self._read("owned", owner)
        return OK if len(found.get(owner, ())) >= self.quorum else GONE

    def _gone_reason(self, code: int, owner: str) -> str:
        return _LOST_ON_MAJORITY

    def _renew_target(self) -> RenewTarget | None:
        target: RenewTarget = renew_target(self.clients, self.node_timeout)
        return target

    def _renew_key(self) -> str:
        return self.keys.lock

    # -- reading --------------------------------------------------------------------

    def locked(self) -> bool:
        """Whether some owner holds the lock on a quorum of nodes."""
        return self.holder() is not None

    def holder(self) -> Holder | None:
        """The holder a quorum of nodes agrees on (None: nobody holds a quorum); its
        ``ttl`` is how long that quorum lasts without renewal."""
        return quorum_holder(self._read("holder"), self.quorum)

    @property
    def fence(self) -> int | None:
        """Always raises :class:`FencingUnavailable`: see the module docs."""
        raise FencingUnavailable(FENCE_REFUSAL, lock_name=self.name)

    def __repr__(self) -> str:
        return (f"<RedlockLock {self.name!r} nodes={len(self.clients)} "
                f"quorum={self.quorum} ttl={self.ttl:g}s depth={self._depth}>")


def _granted_fence(futures: Sequence[cf.Future[Any]]) -> int | None:
    """The fence the first of a node's late acquire calls that granted was answered
    with (None: none granted, or none answered yet)."""
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is None:
            reply = future.result()
            if answered(reply) and int(reply[0]) == 1:
                return int(reply[1])
    return None
