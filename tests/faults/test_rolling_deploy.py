"""A rolling deploy: workers of the previous version and of this one share a Redis.

The previous version's ``ACQUIRE`` and ``RELEASE`` scripts, as they were before the
release stopped reading the fence counter and the line of waiters unflagged, are kept
in ``tests/data/previous_release/`` (their Lua as sent to the server).  Holds written
by either are read by the other: each version's holder excludes the other's, fences
never repeat across them, the operators' view reads either, and a line of waiters
mixing both is served in order (a waiter of the previous version is not rung by a
release of this one, which it does not flag: it takes the lock at its next try, in
its turn).  docs/protocol.md, CHANGELOG ("Changed").
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_dlock.backends.redis.backend import RedisBackend
from celery_dlock.backends.redis.keyspace import (
    DOORBELL_SUFFIX,
    LINE_FIELD,
    QUEUE_SUFFIX,
    LockKeys,
)
from celery_dlock.backends.redis.scripts import ACQUIRE, RELEASE, LuaScript
from celery_dlock.core.protocol import new_op_id

PREVIOUS = Path(__file__).resolve().parent.parent / "data" / "previous_release"
OLD_ACQUIRE = LuaScript("acquire_previous", (PREVIOUS / "acquire.lua").read_text())
OLD_RELEASE = LuaScript("release_previous", (PREVIOUS / "release.lua").read_text())
VERSIONS = {"previous": (OLD_ACQUIRE, OLD_RELEASE), "this": (ACQUIRE, RELEASE)}
DAY_MS = 86_400_000


def _acquire(r: redis.Redis, key: str, version: str, owner: str, *,
             lease_ms: int = 0) -> list[Any]:
    script = VERSIONS[version][0]
    return list(script(r, (key,), (owner, 30_000, lease_ms, new_op_id(), "", DAY_MS,
                                   "task_id", f"t-{owner}")))


def _release(r: redis.Redis, key: str, version: str, owner: str, fence: int) -> int:
    script = VERSIONS[version][1]
    return int(script(r, (key,), (owner, new_op_id(), str(fence), "", DAY_MS))[0])


@pytest.fixture
def key(prefix: str, name: str) -> str:
    return LockKeys.for_name(prefix, name).lock


def test_the_previous_scripts_are_not_this_versions() -> None:
    """Otherwise the tests below would compare a version with itself."""
    assert OLD_ACQUIRE.sha != ACQUIRE.sha and OLD_RELEASE.sha != RELEASE.sha
    assert "LINE_FIELD" in RELEASE.source and "LINE_FIELD" not in OLD_RELEASE.source


@pytest.mark.parametrize("first", sorted(VERSIONS))
def test_a_holder_of_either_version_excludes_the_other(r: redis.Redis, key: str,
                                                       first: str) -> None:
    second = "this" if first == "previous" else "previous"
    got = _acquire(r, key, first, "A")
    assert int(got[0]) == 1
    fence = int(got[1])
    refused = _acquire(r, key, second, "B")
    assert int(refused[0]) == 0 and int(refused[1]) > 0  # held: its ttl left
    assert _release(r, key, first, "A", fence) == 1
    again = _acquire(r, key, second, "B")
    assert int(again[0]) == 1 and int(again[1]) > fence
    assert _release(r, key, second, "B", int(again[1])) == 1
    assert not r.exists(key)


def test_fences_never_repeat_across_versions(r: redis.Redis, key: str) -> None:
    rng = random.Random(7)
    fences: list[int] = []
    for i in range(40):
        version = rng.choice(sorted(VERSIONS))
        got = _acquire(r, key, version, f"o{i}")
        assert int(got[0]) == 1, (i, version)
        fences.append(int(got[1]))
        other = "this" if version == "previous" else "previous"
        assert int(_acquire(r, key, other, f"x{i}")[0]) == 0  # excluded meanwhile
        if rng.random() < 0.8:
            assert _release(r, key, version, f"o{i}", fences[-1]) == 1
        else:  # the holder died: its hold expires
            r.delete(key)
    assert fences == sorted(set(fences)), fences


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_the_operators_view_reads_a_hold_of_either_version(r: redis.Redis, prefix: str,
                                                          name: str, key: str,
                                                          version: str) -> None:
    got = _acquire(r, key, version, "A")
    info = RedisBackend(r).read(prefix, name)
    assert info is not None and info.owner == "A" and info.fence == int(got[1])
    assert info.task_id == "t-A"
    assert _release(r, key, version, "A", int(got[1])) == 1
    assert RedisBackend(r).read(prefix, name) is None


def test_a_previous_versions_waiter_behind_this_versions_holder_keeps_its_turn(
        r: redis.Redis, key: str) -> None:
    """It writes no ``line`` flag, so this version's release does not ring it; a
    newcomer cannot take the lock past it; its next try takes it."""
    held = _acquire(r, key, "this", "H")
    assert int(_acquire(r, key, "previous", "W", lease_ms=30_000)[0]) == 0  # in line
    assert r.hget(key, LINE_FIELD) is None
    assert _release(r, key, "this", "H", int(held[1])) == 1
    assert r.zrange(key + QUEUE_SUFFIX, 0, -1) == [b"W"]  # still first in line
    assert int(_acquire(r, key, "this", "N")[0]) == 0  # no barging past it
    mine = _acquire(r, key, "previous", "W", lease_ms=30_000)
    assert int(mine[0]) == 1 and int(mine[1]) > int(held[1])
    assert _release(r, key, "previous", "W", int(mine[1])) == 1


def test_this_versions_waiter_behind_a_previous_holder_is_rung(r: redis.Redis,
                                                               key: str) -> None:
    held = _acquire(r, key, "previous", "H")
    assert int(_acquire(r, key, "this", "W", lease_ms=30_000)[0]) == 0
    assert r.hget(key, LINE_FIELD) == b"1"  # the flag on the previous version's hold
    assert _release(r, key, "previous", "H", int(held[1])) == 1
    bells = list(r.scan_iter(match=key + DOORBELL_SUFFIX + "*"))
    assert len(bells) == 1 and r.llen(bells[0]) == 1  # its doorbell rang
    mine = _acquire(r, key, "this", "W", lease_ms=30_000)
    assert int(mine[0]) == 1
    assert _release(r, key, "this", "W", int(mine[1])) == 1
