"""``RedlockLock``: the lock of :class:`~celery_dlock.RedisLock` held on a quorum of N
independent Redis servers (the Redlock algorithm of the Redis distributed-lock page).

Opt-in, for when no single Redis (with a replica) may be a single point of failure.
On each node the hold is exactly a RedisLock's (the same scripts and keys: owner
checks, re-entry counts, operation ids), and the lock is held while a quorum
(``N // 2 + 1``) of nodes holds it for its owner::

    t0  send ACQUIRE to nodes 1..3 at once (each call bounded by node_timeout)
    t1  nodes 1 and 3 granted, node 2 hangs      quorum (2 of 3) at t1
        validity = ttl - (t1 - t0) - drift > 0    granted; deadline t0 + ttl - drift
    t2  the heartbeat renews on every node at once; the deadline moves when a quorum
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
import itertools
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from redis.exceptions import ResponseError

from ....core.deadline import lease_end
from ....core.errors import (
    FencingUnavailable,
    Holder,
    LockLost,
    LockNotOwned,
)
from ....core.heartbeat import Heartbeat
from ....core.hold import HoldView, acquire_timeout, check_lock_options
from ....core.ttl import ttl_ms as _ttl_to_ms
from ..keyspace import LockKeys
from ..lock import RedisLock
from ..scripts import ACQUIRE, EXTEND, RELEASE
from ..server_checks import check_server
from .nodes import (
    POOL_SLACK,
    NodeFailed,
    Outcome,
    check_nodes,
    fan_out,
    node_client,
    quorum_of,
    renew_target,
)
from .quorum import (
    DEFAULT_NODE_TIMEOUT,
    Holds,
    answered,
    check_timing,
    give_back,
    majority_holder,
    op_id,
    quorum_holder,
    raise_conflict,
    read_holds,
    unavailable,
)

__all__ = ["DEFAULT_NODE_TIMEOUT", "FENCE_REFUSAL", "RETRY_DELAY", "AnyLock",
           "RedlockLock", "fence_of"]

logger = logging.getLogger("celery_dlock.redlock")

DEFAULT_PREFIX = "dlock"
#: A blocked acquire tries again after a random delay of up to this (seconds).
RETRY_DELAY = 0.2
#: Fixed part of the drift allowance (seconds), as on the Redis distributed-lock page.
DRIFT_FLOOR = 0.002
#: Why :attr:`RedlockLock.fence` raises.
FENCE_REFUSAL = (
    "Redlock gives no fencing token: each node counts on its own and a node that "
    "restarts without its data starts again from 0, so the highest count of a quorum "
    "can go backwards; use a monotonic token of your own (a database sequence)")

_hold_ids = itertools.count(1)


class RedlockLock(HoldView):
    """A reentrant lock held on a quorum of N independent Redis servers.

    The interface is :class:`~celery_dlock.RedisLock`'s (acquire, release, extend,
    locked, owned, ensure_held, holder, context manager), with these differences:

    :param clients: 3 or more ``redis.Redis`` clients of independent servers (not a
        cluster client; not one server twice).  ``N // 2 + 1`` of them make a quorum.
    :param drift_factor: the share of the ttl allowed for clock drift between this
        process and the servers; a hold is valid for ``ttl - elapsed - drift`` with
        ``drift = ttl * drift_factor + 2 ms`` (never less than RedisLock's margin).
    :param node_timeout: the longest one node may take to answer a call (default
        ``min(0.5, ttl / 10)``): a node that hangs never costs more.

    :attr:`fence` raises :class:`FencingUnavailable` (see the module docs).
    """

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
        heartbeat: Heartbeat | None = None,
        drift_factor: float = 0.01,
        node_timeout: float | None = None,
    ) -> None:
        info_args = check_lock_options(name, prefix, owner, blocking_timeout, info)
        super().__init__(name, owner, on_lost, heartbeat)
        self.clients = check_nodes(clients, name)
        self.quorum = quorum_of(len(self.clients))
        self.ttl_ms = _ttl_to_ms(ttl, "ttl", name)
        self.drift_factor, self.node_timeout = check_timing(name, self.ttl, drift_factor,
                                                            node_timeout)
        self._nodes = tuple(node_client(c, self.node_timeout) for c in self.clients)
        self.prefix = prefix
        self.auto_renew = auto_renew
        self.blocking_timeout = blocking_timeout
        self.keys = LockKeys.for_name(prefix, name)
        self._info_args = info_args
        # Calls of a granted acquire still out to slow nodes: a release waits for them
        # (at most node_timeout), so it never reaches a node before its acquire.
        self._in_flight: dict[int, list[cf.Future[Any]]] = {}

    # -- helpers ------------------------------------------------------------------

    @property
    def ttl(self) -> float:
        return self.ttl_ms / 1000.0

    def _extra_margin(self, ttl_ms: int) -> float:
        """What the drift allowance takes off a deadline beyond the heartbeat's own
        margin (:func:`lease_end`)."""
        ttl = ttl_ms / 1000.0
        drift = ttl * self.drift_factor + DRIFT_FLOOR
        return max(0.0, drift - (ttl - lease_end(0.0, ttl_ms)))

    def _valid_until(self, sent_at: float, ttl_ms: int) -> float:
        """End of the validity of a quorum confirmed by requests sent at ``sent_at``:
        ``sent_at + ttl - drift`` (drift at least the heartbeat's margin)."""
        return lease_end(sent_at, ttl_ms) - self._extra_margin(ttl_ms)

    def _call_all(self, script: Any, args: Sequence[Any],
                  decided: Callable[[Outcome], bool] | None = None,
                  after: Mapping[int, list[cf.Future[Any]]] | None = None) -> Outcome:
        """``script`` on every node at once; on a node with calls ``after`` still
        running (a granted acquire's late calls), once they ended (at most
        node_timeout), so a release never overtakes its acquire on a slow node."""
        keys = (self.keys.lock,)

        def call(i: int, node: Any) -> Any:
            if after and after.get(i):
                cf.wait(after[i], timeout=self.node_timeout + POOL_SLACK)
            return script(node, keys, args)

        return fan_out(self._nodes, call, self.node_timeout, decided)

    # -- acquire ------------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None, *,
                blocking_timeout: float | None = None) -> bool:
        """Take the lock on a quorum of nodes (or re-enter it); True when held.

        ``blocking=False`` tries once; otherwise tries again after a random delay (up
        to :data:`RETRY_DELAY`) for at most ``timeout`` seconds (as for RedisLock).
        Raises :class:`BackendUnavailable` when fewer than a quorum of nodes answer.
        """
        timeout = acquire_timeout(blocking, timeout, blocking_timeout,
                                  self.blocking_timeout)
        owner = self._current_owner()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._try_acquire(owner):
                return True
            if not blocking:
                return False
            delay = random.uniform(0.1, 1.0) * RETRY_DELAY
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                delay = min(delay, left)
            time.sleep(delay)

    def _try_acquire(self, owner: str) -> bool:
        args = [owner, self.ttl_ms, 0, op_id(), "pid", os.getpid(), *self._info_args]
        keys = (self.keys.lock,)
        quorum = self.quorum

        def call(_: int, node: Any) -> Any:
            check_server(node)
            return ACQUIRE(node, keys, args)

        def granted(out: Outcome) -> list[int]:
            return [i for i, r in enumerate(out) if answered(r) and int(r[0]) == 1]

        heartbeat = self._get_heartbeat()
        sent_at = heartbeat.now()
        leftover: dict[int, cf.Future[Any]] = {}
        def refused(out: Outcome) -> list[int]:
            return [i for i, r in enumerate(out) if answered(r) and int(r[0]) == 0]

        # Back as soon as a quorum granted, or can no longer grant.
        out = fan_out(self._nodes, call, self.node_timeout,
                      lambda o: len(granted(o)) >= quorum or
                      len(refused(o)) > len(o) - quorum, leftover)
        now = heartbeat.now()
        yes, no = granted(out), refused(out)
        valid = now < self._valid_until(sent_at, self.ttl_ms)
        if len(yes) >= quorum and valid and not any(isinstance(r, NodeFailed) and
                                                    isinstance(r.error, ResponseError)
                                                    for r in out):
            self._acquired(owner, [int(out[i][2]) for i in yes], sent_at)
            for i, future in leftover.items():
                self._in_flight.setdefault(i, []).append(future)
            return True
        give_back(self._nodes, self.keys, owner, args, out, leftover, self.node_timeout,
                  self.name, self.ttl)
        raise_conflict(self._nodes, self.keys, self.name, out)
        if len(yes) >= quorum:
            logger.warning("lock %r: a quorum granted it after its validity ended "
                           "(%.3fs for a ttl of %gs): given back", self.name,
                           now - sent_at, self.ttl)
            self.last_holder = None
            return False
        if len(yes) + len(no) < quorum:
            raise unavailable(self.name, "acquire", out, self.quorum)
        self.last_holder = majority_holder(out, no)
        return False

    def _acquired(self, owner: str, counts: list[int], sent_at: float) -> None:
        heartbeat = self._get_heartbeat()
        reentered = sum(1 for c in counts if c > 1) >= self.quorum
        with self._state:
            self._sync_generation()
            if (self._depth == 0 or not reentered or self._lost_reason is not None
                    or owner != self._hold_owner):
                self._depth = 0
                self._hold_id = next(_hold_ids)
                self._hold_owner = owner
                self._lost_reason = None
                self._release_op = None
                target = (renew_target(self.clients, self.node_timeout)
                          if self.auto_renew else None)
                heartbeat.register(self, self._hold_id, target, self.keys.lock, owner,
                                   self.ttl_ms, sent_at,
                                   margin=self._extra_margin(self.ttl_ms))
            else:
                heartbeat.confirmed(self, self._hold_id, self.ttl_ms, sent_at)
            self._depth += 1

    # -- release ------------------------------------------------------------------

    def release(self) -> None:
        """Undo one acquire on every node; freed when releases match acquires.

        :class:`LockNotOwned` when the caller does not hold it on a quorum,
        :class:`LockLost` when this object held it but a quorum no longer did,
        :class:`BackendUnavailable` when too few nodes answered to tell: nothing
        changed locally, and a second call re-sends the same operation (a node that
        did answer changes nothing the second time).  Nodes that never answer drop
        the hold when its ttl ends.
        """
        caller = self._current_owner()
        with self._state:
            self._sync_generation()
            held_here = self._depth > 0
            if held_here and caller != self._hold_owner:
                raise LockNotOwned(
                    "release by an owner that did not acquire it through this object",
                    lock_name=self.name)
            owner = self._hold_owner if held_here else caller
            assert owner is not None
            hold_id, lost_reason, depth = self._hold_id, self._lost_reason, self._depth
            final = held_here and depth == 1
            pending = self._release_op
            if held_here and pending is not None and pending[:2] == (hold_id, depth):
                op = pending[2]
            else:
                op = op_id()
                self._release_op = (hold_id, depth, op) if held_here else None
        heartbeat = self._get_heartbeat()
        if final and lost_reason is None:
            heartbeat.set_releasing(self, hold_id, True)
        late, self._in_flight = self._in_flight, {}
        n, quorum = len(self._nodes), self.quorum

        def tally(out: Outcome) -> tuple[int, int]:
            ours = sum(1 for r in out if answered(r) and int(r[0]) in (1, 2))
            return ours, sum(1 for r in out if answered(r) and int(r[0]) in (0, -1))

        def decided(out: Outcome) -> bool:
            ours, others = tally(out)
            return ours >= quorum or others > n - quorum

        # Back once the answers decide; a node that hangs gets the release later.
        out = self._call_all(RELEASE, (owner, op), decided, late)
        ours, others = tally(out)
        impossible = others > n - quorum
        if not held_here:
            if ours >= self.quorum:
                return
            if impossible:
                raise LockNotOwned("cannot release: this owner does not hold the lock "
                                   "on a quorum of its nodes", lock_name=self.name)
            raise unavailable(self.name, "release", out, self.quorum)
        if lost_reason is None and ours < self.quorum:
            if not impossible:
                if final:
                    heartbeat.set_releasing(self, hold_id, False)
                raise unavailable(self.name, "release", out, self.quorum)
            lost_reason = "expired or taken on a majority of its nodes"
            self._mark_lost(lost_reason, hold_id)
        with self._state:
            if self._hold_id == hold_id and self._depth > 0:
                self._depth -= 1
                self._release_op = None
                if self._depth == 0:
                    self._hold_owner = None
        if final:
            heartbeat.unregister(self, hold_id)
        if lost_reason is not None:
            raise LockLost(f"lock lost before it was released ({lost_reason})",
                           lock_name=self.name)

    def release_all(self) -> int:
        """Release every acquire of this object's hold on every node (best effort:
        errors are logged); returns how many acquires were undone."""
        with self._state:
            self._sync_generation()
            depth, owner, hold_id = self._depth, self._hold_owner, self._hold_id
            if depth == 0 or owner is None:
                return 0
            self._depth = 0
            self._hold_owner = None
            self._release_op = None
        self._get_heartbeat().unregister(self, hold_id)
        late, self._in_flight = self._in_flight, {}
        for _ in range(depth):
            out = self._call_all(RELEASE, (owner, op_id()), after=late)
            if not any(answered(r) and int(r[0]) == 2 for r in out):
                break
        return depth

    # -- extend, inspect ------------------------------------------------------------

    def extend(self, ttl: float | None = None) -> None:
        """Make the hold expire at least ``ttl`` seconds from now on a quorum of nodes
        (default: the lock's ttl); later renewals use the new ttl."""
        ttl_ms = self.ttl_ms if ttl is None else _ttl_to_ms(ttl, "ttl", self.name)
        owner, held_here, hold_id, lost_reason = self._caller_view()
        if lost_reason is not None:
            raise LockLost(f"cannot extend: lock lost ({lost_reason})",
                           lock_name=self.name)
        heartbeat = self._get_heartbeat()
        sent_at = heartbeat.now()
        quorum, n = self.quorum, len(self._nodes)

        def tally(out: Outcome) -> tuple[int, int]:
            ok = sum(1 for r in out if answered(r) and int(r) == 1)
            no = sum(1 for r in out if answered(r) and int(r) != 1)
            return ok, no

        def decided(out: Outcome) -> bool:
            ok, no = tally(out)
            return ok >= quorum or no > n - quorum

        out = self._call_all(EXTEND, (owner, ttl_ms), decided)
        ok, no = tally(out)
        if ok >= quorum:
            self.ttl_ms = ttl_ms
            if held_here:
                heartbeat.confirmed(self, hold_id, ttl_ms, sent_at)
            return
        if no <= n - quorum:
            raise unavailable(self.name, "extend", out, self.quorum)
        if held_here:
            self._mark_lost("expired or taken on a majority of its nodes", hold_id)
            raise LockLost("cannot extend: lock expired or taken on a majority of its "
                           "nodes", lock_name=self.name)
        raise LockNotOwned("cannot extend: this owner does not hold the lock on a "
                           "quorum of its nodes", lock_name=self.name)

    def _read(self, what: str, owner: str | None = None) -> Holds:
        return read_holds(self._nodes, self.keys, self.name, what, self.node_timeout,
                          self.quorum, owner)

    def locked(self) -> bool:
        """Whether some owner holds the lock on a quorum of nodes."""
        return self.holder() is not None

    def owned(self) -> bool:
        """Whether the calling owner holds the lock on a quorum of nodes."""
        owner, _, _, lost_reason = self._caller_view()
        if lost_reason is not None:
            return False
        found = self._read("owned", owner)
        return len(found.get(owner, ())) >= self.quorum

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` unless the calling owner holds the lock on a
        quorum of nodes (asked now, of every node at once)."""
        owner, held_here, hold_id, lost_reason = self._caller_view()
        if lost_reason is not None:
            raise LockLost(f"lock lost: {lost_reason}", lock_name=self.name)
        found = self._read("ensure_held", owner)
        if len(found.get(owner, ())) >= self.quorum:
            return
        reason = "expired or taken on a majority of its nodes"
        if held_here:
            self._mark_lost(reason, hold_id)
            raise LockLost(f"lock lost: {reason}", lock_name=self.name)
        raise LockLost(f"lock not held by this owner ({reason})", lock_name=self.name)

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



#: Either kind of lock (what a LockedTask run holds).
AnyLock: TypeAlias = "RedisLock | RedlockLock"


def fence_of(lock: AnyLock) -> int | None:
    """``lock.fence``, or None for a lock that gives no fencing token (Redlock)."""
    try:
        return lock.fence
    except FencingUnavailable:
        return None
