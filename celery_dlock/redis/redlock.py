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
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeAlias

from redis.exceptions import ResponseError

from ..core import owner as _owner
from ..core.errors import (
    BackendUnavailable,
    DLockError,
    FencingUnavailable,
    Holder,
    InvalidLockConfig,
    LockKeyConflict,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
)
from ..core.heartbeat import Heartbeat, get_heartbeat, lease_end
from ..core.ttl import ttl_ms as _ttl_to_ms
from .keyspace import LockKeys, foreign_keys, parse_holder
from .lock import RedisLock
from .redlock_nodes import (
    POOL_SLACK,
    NodeFailed,
    Outcome,
    check_nodes,
    fan_out,
    node_client,
    quorum_of,
    renew_target,
)
from .scripts import ACQUIRE, EXTEND, READ_HOLD, RELEASE
from .server_checks import check_server

__all__ = ["DEFAULT_NODE_TIMEOUT", "FENCE_REFUSAL", "RETRY_DELAY", "AnyLock",
           "RedlockLock", "fence_of"]

logger = logging.getLogger("celery_dlock.redlock")

DEFAULT_PREFIX = "dlock"
#: The longest one node may take to answer (seconds; at most a tenth of the ttl).
DEFAULT_NODE_TIMEOUT = 0.5
#: A blocked acquire tries again after a random delay of up to this (seconds).
RETRY_DELAY = 0.2
#: Fixed part of the drift allowance (seconds), as on the Redis distributed-lock page.
DRIFT_FLOOR = 0.002
#: Why :attr:`RedlockLock.fence` raises.
FENCE_REFUSAL = (
    "Redlock gives no fencing token: each node counts on its own and a node that "
    "restarts without its data starts again from 0, so the highest count of a quorum "
    "can go backwards; use a monotonic token of your own (a database sequence)")

_HOST = socket.gethostname()
_RESERVED = frozenset({"owner", "count", "fence", "acquired_at", "ttl", "pid", "ops"})
_hold_ids = itertools.count(1)


def _op_id() -> str:
    return os.urandom(8).hex()


def _answered(reply: Any) -> bool:
    return reply is not None and not isinstance(reply, NodeFailed)


def _first_error(out: Outcome) -> str:
    for reply in out:
        if isinstance(reply, NodeFailed):
            return str(reply.error) if reply.error is not None else "no answer in time"
    return "no answer"


class RedlockLock:
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
        if not isinstance(name, str) or not name:
            raise InvalidLockConfig(f"a lock needs a non-empty name, got {name!r}")
        if not isinstance(prefix, str) or not prefix:
            raise InvalidLockConfig(f"prefix must be a non-empty string, got {prefix!r}",
                                    lock_name=name)
        if owner is not None and (not isinstance(owner, str) or not owner):
            raise InvalidLockConfig(f"owner must be a non-empty string, got {owner!r}",
                                    lock_name=name)
        if blocking_timeout is not None and not blocking_timeout >= 0:
            raise InvalidLockConfig("blocking_timeout must be >= 0 or None",
                                    lock_name=name)
        self.clients = check_nodes(clients, name)
        self.quorum = quorum_of(len(self.clients))
        self.ttl_ms = _ttl_to_ms(ttl, "ttl", name)
        if isinstance(drift_factor, bool) or not isinstance(drift_factor, (int, float)) \
                or not 0 <= drift_factor < 0.5:
            raise InvalidLockConfig(f"drift_factor must be a number in [0, 0.5), got "
                                    f"{drift_factor!r}", lock_name=name)
        if node_timeout is None:
            node_timeout = min(DEFAULT_NODE_TIMEOUT, self.ttl / 10)
        elif isinstance(node_timeout, bool) or \
                not isinstance(node_timeout, (int, float)) or \
                not math.isfinite(node_timeout) or not 0 < node_timeout < self.ttl:
            raise InvalidLockConfig(f"node_timeout must be a positive number of seconds "
                                    f"below the ttl, got {node_timeout!r}",
                                    lock_name=name)
        self.drift_factor = float(drift_factor)
        self.node_timeout = float(node_timeout)
        self._nodes = tuple(node_client(c, self.node_timeout) for c in self.clients)
        self.name = name
        self.prefix = prefix
        self.auto_renew = auto_renew
        self.on_lost = on_lost
        self.blocking_timeout = blocking_timeout
        self.keys = LockKeys.for_name(prefix, name)
        self._fixed_owner = owner
        self._heartbeat = heartbeat
        info_args: list[str] = []
        for k, v in {"host": _HOST, **(info or {})}.items():
            if k in _RESERVED:
                raise InvalidLockConfig(f"info may not set the reserved field {k!r}",
                                        lock_name=name)
            if v is not None:
                info_args += (str(k), str(v))
        self._info_args = info_args
        self._state = threading.Lock()
        self._depth = 0
        self._hold_id = 0
        self._hold_owner: str | None = None
        self._generation = _owner.generation()
        self._lost_reason: str | None = None
        self._release_op: tuple[int, int, str] | None = None
        # Calls of a granted acquire still out to slow nodes: a release waits for them
        # (at most node_timeout), so it never reaches a node before its acquire.
        self._in_flight: list[cf.Future[Any]] = []
        #: What the last failed acquire learned about the holder.
        self.last_holder: Holder | None = None

    # -- helpers ------------------------------------------------------------------

    @property
    def ttl(self) -> float:
        return self.ttl_ms / 1000.0

    def _current_owner(self) -> str:
        return self._fixed_owner or _owner.current_owner()

    def _get_heartbeat(self) -> Heartbeat:
        return self._heartbeat if self._heartbeat is not None else get_heartbeat()

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

    def _sync_generation(self) -> None:
        gen = _owner.generation()
        if self._generation != gen:
            self._generation = gen
            self._depth = 0
            self._hold_owner = None
            self._lost_reason = None
            self._release_op = None

    def _caller_view(self) -> tuple[str, bool, int, str | None]:
        caller = self._current_owner()
        with self._state:
            self._sync_generation()
            held_here = self._depth > 0 and caller == self._hold_owner
            return caller, held_here, self._hold_id, (self._lost_reason if held_here
                                                      else None)

    def _settle_in_flight(self) -> None:
        pending, self._in_flight = self._in_flight, []
        if pending:
            cf.wait(pending, timeout=self.node_timeout + POOL_SLACK)

    def _call_all(self, script: Any, args: Sequence[Any],
                  decided: Callable[[Outcome], bool] | None = None) -> Outcome:
        keys = (self.keys.lock,)

        def call(_: int, node: Any) -> Any:
            return script(node, keys, args)

        return fan_out(self._nodes, call, self.node_timeout, decided)

    def _conflict(self, out: Outcome) -> None:
        for i, reply in enumerate(out):
            if isinstance(reply, NodeFailed) and isinstance(reply.error, ResponseError) \
                    and "WRONGTYPE" in str(reply.error):
                raise LockKeyConflict(foreign_keys(self._nodes[i], self.keys),
                                      lock_name=self.name)

    def _unavailable(self, what: str, out: Outcome) -> BackendUnavailable:
        answered = sum(1 for r in out if _answered(r))
        return BackendUnavailable(
            f"Redlock unavailable during {what}: {answered} of {len(out)} nodes "
            f"answered, {self.quorum} needed ({_first_error(out)})", lock_name=self.name)

    # -- acquire ------------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None, *,
                blocking_timeout: float | None = None) -> bool:
        """Take the lock on a quorum of nodes (or re-enter it); True when held.

        ``blocking=False`` tries once; otherwise tries again after a random delay (up
        to :data:`RETRY_DELAY`) for at most ``timeout`` seconds (as for RedisLock).
        Raises :class:`BackendUnavailable` when fewer than a quorum of nodes answer.
        """
        if blocking_timeout is not None:
            if timeout is not None and timeout != blocking_timeout:
                raise ValueError("give timeout or blocking_timeout, not both")
            timeout = blocking_timeout
        if timeout is not None and timeout != -1:
            if not blocking:
                raise ValueError("can't specify a timeout for a non-blocking call")
            if not timeout >= 0:
                raise ValueError("timeout must be >= 0, -1 or None")
        elif timeout is None and blocking:
            timeout = self.blocking_timeout
        else:
            timeout = None
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
        args = [owner, self.ttl_ms, 0, _op_id(), "pid", os.getpid(), *self._info_args]
        keys = (self.keys.lock,)
        quorum = self.quorum

        def call(_: int, node: Any) -> Any:
            check_server(node)
            return ACQUIRE(node, keys, args)

        def granted(out: Outcome) -> list[int]:
            return [i for i, r in enumerate(out) if _answered(r) and int(r[0]) == 1]

        heartbeat = self._get_heartbeat()
        sent_at = heartbeat.now()
        leftover: list[cf.Future[Any]] = []
        out = fan_out(self._nodes, call, self.node_timeout,
                      lambda o: len(granted(o)) >= quorum, leftover)
        now = heartbeat.now()
        yes = granted(out)
        refused = [i for i, r in enumerate(out) if _answered(r) and int(r[0]) == 0]
        valid = now < self._valid_until(sent_at, self.ttl_ms)
        if len(yes) >= quorum and valid and not any(isinstance(r, NodeFailed) and
                                                    isinstance(r.error, ResponseError)
                                                    for r in out):
            self._acquired(owner, [int(out[i][2]) for i in yes], sent_at)
            self._in_flight = [f for f in (*self._in_flight, *leftover) if not f.done()]
            return True
        self._give_back(owner, args, out)
        self._conflict(out)
        if len(yes) >= quorum:
            logger.warning("lock %r: a quorum granted it after its validity ended "
                           "(%.3fs for a ttl of %gs): given back", self.name,
                           now - sent_at, self.ttl)
            self.last_holder = None
            return False
        if len(yes) + len(refused) < quorum:
            raise self._unavailable("acquire", out)
        self.last_holder = self._majority_holder(out, refused)
        return False

    def _majority_holder(self, out: Outcome, refused: list[int]) -> Holder | None:
        holders: dict[str | None, list[Holder]] = {}
        for i in refused:
            reply = out[i]
            holder = parse_holder(reply[3:], int(reply[1]), int(reply[2]))
            holders.setdefault(holder.owner, []).append(holder)
        if not holders:
            return None
        return max(holders.values(), key=len)[0]

    def _give_back(self, owner: str, args: Sequence[Any], out: Outcome) -> None:
        """Undo this attempt on every node that granted it or did not answer."""
        keys = (self.keys.lock,)
        todo = [i for i, r in enumerate(out)
                if not _answered(r) or int(r[0]) == 1]
        if not todo:
            return

        def call(i: int, node: Any) -> Any:
            if i not in todo:
                return None
            if not _answered(out[i]):
                # Same operation id: if the first request ran, this is its answer.
                reply = ACQUIRE(node, keys, args)
                if int(reply[0]) != 1:
                    return None
            return RELEASE(node, keys, (owner, _op_id()))

        results = fan_out(self._nodes, call, self.node_timeout * 2)
        missed = sum(1 for i in todo if isinstance(results[i], NodeFailed))
        if missed:
            logger.warning("lock %r: %d node(s) did not confirm the give-back; a hold "
                           "left there expires within %gs", self.name, missed, self.ttl)

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
                op = _op_id()
                self._release_op = (hold_id, depth, op) if held_here else None
        heartbeat = self._get_heartbeat()
        if final and lost_reason is None:
            heartbeat.set_releasing(self, hold_id, True)
        self._settle_in_flight()
        out = self._call_all(RELEASE, (owner, op))
        ours = sum(1 for r in out if _answered(r) and int(r[0]) in (1, 2))
        others = sum(1 for r in out if _answered(r) and int(r[0]) in (0, -1))
        impossible = others > len(out) - self.quorum
        if not held_here:
            if ours >= self.quorum:
                return
            if impossible:
                raise LockNotOwned("cannot release: this owner does not hold the lock "
                                   "on a quorum of its nodes", lock_name=self.name)
            raise self._unavailable("release", out)
        if lost_reason is None and ours < self.quorum:
            if not impossible:
                if final:
                    heartbeat.set_releasing(self, hold_id, False)
                raise self._unavailable("release", out)
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
        self._settle_in_flight()
        for _ in range(depth):
            out = self._call_all(RELEASE, (owner, _op_id()))
            if not any(_answered(r) and int(r[0]) == 2 for r in out):
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
            ok = sum(1 for r in out if _answered(r) and int(r) == 1)
            no = sum(1 for r in out if _answered(r) and int(r) != 1)
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
            raise self._unavailable("extend", out)
        if held_here:
            self._mark_lost("expired or taken on a majority of its nodes", hold_id)
            raise LockLost("cannot extend: lock expired or taken on a majority of its "
                           "nodes", lock_name=self.name)
        raise LockNotOwned("cannot extend: this owner does not hold the lock on a "
                           "quorum of its nodes", lock_name=self.name)

    def _read(self, what: str, owner: str | None = None
              ) -> tuple[dict[str | None, list[Holder]], int]:
        """Who holds the lock on each node that answered (by owner; None: free) and
        how many did not answer; stops asking once the answer is settled (for
        ``owner`` when given, else for whoever holds a quorum)."""
        n, quorum = len(self._nodes), self.quorum

        def group(out: Outcome) -> tuple[dict[str | None, list[Holder]], int]:
            found: dict[str | None, list[Holder]] = {}
            for reply in out:
                if not _answered(reply):
                    continue
                pttl, secs, usecs = (int(x) for x in reply[:3])
                holder = (parse_holder(reply[3:], pttl, secs * 1000 + usecs // 1000)
                          if len(reply) > 3 else None)
                key = holder.owner if holder is not None else None
                found.setdefault(key, []).append(holder or Holder())
            return found, n - sum(len(v) for v in found.values())

        def settled(out: Outcome) -> bool:
            found, unknown = group(out)
            if owner is not None:
                count = len(found.get(owner, ()))
                return count >= quorum or count + unknown < quorum
            best = max((len(v) for k, v in found.items() if k is not None), default=0)
            return best >= quorum or best + unknown < quorum

        out = self._call_all(READ_HOLD, (), settled)
        self._conflict(out)
        if not settled(out):
            raise self._unavailable(what, out)
        return group(out)

    def locked(self) -> bool:
        """Whether some owner holds the lock on a quorum of nodes."""
        return self.holder() is not None

    def owned(self) -> bool:
        """Whether the calling owner holds the lock on a quorum of nodes."""
        owner, _, _, lost_reason = self._caller_view()
        if lost_reason is not None:
            return False
        found, _ = self._read("owned", owner)
        return len(found.get(owner, ())) >= self.quorum

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` unless the calling owner holds the lock on a
        quorum of nodes (asked now, of every node at once)."""
        owner, held_here, hold_id, lost_reason = self._caller_view()
        if lost_reason is not None:
            raise LockLost(f"lock lost: {lost_reason}", lock_name=self.name)
        found, _ = self._read("ensure_held", owner)
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
        found, _ = self._read("holder")
        for owner, holders in found.items():
            if owner is not None and len(holders) >= self.quorum:
                ttls = sorted((h.ttl or 0.0 for h in holders), reverse=True)
                first = holders[0]
                return Holder(owner=first.owner, count=first.count, fence=None,
                              age=first.age, ttl=ttls[self.quorum - 1],
                              info=dict(first.info))
        return None

    @property
    def fence(self) -> int | None:
        """Always raises :class:`FencingUnavailable`: see the module docs."""
        raise FencingUnavailable(FENCE_REFUSAL, lock_name=self.name)

    @property
    def lost(self) -> bool:
        """Whether this object's last hold was found lost."""
        return self._lost_reason is not None

    @property
    def depth(self) -> int:
        """How many acquires of this object are not yet released."""
        with self._state:
            self._sync_generation()
            return self._depth

    def _mark_lost(self, reason: str, hold_id: int | None = None) -> bool:
        """Record that hold ``hold_id`` (default: the current one) is lost; on_lost
        runs once per hold."""
        with self._state:
            if self._depth == 0 or self._lost_reason is not None:
                return False
            if hold_id is not None and hold_id != self._hold_id:
                return False
            self._lost_reason = reason
            hold_id = self._hold_id
        self._get_heartbeat().unregister(self, hold_id)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                logger.exception("on_lost callback for %r failed", self.name)
        return True

    # -- context manager ------------------------------------------------------------

    def __enter__(self) -> RedlockLock:
        if not self.acquire(blocking=True, timeout=self.blocking_timeout):
            raise LockNotAcquired(lock_name=self.name, holder=self.last_holder)
        return self

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.release()
        except DLockError as release_error:
            if exc is None:
                raise
            logger.warning("releasing %r after an error also failed: %s",
                           self.name, release_error)
            if hasattr(exc, "add_note"):
                exc.add_note(f"celery-dlock: releasing lock {self.name!r} also failed: "
                             f"{release_error}")

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
