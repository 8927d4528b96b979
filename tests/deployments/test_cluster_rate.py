"""``lock_rate`` on Redis Cluster: the rate state shares its lock's hash tag (one slot),
and the rule and the listing work across masters."""

from __future__ import annotations

import uuid

import redis.cluster
from test_cluster import odd_names

from celery_dlock.backends.redis.hashtag import lock_key
from celery_dlock.backends.redis.rate import RedisRates, rate_key
from celery_dlock.core.rates import parse_rate


def test_rates_on_a_cluster(cluster_client: redis.cluster.RedisCluster) -> None:
    prefix = f"cr{uuid.uuid4().hex[:6]}"
    rates = RedisRates(cluster_client)
    names = [*odd_names(6), "plain"]
    for name in names:
        assert cluster_client.keyslot(rate_key(prefix, name)) == \
            cluster_client.keyslot(lock_key(prefix, name))
        rate = parse_rate("1/s")
        assert rates.take(prefix, name, rate).run
        parked = rates.take(prefix, name, rate)
        assert not parked.run and 0.9 < parked.delay <= 1.0
    listed = dict(rates.states(prefix))
    assert sorted(listed) == sorted(names)  # from every master, each once
    assert all(state.available == 0 for state in listed.values())
