"""RedisLock, the inspect functions and the CLI on a Redis Cluster of three masters."""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest
import redis.cluster
from celery import Celery
from celery.bin.base import CLIContext
from celery_helpers import test_app
from click.testing import CliRunner
from dlock_helpers import wait_until

from celery_dlock import LockLost, RedisLock
from celery_dlock.backends.redis.inspect import (
    force_release,
    get_lock,
    iter_locks,
    lock_name_of,
)
from celery_dlock.ops.cli import dlock

# Names that once broke (an empty hash tag: keys spread over slots) or that stress
# the key: braces everywhere, unicode, 1000 characters.
_BROKE = ["}", "}{", "}}", "}锁{", "}}{{", "}{}", "}a{b}", "}" * 50]


def odd_names(count: int, seed: int = 12) -> list[str]:
    rng = random.Random(seed)
    alphabet = ["{", "}", "a", "z", ":", " ", "*", "?", "[", "]", "\\", "锁", "é", "🔒",
                "#", "\n", "%", "0"]
    names = [*_BROKE, "{", "{}", "{}}", "a}", "a{}b", "{a}", "x" * 1000,
             "}" + "锁" * 999, "{" * 1000]
    unique = dict.fromkeys(names)
    for _ in range(100 * count):  # bounded: short names repeat now and then
        if len(unique) >= count:
            break
        length = rng.choice([1, 2, 3, 5, 8, 40, 1000])
        unique["".join(rng.choice(alphabet) for _ in range(length))] = None
    return list(unique)[:count]


@pytest.fixture
def prefix() -> str:
    return f"dlc{uuid.uuid4().hex[:8]}"


def test_every_key_of_a_lock_is_in_one_slot(cluster_client, prefix):
    for name in odd_names(300):
        keys = RedisLock(cluster_client, name, prefix=prefix).keys
        slots = {cluster_client.keyslot(k) for k in (*keys[:4], keys.doorbell("o"))}
        assert len(slots) == 1, (name, keys.lock, slots)


def test_odd_names_exclude_another_owner(cluster_client, prefix):
    names = odd_names(300)
    assert len(names) == 300
    for name in names:
        a = RedisLock(cluster_client, name, ttl=20, owner="A", prefix=prefix,
                      auto_renew=False)
        b = RedisLock(cluster_client, name, ttl=20, owner="B", prefix=prefix,
                      auto_renew=False)
        assert a.acquire(blocking=False), name
        assert not b.acquire(blocking=False), name
        assert b.last_holder is not None and b.last_holder.owner == "A"
        first = a.fence
        a.release()
        assert b.acquire(blocking=False), name
        assert b.fence is not None and first is not None and b.fence > first
        b.release()


def test_listing_recovers_every_name(cluster_client, prefix):
    names = odd_names(300, seed=7)
    locks = [RedisLock(cluster_client, n, ttl=30, prefix=prefix, owner="L",
                       auto_renew=False) for n in names]
    for lock in locks:
        assert lock.acquire(blocking=False)
    try:
        listed = {info.key: info for info in iter_locks(cluster_client, prefix,
                                                        page_size=50)}
        assert set(listed) == set(names)
        assert all(info.owner == "L" and info.ttl and info.ttl > 0
                   for info in listed.values())
        # every master had some: listing scanned them all
        nodes = {cluster_client.get_node_from_key(lock.keys.lock).name for lock in locks}
        assert len(nodes) == 3
        for name in names[:20]:
            assert lock_name_of(prefix, RedisLock(cluster_client, name,
                                                  prefix=prefix).keys.lock) == name
    finally:
        for lock in locks:
            lock.release()


def test_holder_works_on_a_cluster(cluster_client, prefix):
    lock = RedisLock(cluster_client, "}锁{", ttl=10, prefix=prefix, info={"job": "7"})
    assert lock.holder() is None
    assert lock.acquire()
    holder = lock.holder()
    assert holder is not None
    assert holder.owner and holder.fence == lock.fence and holder.count == 1
    assert holder.ttl is not None and 0 < holder.ttl <= 10
    assert holder.age is not None and 0 <= holder.age < 5
    assert holder.info["job"] == "7"
    info = get_lock(cluster_client, prefix, "}锁{")
    assert info is not None and info.fence == lock.fence
    freed = force_release(cluster_client, prefix, "}锁{", fence=lock.fence)
    assert freed is not None and freed.ttl is not None and freed.fence == lock.fence
    assert lock.holder() is None
    with pytest.raises(LockLost):
        lock.release()


def test_blocking_acquire_times_out_then_hands_off(cluster_client, prefix):
    name = "}hand{off"
    a = RedisLock(cluster_client, name, ttl=20, owner="A", prefix=prefix)
    b = RedisLock(cluster_client, name, ttl=20, owner="B", prefix=prefix)
    assert a.acquire()
    started = time.monotonic()
    assert not b.acquire(timeout=0.5)
    waited = time.monotonic() - started
    assert 0.4 <= waited < 3, waited
    got: list[float] = []

    def wait_for_it() -> None:
        if b.acquire(timeout=10):
            got.append(time.monotonic())

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    time.sleep(0.3)  # b is asleep on its doorbell
    released = time.monotonic()
    a.release()
    thread.join(15)
    assert got, "the waiter never got the lock"
    assert got[0] - released < 1.5, got[0] - released  # woken, not polling ttl
    b.release()


def test_renewal_of_200_holds_over_every_master(cluster_client, prefix):
    locks = [RedisLock(cluster_client, f"}}r{i}{{", ttl=2.0, prefix=prefix)
             for i in range(200)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    try:
        nodes = {cluster_client.get_node_from_key(lock.keys.lock).name for lock in locks}
        assert len(nodes) == 3
        time.sleep(4.5)  # more than twice the ttl: only renewals keep them
        assert not any(lock.lost for lock in locks)
        holders = [lock.holder() for lock in locks]
        assert all(h is not None and h.owner for h in holders)
    finally:
        for lock in locks:
            lock.release()


def _cli(app: Celery, *args: str) -> object:
    obj = CLIContext(app=app, no_color=True, workdir=None)
    return CliRunner().invoke(dlock, list(args), obj=obj, catch_exceptions=False)


def test_cli_ls_show_release_on_a_cluster(cluster, cluster_client, prefix):
    app = Celery("dlc", set_as_current=False)
    app.conf.dlock_url = f"redis+cluster://127.0.0.1:{cluster.servers[1].port}"
    app.conf.dlock_key_prefix = prefix
    names = ["}", "}锁{", "plain", "a{b}"]
    locks = [RedisLock(cluster_client, n, ttl=30, prefix=prefix, owner=f"o{i}",
                       auto_renew=False) for i, n in enumerate(names)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    try:
        out = _cli(app, "ls", "--json")
        assert out.exit_code == 0, out.output
        import json

        rows = json.loads(out.output)
        assert sorted(r["key"] for r in rows) == sorted(names)
        out = _cli(app, "show", "}锁{")
        assert out.exit_code == 0, out.output
        assert "o1" in out.output and locks[1].keys.lock in out.output
        out = _cli(app, "release", "}", "--force")
        assert out.exit_code == 0, out.output
        assert locks[0].holder() is None and locks[1].holder() is not None
        url = f"redis+cluster://127.0.0.1:{cluster.servers[2].port}"
        out = _cli(app, "--url", url, "--prefix", prefix, "ls", "--json")
        assert out.exit_code == 0, out.output
        assert sorted(r["key"] for r in json.loads(out.output)) == sorted(names[1:])
        out = _cli(app, "top", "--iterations", "1")
        assert out.exit_code == 0, out.output
        assert "a{b}" in out.output
    finally:
        for lock in locks[1:]:
            lock.release()
    assert wait_until(lambda: not list(iter_locks(cluster_client, prefix)), 5)


def test_a_cluster_client_is_what_the_url_gives(cluster, prefix):
    from celery_dlock.task.config import get_client

    app = Celery("dlc2", set_as_current=False)
    app.conf.dlock_url = f"redis+cluster://127.0.0.1:{cluster.servers[0].port}"
    client = get_client(app)
    assert isinstance(client, redis.cluster.RedisCluster)
    with RedisLock(client, "}", prefix=prefix) as lock:
        assert lock.holder() is not None


# -- LockedTask ---------------------------------------------------------------------

def _task_app(redis_url: str, prefix: str, **conf: object) -> Celery:
    return test_app(f"dlc{prefix}", redis_url, queue=f"q-{prefix}", prefix=prefix,
                    **conf)


@pytest.mark.parametrize("how", ["dlock_url", "dlock_client"])
def test_locked_task_on_a_cluster(how, cluster, redis_url, prefix):
    from celery.contrib.testing.worker import start_worker
    from celery_helpers import close_app

    from celery_dlock import LockedTask, is_skipped

    url = f"redis+cluster://127.0.0.1:{cluster.servers[0].port}"
    conf: dict[str, object] = (
        {"dlock_url": url} if how == "dlock_url"
        else {"dlock_client": lambda: redis.cluster.RedisCluster.from_url(
            url.replace("redis+cluster", "redis"), socket_timeout=5)})
    app = _task_app(redis_url, prefix, **conf)
    probe = redis.cluster.RedisCluster.from_url(url.replace("redis+cluster", "redis"))

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="{x}",
              on_contention="skip", lock_ttl=3)
    def hold(self, x, seconds):
        holder = RedisLock(probe, x, prefix=prefix).holder()
        time.sleep(seconds)
        return {"fence": self.lock.fence, "owned": self.lock.owned(),
                "holder_fence": holder.fence if holder else None}

    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                          shutdown_timeout=20):
            first = hold.delay("}锁{", 4.0)  # longer than its ttl: renewed
            assert wait_until(lambda: RedisLock(probe, "}锁{", prefix=prefix)
                              .holder() is not None, 10)
            second = hold.delay("}锁{", 0)
            skipped = second.get(timeout=30)
            done = first.get(timeout=30)
            assert done["owned"] and done["fence"] == done["holder_fence"]
            assert is_skipped(skipped), skipped
            third = hold.delay("}锁{", 0).get(timeout=30)
            assert third["owned"] and third["fence"] > done["fence"]
    finally:
        close_app(app)
        probe.close()


def test_blocking_acquire_with_a_short_socket_timeout(cluster):
    # A blocked acquirer sleeps in BLPOP: each sleep must end before the socket
    # timeout of the cluster client's connections, or it reads as an outage.
    client = cluster.client(socket_timeout=0.5, socket_connect_timeout=0.5)
    prefix = f"dlc{uuid.uuid4().hex[:8]}"
    try:
        a = RedisLock(client, "w", ttl=1.5, owner="A", prefix=prefix, auto_renew=False)
        b = RedisLock(client, "w", ttl=5, owner="B", prefix=prefix)
        assert a.acquire()
        started = time.monotonic()
        assert b.acquire(timeout=5)  # gets it when a's hold expires
        assert 1.0 < time.monotonic() - started < 4
        b.release()
    finally:
        client.close()


def test_an_evicting_master_is_named_whichever_node_the_client_asks(cluster, caplog):
    client = cluster.client(socket_timeout=5)
    default = client.get_default_node().port
    others = [s.client() for s in cluster.servers if s.port != default]
    for other in others:
        other.config_set("maxmemory", "1gb")
        other.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with caplog.at_level("WARNING", logger="celery_dlock.server"), \
                RedisLock(client, "evict", prefix=f"dlc{uuid.uuid4().hex[:8]}"):
            pass
        warnings = [r for r in caplog.records if "may evict" in r.getMessage()]
        assert len(warnings) == len(others)
        assert all("allkeys-lru" in r.getMessage() for r in warnings)
    finally:
        for other in others:
            other.config_set("maxmemory", "0")
            other.config_set("maxmemory-policy", "noeviction")
            other.close()
        client.close()
