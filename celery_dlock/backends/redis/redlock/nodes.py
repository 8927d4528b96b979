"""The nodes of a Redlock: their checks, bounded clients, concurrent calls and renewal.

Used by :mod:`celery_dlock.backends.redis.redlock`.  Every call to the N nodes goes out
at once, each from its server's own few worker threads (:mod:`.workers`: a hung server
fills only its own), on a client of its own with a short socket timeout
(``node_timeout``)
and no client-side re-sends; a call that cannot start in time is not sent, and the
caller stops waiting as soon as the answers it has decide the question (a quorum
granted, or a quorum can no longer be reached), so one node that hangs (SIGSTOP, a
partition) costs the caller at most ``node_timeout``, and nothing once the other nodes
have answered, however long it hangs.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ....core.errors import InvalidLockConfig
from ....core.process import after_fork
from ..bounded import PLAIN_POOLS, bounded_client
from ..cluster import is_cluster_client
from ..keyspace import check_client
from ..scripts import RENEW_MANY
from .report import address as node_address
from .report import describe
from .workers import submit_to

__all__ = [
    "MIN_NODES",
    "POOL_SLACK",
    "NodeFailed",
    "Outcome",
    "QuorumNotReached",
    "RedlockRenewTarget",
    "check_distinct",
    "check_nodes",
    "fan_out",
    "learn_run_id",
    "node_client",
    "quorum_of",
    "renew_target",
    "submit",
]

#: The fewest nodes a Redlock accepts.
MIN_NODES = 3
#: How much longer than ``node_timeout`` a caller waits for a node's workers (seconds).
POOL_SLACK = 0.1



def quorum_of(n: int) -> int:
    """How many nodes of ``n`` make a majority."""
    return n // 2 + 1


def check_nodes(clients: Any, name: str | None) -> tuple[Any, ...]:
    """The clients of a Redlock as a tuple; InvalidLockConfig (one line) for fewer
    than :data:`MIN_NODES`, a cluster client, something that is not a client, or one
    server given twice: the same host and port (``localhost``, ``127.0.0.1`` and
    ``::1`` are one host), or the same unix socket, whatever the databases (several
    databases of one server are one node: they fail together).  Two names of one
    server that cannot be told apart here are found when the nodes are first
    contacted (:func:`check_distinct`)."""
    if isinstance(clients, (str, bytes)) or not isinstance(clients, Sequence):
        raise InvalidLockConfig(
            f"a Redlock needs a list of {MIN_NODES} or more Redis clients, got "
            f"{type(clients).__name__}", lock_name=name)
    nodes = tuple(clients)
    if len(nodes) < MIN_NODES:
        raise InvalidLockConfig(
            f"a Redlock needs {MIN_NODES} or more independent Redis servers, got "
            f"{len(nodes)}", lock_name=name)
    seen: dict[tuple[Any, ...], int] = {}
    for i, client in enumerate(nodes):
        check_client(client, name)
        if is_cluster_client(client):
            raise InvalidLockConfig(
                f"a Redlock node must be one Redis server, not a cluster client "
                f"(node {i})", lock_name=name)
        address = node_address(client)
        if address is None:
            continue
        server = address[:-1]
        if server in seen:
            first = seen[server]
            raise InvalidLockConfig(
                f"a Redlock's nodes must be independent servers: nodes {first} and {i} "
                f"are one server ({describe(nodes[first])} and {describe(client)})",
                lock_name=name)
        seen[server] = i
    return nodes


# -- one server under two names -------------------------------------------------------

# Per node client, the run_id its server gave ("" when it would not tell).
_run_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_run_ids_lock = threading.Lock()


def learn_run_id(node: Any) -> None:
    """Ask ``node``'s server for its ``run_id`` (``INFO server``) once per node
    client; a server that does not answer raises (the node did not answer), one that
    refuses (no ``+info`` for this ACL user) is not asked again."""
    try:
        with _run_ids_lock:
            if node in _run_ids:
                return
    except TypeError:  # not weak-referenceable: cannot be remembered
        return
    try:
        info = node.info("server")
    except ResponseError:
        info = None
    run_id = str(info.get("run_id") or "") if isinstance(info, dict) else ""
    with _run_ids_lock:
        _run_ids[node] = run_id


def check_distinct(nodes: Sequence[Any], clients: Sequence[Any],
                   name: str | None) -> None:
    """InvalidLockConfig when two of ``nodes`` gave the same ``run_id``: two names
    (as ``clients`` spell them) of one server.  Nodes not asked yet, or that would
    not tell, are not compared."""
    seen: dict[str, int] = {}
    for i, node in enumerate(nodes):
        try:
            with _run_ids_lock:
                run_id = _run_ids.get(node)
        except TypeError:
            continue
        if not run_id:
            continue
        if run_id in seen:
            first = seen[run_id]
            raise InvalidLockConfig(
                f"a Redlock's nodes must be independent servers: nodes {first} and {i} "
                f"are one server under two names ({describe(clients[first], first)} "
                f"and {describe(clients[i], i)} have the same run_id)", lock_name=name)
        seen[run_id] = i


# -- bounded clients ------------------------------------------------------------------

_node_clients: weakref.WeakKeyDictionary[Any, dict[tuple[str, float], Any]] = \
    weakref.WeakKeyDictionary()
_clients_lock = threading.Lock()


def _bounded_copy(client: Any, timeout: float) -> Any:
    pool: Any = getattr(client, "connection_pool", None)
    if type(pool) not in PLAIN_POOLS:
        return client  # Sentinel-managed and unknown pools: bounded by the wait only
    return bounded_client(pool, timeout, connect_timeout=True)


def _close_all(copies: dict[tuple[str, float], Any]) -> None:
    for copy in copies.values():
        pool = getattr(copy, "connection_pool", None)
        if pool is not None:
            pool.disconnect()
    copies.clear()


def node_client(client: Any, timeout: float, use: str = "calls") -> Any:
    """A client of ``client``'s server whose every call gives up after ``timeout``
    seconds (one per client, timeout and ``use``, and process): a connection pool of
    its own, no re-sends.  ``use`` separates renewal's connections from the rest."""
    key = (use, timeout)
    with _clients_lock:
        try:
            per = _node_clients.get(client)
            if per is None:
                per = _node_clients[client] = {}
                # When the user's client goes, close our copies' connections (else
                # the collector finds their sockets open).
                weakref.finalize(client, _close_all, per)
        except TypeError:  # not weak-referenceable: no cache
            return _bounded_copy(client, timeout)
        found = per.get(key)
        if found is None:
            found = _bounded_copy(client, timeout)
            if found is not client:  # never close the user's own connections
                per[key] = found
        return found


# -- concurrent calls -----------------------------------------------------------------


def submit(node: Any, fn: Callable[..., Any], *args: Any,
           deadline: float | None = None) -> cf.Future[Any]:
    """Run ``fn(*args)`` on the workers of ``node``'s server, without waiting (see
    :mod:`.workers`)."""
    return submit_to(node, fn, *args, deadline=deadline)


class NodeFailed:
    """A node's call failed or did not answer in time."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"<NodeFailed {self.error!r}>"


#: Per node: the reply, or NodeFailed; a caller's ``decided`` sees this list.
Outcome = list[Any]


def fan_out(nodes: Sequence[Any], call: Callable[[int, Any], Any], timeout: float,
            decided: Callable[[Outcome], bool] | None = None,
            leftover: dict[int, cf.Future[Any]] | None = None,
            budget: float | None = None) -> Outcome:
    """Run ``call(i, node)`` for every node at once, each on its server's own workers
    (so a node that hangs holds up no call to another); per node its reply, a
    :class:`NodeFailed` (an exception, or no answer within ``timeout``), or None
    when the caller stopped waiting before it answered because ``decided`` said the
    answers so far settle the question.  A call not started within ``timeout`` (or
    ``budget`` seconds, when less: what is left of the operation's validity) is not
    sent.  A call still running goes on by itself (its client's socket timeout ends
    it; it is put in ``leftover``, by node, when given)."""
    start = time.monotonic()
    limit = timeout if budget is None else max(0.0, min(timeout, budget))
    pending: dict[cf.Future[Any], int] = {}
    for i, node in enumerate(nodes):
        pending[submit_to(node, call, i, node, deadline=start + limit)] = i
    out: Outcome = [None] * len(nodes)
    waiting = set(pending)
    end = start + timeout + POOL_SLACK
    while waiting:
        left = end - time.monotonic()
        if left <= 0:
            break
        done, waiting = cf.wait(waiting, timeout=left, return_when=cf.FIRST_COMPLETED)
        for future in done:
            i = pending[future]
            error = future.exception()
            out[i] = NodeFailed(error) if error is not None else future.result()
        if decided is not None and decided(out):
            if leftover is not None:
                leftover.update((pending[f], f) for f in waiting)
            return out
    for future in waiting:
        out[pending[future]] = NodeFailed(None)
    return out


# -- renewal ----------------------------------------------------------------------------


class QuorumNotReached(RedisError):
    """Renewal could not tell, for some hold, whether a quorum still has it (too few
    nodes answered); the scheduler retries until the hold's deadline."""


class RedlockRenewTarget:
    """Renews holds on every node of one Redlock at once (see
    :class:`celery_dlock.core.scheduler.RenewTarget`): per hold 1 when a quorum
    renewed it, 0 or -1 (taken somewhere) when a quorum no longer can; raises
    :class:`QuorumNotReached` when the answers leave it open."""

    def __init__(self, clients: Sequence[Any], timeout: float) -> None:
        self.clients = tuple(clients)
        self.nodes = tuple(node_client(c, timeout, "renew") for c in clients)
        self.timeout = timeout
        self.quorum = quorum_of(len(self.nodes))

    def _verdicts(self, out: Outcome, n_items: int) -> list[int | None]:
        verdicts: list[int | None] = []
        n = len(out)
        for j in range(n_items):
            ok = gone = taken = 0
            for reply in out:
                if reply is None or isinstance(reply, NodeFailed):
                    continue
                code = int(reply[j])
                ok += code == 1
                gone += code == 0
                taken += code == -1
            if ok >= self.quorum:
                verdicts.append(1)
            elif gone + taken > n - self.quorum:
                verdicts.append(-1 if taken else 0)
            else:
                verdicts.append(None)
        return verdicts

    def renew(self, items: Sequence[tuple[str, str, int]]) -> list[int]:
        keys = [key for key, _, _ in items]
        args: list[Any] = []
        for _, owner, ttl in items:
            args += (owner, ttl)

        def call(_: int, node: Any) -> Any:
            return RENEW_MANY(node, keys, args)

        out = fan_out(self.nodes, call, self.timeout,
                      lambda o: None not in self._verdicts(o, len(items)))
        verdicts = self._verdicts(out, len(items))
        if None in verdicts:
            answered = sum(1 for r in out
                           if r is not None and not isinstance(r, NodeFailed))
            raise QuorumNotReached(f"renewal answered by {answered} of {len(out)} "
                                   f"Redlock nodes, {self.quorum} needed")
        return [int(v) for v in verdicts if v is not None]


_targets: weakref.WeakValueDictionary[tuple[Any, ...], RedlockRenewTarget] = \
    weakref.WeakValueDictionary()
_targets_lock = threading.Lock()


def renew_target(clients: Sequence[Any], timeout: float) -> RedlockRenewTarget:
    """The renew target of these clients (one per set of client objects, timeout and
    process, while in use: the scheduler gives each target its own renewer thread)."""
    key = (*(id(c) for c in clients), timeout)
    with _targets_lock:
        target = _targets.get(key)
        if target is None:
            target = _targets[key] = RedlockRenewTarget(clients, timeout)
        return target


def _after_fork_in_child() -> None:
    global _clients_lock, _node_clients, _targets, _targets_lock, _run_ids, \
        _run_ids_lock
    # The parent's connections are its own.
    _clients_lock = threading.Lock()
    _node_clients = weakref.WeakKeyDictionary()
    _run_ids = weakref.WeakKeyDictionary()
    _run_ids_lock = threading.Lock()
    _targets = weakref.WeakValueDictionary()
    _targets_lock = threading.Lock()


after_fork(_after_fork_in_child)
