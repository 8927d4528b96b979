"""Renewal of Redis holds: one :class:`RedisRenewTarget` per client, on its own
connection (on Redis Cluster, one target per master:
:mod:`celery_dlock.backends.redis.cluster`).

The scheduler (:mod:`celery_dlock.core.scheduler`) gives each target its own renewer
thread; this module gives each target its own connection pool, a copy of the client's
settings with a bounded socket timeout and no client-side re-sends.  So renewal never
waits for a connection of the user's pool (a ``BlockingConnectionPool`` busy in the
user's own ``BLPOP`` calls), and a server that hangs holds up only its own renewer, for
at most :data:`RENEW_SOCKET_TIMEOUT`.

A renewal is one script call per slot.  Only when it finds holds gone does a target
read, in one more round trip, the markers a force release leaves
(:mod:`celery_dlock.backends.redis.released`), so that the holder is told who released
it and why (a :class:`~celery_dlock.core.scheduler.LossNote`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import redis

from ...core.process import after_fork
from ...core.renew_target import LossNote
from .bounded import PLAIN_POOLS, bounded_client
from .cluster import ClusterNodeRenewTarget, is_cluster_client, node_name_of
from .released import read_loss_reasons
from .scripts import RENEW_MANY

__all__ = ["RENEW_SOCKET_TIMEOUT", "RedisRenewTarget", "renew_target", "shared_by"]

#: The longest a renewal call waits for its reply (seconds); the client's own
#: ``socket_timeout`` when shorter.
RENEW_SOCKET_TIMEOUT = 2.0

_PLAIN_POOLS = (redis.ConnectionPool, redis.BlockingConnectionPool)


def _dedicated_client(client: Any) -> Any:
    """A client of the same server with a pool of its own, or ``client`` itself for
    the kinds of client it cannot copy (cluster, Sentinel, unknown)."""
    pool: Any = getattr(client, "connection_pool", None)
    if type(pool) not in PLAIN_POOLS:
        return client
    return bounded_client(pool, RENEW_SOCKET_TIMEOUT, max_connections=2)


def with_loss_reasons(client: Any, items: Sequence[tuple[str, str, int]],
                      codes: Sequence[int]) -> list[int | LossNote]:
    """``codes``, with a :class:`LossNote` for each hold found gone whose lock has a
    force release's marker naming its owner (read with ``client``)."""
    out: list[int | LossNote] = list(codes)
    gone = [i for i, code in enumerate(codes) if code != 1]
    if not gone:
        return out
    notes = read_loss_reasons(client, [(items[i][0], items[i][1]) for i in gone])
    for i, note in zip(gone, notes, strict=True):
        if note is not None:
            out[i] = LossNote(codes[i], note[0], note[1])
    return out


class RedisRenewTarget:
    """Renews holds on the server of one client with ``RENEW_MANY`` (a subclass may
    name another script of the same contract: ``script``)."""

    #: The script that renews many holds (KEYS: the holds; ARGV: owner, ttl pairs).
    script: Any = RENEW_MANY

    def __init__(self, client: Any) -> None:
        self.client = _dedicated_client(client)
        keyslot = getattr(client, "keyslot", None)
        self._keyslot = keyslot if callable(keyslot) else None

    def renew(self, items: Sequence[tuple[str, str, int]]) -> list[int | LossNote]:
        # One call per slot: a script's keys must share one (cluster).
        groups: dict[int, list[int]] = {}
        for i, (key, _, _) in enumerate(items):
            slot = int(self._keyslot(key)) if self._keyslot is not None else 0
            groups.setdefault(slot, []).append(i)
        out = [0] * len(items)
        for indexes in groups.values():
            keys = [items[i][0] for i in indexes]
            args: list[Any] = []
            for i in indexes:
                args += (items[i][1], items[i][2])
            for i, reply in zip(indexes, self.script(self.client, keys, args),
                                strict=True):
                out[i] = int(reply)
        return with_loss_reasons(self.client, items, out)

    def close(self) -> None:
        if self.client is not None and hasattr(self.client, "connection_pool"):
            self.client.connection_pool.disconnect()


class _ClusterNodeTarget(ClusterNodeRenewTarget):
    """A cluster master's renew target that also says why a hold is gone."""

    def renew(self, items: Sequence[tuple[str, str, int]]  # type: ignore[override]
              ) -> list[int | LossNote]:
        codes = super().renew(items)
        # The master's own connection (bounded timeout) when there is one; a marker
        # that moved meanwhile is simply not read.
        node = self._node
        return with_loss_reasons(self.cluster if node is None else node, items, codes)


_targets: weakref.WeakKeyDictionary[Any, RedisRenewTarget] = weakref.WeakKeyDictionary()
_node_targets: weakref.WeakKeyDictionary[Any, dict[str, ClusterNodeRenewTarget]] = \
    weakref.WeakKeyDictionary()
_targets_lock = threading.Lock()


def shared_by(client: Any) -> Any:
    """What a renew target is kept per: the client's plain connection pool (clients
    sharing one pool share one target, its connections and its thread), else the
    client object."""
    pool = getattr(client, "connection_pool", None)
    return pool if type(pool) in PLAIN_POOLS else client


def renew_target(client: Any, key: str | None = None) -> Any:
    """The renew target of ``client`` (one per connection pool, see
    :func:`shared_by`, and process); for a cluster client, the one of the master
    serving ``key``."""
    if key is not None and is_cluster_client(client):
        node = node_name_of(client, key)
        with _targets_lock:
            per_node = _node_targets.setdefault(client, {})
            node_target = per_node.get(node)
            if node_target is None:
                node_target = per_node[node] = _ClusterNodeTarget(
                    client, node, RENEW_SOCKET_TIMEOUT)
            return node_target
    owner = shared_by(client)
    with _targets_lock:
        try:
            return _targets[owner]
        except KeyError:
            target = _targets[owner] = RedisRenewTarget(client)
            return target
        except TypeError:  # not weak-referenceable: no cache
            return RedisRenewTarget(client)


def _after_fork_in_child() -> None:
    global _targets, _node_targets, _targets_lock
    _targets = weakref.WeakKeyDictionary()
    _node_targets = weakref.WeakKeyDictionary()
    _targets_lock = threading.Lock()


after_fork(_after_fork_in_child)
