"""The ZooKeeper backend (``pip install celery-dlock[zookeeper]``, kazoo): the lock
recipe of ephemeral sequential nodes, the session timeout as the ttl and the holder
node's creation zxid as the fence (docs/backends.md, "ZooKeeper").

Nothing imports this package unless asked: ``import celery_dlock`` needs no kazoo.
"""

from __future__ import annotations

from .backend import ZooKeeperBackend, backend_from_url
from .lock import ZooKeeperLock
from .url import ZkSpec, parse_url

__all__ = ["ZkSpec", "ZooKeeperBackend", "ZooKeeperLock", "backend_from_url",
           "parse_url"]
