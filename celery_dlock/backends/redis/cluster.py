"""Renewal on Redis Cluster: one renew target (so one renewer thread) per master.

A hold's target is the master that served its key's slot when the hold was taken.  Each
target renews the holds of its master with one pipeline (one ``RENEW_MANY`` call per
slot, since a script's keys must share a slot) over a connection of its own, with a
bounded socket timeout and no client-side re-sends: one round trip per node and
renewal pass, and a master that stalls holds up only its own renewer.

When the slot has moved (``MOVED``/``ASK`` after resharding) or the master cannot be
reached (it died; Cluster may have promoted a replica), the target renews through the
user's cluster client instead, which follows redirects and refreshes its view of the
cluster, one call per slot.  The scheduler's watchdog declares a hold lost at its local
deadline whatever a renewal call is doing, so a slow fallback never hides a loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .bounded import bounded_client
from .scripts import RENEW_MANY

__all__ = ["ClusterNodeRenewTarget", "is_cluster_client", "node_clients", "node_name_of"]

#: Replies that mean "ask the cluster where this slot lives now".
_REDIRECTS = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")


def is_cluster_client(client: Any) -> bool:
    """Whether ``client`` is a (synchronous) redis-py Cluster client."""
    cluster = getattr(redis, "cluster", None)
    return cluster is not None and isinstance(client, cluster.RedisCluster)


def node_clients(client: Any) -> list[Any]:
    """A plain client of each master of a Redis Cluster client; ``[client]`` for any
    other client."""
    primaries = getattr(client, "get_primaries", None)
    connection = getattr(client, "get_redis_connection", None)
    if callable(primaries) and callable(connection):
        return [connection(node) for node in primaries()]
    return [client]


def node_name_of(client: Any, key: str) -> str:
    """``host:port`` of the master serving ``key``'s slot (the client's view)."""
    return str(client.get_node_from_key(key).name)


def _node_client(client: Any, node_name: str,
                 socket_timeout: float) -> redis.Redis | None:
    """A plain client of one master, with a pool of its own; None when the cluster
    client no longer knows that node (it failed and the client refreshed its view)."""
    node = client.get_node(node_name=node_name)
    if node is None or node.redis_connection is None:
        return None
    pool: Any = node.redis_connection.connection_pool
    return bounded_client(pool, socket_timeout, max_connections=2,
                          drop_connect_func=True)


class ClusterNodeRenewTarget:
    """Renews the holds taken on one master of a cluster (see the module text)."""

    def __init__(self, client: Any, node_name: str, socket_timeout: float) -> None:
        self.cluster = client
        self.node_name = node_name
        self._socket_timeout = socket_timeout
        self._node: redis.Redis | None = None
        self.fallbacks = 0  # renewals that went through the cluster client

    def _groups(self, items: Sequence[tuple[str, str, int]]) -> list[list[int]]:
        groups: dict[int, list[int]] = {}
        for i, (key, _, _) in enumerate(items):
            groups.setdefault(int(self.cluster.keyslot(key)), []).append(i)
        return list(groups.values())

    @staticmethod
    def _call(items: Sequence[tuple[str, str, int]],
              group: list[int]) -> tuple[list[str], list[Any]]:
        keys = [items[i][0] for i in group]
        args: list[Any] = []
        for i in group:
            args += (items[i][1], items[i][2])
        return keys, args

    def _on_node(self, items: Sequence[tuple[str, str, int]],
                 groups: list[list[int]]) -> list[Any] | None:
        """The replies of this target's master, one per group; None when the cluster
        client no longer knows that master."""
        if self._node is None:
            self._node = _node_client(self.cluster, self.node_name, self._socket_timeout)
            if self._node is None:
                return None
        pipe = self._node.pipeline(transaction=False)
        for group in groups:
            keys, args = self._call(items, group)
            pipe.evalsha(RENEW_MANY.sha, len(keys), *keys, *args)
        replies = list(pipe.execute(raise_on_error=False))
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:  # a restarted or promoted master: EVAL caches it again
            pipe = self._node.pipeline(transaction=False)
            for i in missing:
                keys, args = self._call(items, groups[i])
                pipe.eval(RENEW_MANY.source, len(keys), *keys, *args)
            for i, reply in zip(missing, pipe.execute(raise_on_error=False),
                                strict=True):
                replies[i] = reply
        return replies

    def renew(self, items: Sequence[tuple[str, str, int]]) -> list[int]:
        groups = self._groups(items)
        try:
            replies: list[Any] | None = self._on_node(items, groups)
        except (RedisConnectionError, RedisTimeoutError):
            self.close()
            replies = None
        if replies is None:  # the master is unreachable or gone from the cluster:
            replies = [None] * len(groups)  # the cluster client tries each group
        out = [0] * len(items)
        for group, reply in zip(groups, replies, strict=True):
            codes = reply
            if reply is None or isinstance(reply, Exception):
                if reply is not None and not (isinstance(reply, ResponseError) and
                                              str(reply).startswith(_REDIRECTS)):
                    raise reply
                self.fallbacks += 1
                keys, args = self._call(items, group)
                codes = RENEW_MANY(self.cluster, keys, args)
            for i, code in zip(group, codes, strict=True):
                out[i] = int(code)
        return out

    def close(self) -> None:
        node, self._node = self._node, None
        if node is not None:
            node.connection_pool.disconnect()
