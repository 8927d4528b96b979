"""Reading and freeing held locks (``celery_dlock.backends.redis.inspect``) on a real
Redis."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import pytest
import redis
from dlock_helpers import closed_port, fast_failing_client, wait_until

from celery_dlock import BackendUnavailable, RedisLock
from celery_dlock.backends.redis import inspect as inspect_module
from celery_dlock.backends.redis.inspect import (
    SUMMARY_FIELDS,
    HoldChanged,
    HoldInfo,
    force_release,
    get_lock,
    iter_locks,
    lock_name_of,
    scan_pattern,
    waiting_counts,
)
from celery_dlock.backends.redis.keyspace import LockKeys
from celery_dlock.task.events import Event, events_key, recent_events


def hold(r: redis.Redis, prefix: str, name: str, owner: str = "me",
         **kwargs: Any) -> RedisLock:
    lock = RedisLock(r, name, prefix=prefix, owner=owner, auto_renew=False, **kwargs)
    assert lock.acquire(blocking=False)
    return lock


class CountingRedis(redis.Redis):
    """A real client that records its round trips: commands by name, and pipeline
    flushes as ``"PIPELINE"``."""

    calls: list[str] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.calls.append(str(args[0]).upper())
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        execute = pipe.execute

        def counted(raise_on_error: bool = True) -> Any:
            self.calls.append("PIPELINE")
            return execute(raise_on_error)

        pipe.execute = counted  # type: ignore[method-assign]
        return pipe


def test_get_lock_reads_every_field(r, prefix, name):
    lock = hold(r, prefix, name, ttl=20,
                info={"task_id": "t-1", "task_name": "shop.reduce", "worker": "w@h",
                      "tenant": "acme"})
    lock.acquire()  # re-entry: count 2, same hold
    info = get_lock(r, prefix, name)
    assert info is not None
    assert info.key == name and info.owner == "me"
    assert (info.task_id, info.task_name, info.worker) == ("t-1", "shop.reduce", "w@h")
    assert info.pid == os.getpid()
    assert info.count == 2 and info.fence == lock.fence
    assert info.ttl is not None and 19 < info.ttl <= 20
    assert info.held_for is not None and 0 <= info.held_for < 5
    assert info.host
    assert dict(info.extra) == {"tenant": "acme"}
    assert list(info.as_dict()) == [*SUMMARY_FIELDS, "host", "extra"]
    assert list(info.summary()) == list(SUMMARY_FIELDS)
    json.dumps(info.as_dict())  # JSON-ready
    assert get_lock(r, prefix, "nobody-holds-this") is None


def test_held_for_uses_the_server_clock(r, prefix, name):
    hold(r, prefix, name)
    secs, usecs = r.time()
    server_ms = secs * 1000 + usecs // 1000
    r.hset(LockKeys.for_name(prefix, name).lock, "acquired_at", server_ms - 90_000)
    info = get_lock(r, prefix, name)
    assert info is not None and info.held_for is not None
    assert 90 <= info.held_for < 95


def test_iter_locks_lists_holds_and_skips_helper_keys(r, prefix):
    names = ["a", "b:c", "with space", "brace}inside", "{tagged}"]
    for n in names:
        hold(r, prefix, n)
    # a waiter in line gives the lock a queue, a lease set and a doorbell
    waiter = RedisLock(r, "a", prefix=prefix, owner="waiter", auto_renew=False)
    assert not waiter.acquire(timeout=0.05)
    r.zadd(LockKeys.for_name(prefix, "a").queue, {"ghost": 1})
    r.rpush(LockKeys.for_name(prefix, "a").doorbell("ghost"), 1)
    # and a released lock leaves only its fence counter behind
    hold(r, prefix, "gone").release()
    # other prefixes are not listed, even those that start the same way
    hold(r, prefix + "x", "other")
    hold(r, prefix[:-1], "other")
    found = {info.key: info for info in iter_locks(r, prefix)}
    assert sorted(found) == sorted(names)
    assert all(isinstance(info, HoldInfo) and info.owner == "me"
               for info in found.values())


def test_iter_locks_escapes_glob_characters_in_the_prefix(r, prefix):
    odd = prefix + "*[x]?"
    hold(r, odd, "mine")
    hold(r, prefix + "Z[x]!", "not-mine")
    assert [i.key for i in iter_locks(r, odd)] == ["mine"]
    assert scan_pattern("a*b") == "a\\*b:[{#]*}"
    assert lock_name_of("p", "p:{x}") == "x"
    assert lock_name_of("p", LockKeys.for_name("p", "}x{").lock) == "}x{"
    assert lock_name_of("p", "p:#{0000000000000000}{}x{}") is None  # digest differs
    assert lock_name_of("p", "p:{x}:q") is None
    assert lock_name_of("p", "q:{x}") is None


def test_iter_locks_works_with_decoded_responses(redis_url, prefix, name):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        hold(client, prefix, name, info={"task_id": "t"})
        (info,) = iter_locks(client, prefix)
        assert (info.key, info.owner, info.task_id) == (name, "me", "t")
        again = get_lock(client, prefix, name)
        assert again is not None and (again.owner, again.fence) == ("me", info.fence)
        freed = force_release(client, prefix, name)
        assert freed is not None and freed.task_id == "t"
    finally:
        client.close()


def test_listing_many_locks_takes_few_round_trips(redis_url, prefix):
    r = CountingRedis.from_url(redis_url)
    r.calls = []
    try:
        pipe = r.pipeline(transaction=False)
        for i in range(1000):
            key = LockKeys.for_name(prefix, f"n{i}")
            pipe.hset(key.lock, mapping={"owner": f"o{i}", "count": 1, "fence": 1,
                                         "acquired_at": 0, "ttl": 60000})
            pipe.pexpire(key.lock, 60000)
            pipe.set(key.fence, 1)  # helper keys, skipped by the server (TYPE hash)
        pipe.execute()
        r.calls.clear()
        infos = list(iter_locks(r, prefix, page_size=250))
        assert len(infos) == 1000
        assert len({i.key for i in infos}) == 1000
        # SCAN pages (how many depends on the whole keyspace) plus one pipeline per
        # page of 250 locks, rather than two commands per lock.
        assert r.calls.count("PIPELINE") == 4
        assert set(r.calls) == {"SCAN", "PIPELINE"}
    finally:
        r.close()


def test_force_release_frees_whoever_holds_it_and_wakes_the_waiter(r, prefix, name):
    holder = hold(r, prefix, name, info={"task_id": "t-9", "task_name": "slow"})
    got: list[float] = []

    def wait_for_it() -> None:
        waiter = RedisLock(r, name, prefix=prefix, owner="waiter", auto_renew=False)
        if waiter.acquire(timeout=20):
            got.append(time.monotonic())
            waiter.release()

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    try:
        assert wait_until(lambda: waiting_counts(r, prefix, [name])[name] == 1)
        freed_at = time.monotonic()
        freed = force_release(r, prefix, name)
        assert freed is not None
        assert (freed.owner, freed.task_id, freed.task_name) == ("me", "t-9", "slow")
        assert freed.fence == holder.fence
        assert freed.ttl is not None and freed.ttl > 0
        thread.join(10)
        # woken by the release (its doorbell), not by a timeout or the holder's ttl
        assert got and got[0] - freed_at < 1.5
    finally:
        thread.join(10)
    assert force_release(r, prefix, name) is None
    assert get_lock(r, prefix, name) is None


def test_force_release_with_a_fence_frees_only_that_hold(r, prefix, name):
    first = hold(r, prefix, name, owner="first")
    fence = first.fence
    assert force_release(r, prefix, name, fence=fence) is not None
    second = hold(r, prefix, name, owner="second")
    with pytest.raises(HoldChanged) as caught:
        force_release(r, prefix, name, fence=fence)
    assert caught.value.current is not None
    assert caught.value.current.owner == "second"
    assert caught.value.current.fence == second.fence
    assert get_lock(r, prefix, name) is not None  # left alone


def test_force_release_of_an_ended_hold_is_refused_whatever_its_operation_id(
        r, prefix, name, monkeypatch):
    # The counter keeps 8 bits of a force release's operation id: two calls whose ids
    # share them look alike to it.  The second call, naming a hold that had already
    # ended, is still told that another hold has the lock.
    ids = iter(["ab" + os.urandom(7).hex() for _ in range(2)])
    monkeypatch.setattr(inspect_module, "new_op_id", lambda: next(ids))
    first = hold(r, prefix, name, owner="first")
    assert force_release(r, prefix, name, fence=first.fence) is not None
    second = hold(r, prefix, name, owner="second")
    with pytest.raises(HoldChanged) as caught:
        force_release(r, prefix, name, fence=first.fence)
    assert caught.value.current is not None
    assert caught.value.current.fence == second.fence
    assert get_lock(r, prefix, name) is not None


def test_a_hold_is_told_from_foreign_data_by_numbers_as_the_scripts_lua_reads_them(r):
    # The read's early HoldChanged is for a hold only: what the scripts' Lua takes for
    # a number (tonumber) must be what the read takes for one, else foreign data gets
    # HoldChanged instead of the scripts' refusal (or a hold the refusal).
    import random
    import string

    rng = random.Random(7)
    alphabet = "0123456789xXeEpP.+- _aAfFnNiI()\t\v\x1c" + string.ascii_letters[:6]
    corpus = ["0x10", "1_0", "nan", "inf", "-0x1p3", "nan(x_1)", " 12 ", "\u0661\u0662",
              "1e", "0x", "++1", "-+0x1"]
    corpus += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7)))
               for _ in range(1500)]
    wrong = []
    for text in corpus:
        lua = r.eval("return tonumber(ARGV[1]) ~= nil and 1 or 0", 0, text) == 1
        if inspect_module._lua_number(text) != lua:
            wrong.append((text, lua))
    assert wrong == []


def test_waiting_counts_only_live_waiters(r, prefix, name):
    hold(r, prefix, name)
    leases = LockKeys.for_name(prefix, name).leases
    secs, _ = r.time()
    r.zadd(leases, {"live": (secs + 60) * 1000, "dead": (secs - 60) * 1000})
    assert waiting_counts(r, prefix, [name, "other"]) == {name: 1, "other": 0}
    assert waiting_counts(r, prefix, []) == {}


def test_unreachable_redis_is_backend_unavailable(prefix):
    client = fast_failing_client(closed_port(), timeout=0.3)
    with pytest.raises(BackendUnavailable):
        list(iter_locks(client, prefix))
    with pytest.raises(BackendUnavailable):
        get_lock(client, prefix, "x")
    with pytest.raises(BackendUnavailable):
        force_release(client, prefix, "x")


def test_recent_events_reads_the_capped_list(r, prefix):
    key = events_key(prefix)
    older = Event(at=1.0, kind="contended", key="k", task_name="t", policy="skip")
    newer = Event(at=2.0, kind="lost", key="k", detail="expired")
    r.lpush(key, json.dumps(older.as_dict()), "not json", json.dumps(newer.as_dict()))
    assert recent_events(r, prefix, 10) == [newer, older]
    assert recent_events(r, prefix, 1) == [newer]
    assert recent_events(r, prefix, 0) == []
