"""Enqueue-time uniqueness (``lock_mode``, ``on_duplicate``) with the locks and the
queue markers on ZooKeeper: real prefork workers whose ``dlock_url`` is the suite's
ZooKeeper (the broker, the results and the tasks' records stay on Redis), as
tests/integration/test_rate.py runs its workers on each store.  Duplicates sent
while a call is queued and while it runs: one body runs per accepted call, and each
duplicate policy answers as on Redis; the compat shims (``QueueOnce``, ``Singleton``)
likewise."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from worker_harness import Harness, open_harness, wait_for

pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper extra)")

from celery_dlock import AlreadyQueued, DroppedResult
from celery_dlock.backends.zookeeper import backend_from_url
from celery_dlock.backends.zookeeper.markers import ZkMarkers
from celery_dlock.task.backend import markers_for

pytestmark = pytest.mark.slow


@pytest.fixture
def zk_harness(zk_server: Any, redis_url: str, r: redis.Redis, prefix: str,
               tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
               request: pytest.FixtureRequest) -> Iterator[Harness]:
    """A harness whose locks and markers are on ZooKeeper (the producer in this
    process and the workers alike)."""
    from prefork_app import ENV_CONF

    monkeypatch.setenv(ENV_CONF, json.dumps({"dlock_url": str(zk_server.url)}))
    for h in open_harness(redis_url, r, prefix, tmp_path, request):
        assert isinstance(markers_for(h.app), ZkMarkers)
        yield h


def send(h: Harness, key: str, tag: str, seconds: float = 0.0, **options: Any) -> Any:
    return h.app.tasks["pf.mode"].apply_async((key, seconds, tag), **options)


def lock_name(h: Harness, key: str) -> str:
    name: str = h.app.tasks["pf.mode"].lock_name((key, 0.0, ""), {})
    return name


def marker(h: Harness, key: str) -> str | None:
    found = markers_for(h.app).read(h.prefix, lock_name(h, key))
    return None if found is None else found[0]


def tags(h: Harness, key: str) -> list[str]:
    return [run["tag"] for run in h.records("mode", key)]


@pytest.mark.timeout(150)
def test_until_finished_on_zookeeper_runs_one_body_per_accepted_call(
        zk_harness: Harness, zk_server: Any) -> None:
    h = zk_harness
    a = send(h, "uf", "a", 1.5)
    assert marker(h, "uf") == a.id
    assert send(h, "uf", "b").id == a.id  # queued: a duplicate
    h.start_workers(count=1, concurrency=2)
    wait_for(lambda: h.records("mode-start", "uf"), 30, what="a to start")
    backend = backend_from_url(str(zk_server.url))
    hold = backend.read(h.prefix, lock_name(h, "uf"))  # the worker's, on ZooKeeper
    assert hold is not None and hold.task_id == a.id
    assert marker(h, "uf") is None  # handed over to the lock
    assert send(h, "uf", "c").id == a.id  # running: a duplicate
    with pytest.raises(AlreadyQueued) as raised:
        send(h, "uf", "d", on_duplicate="raise")
    assert raised.value.task_id == a.id
    assert a.get(timeout=30) == "a"
    wait_for(lambda: backend.read(h.prefix, lock_name(h, "uf")) is None, 10,
             what="the release")
    e = send(h, "uf", "e")
    assert e.id != a.id and e.get(timeout=30) == "e"
    assert tags(h, "uf") == ["a", "e"]


@pytest.mark.timeout(150)
def test_until_started_on_zookeeper_answers_each_policy_and_frees_at_the_start(
        zk_harness: Harness) -> None:
    h = zk_harness
    opts = {"lock_mode": "until_started"}
    a = send(h, "us", "a", 1.5, **opts)
    assert send(h, "us", "b", **opts, on_duplicate="return_existing").id == a.id
    with pytest.raises(AlreadyQueued):
        send(h, "us", "b", **opts, on_duplicate="raise")
    dropped = send(h, "us", "b", **opts, on_duplicate="drop")
    assert isinstance(dropped, DroppedResult) and dropped.duplicate_of == a.id
    old = send(h, "rp", "old", **opts)
    new = send(h, "rp", "new", **opts, on_duplicate="replace")
    assert new.id != old.id and marker(h, "rp") == new.id
    h.start_workers(count=1, concurrency=2)
    wait_for(lambda: h.records("mode-start", "us"), 30, what="a to start")
    c = send(h, "us", "c", **opts)  # a started: the name is free to queue again
    assert c.id != a.id
    assert a.get(timeout=30) == "a" and c.get(timeout=30) == "c"
    assert new.get(timeout=30) == "new"
    assert tags(h, "us") == ["a", "c"]  # c waited for a's lock
    assert tags(h, "rp") == ["new"]  # the replaced call never ran


@pytest.mark.timeout(150)
def test_the_compat_shims_on_zookeeper(zk_harness: Harness) -> None:
    """celery-once's ``QueueOnce`` and celery-singleton's ``Singleton`` with a
    ZooKeeper ``dlock_url``: a second ``delay`` raises ``AlreadyQueued`` (once) or is
    the first's result (singleton), queued and running; each body runs once."""
    from celery_dlock.compat import AlreadyQueued as OnceQueued

    h = zk_harness
    slow_task, do_stuff = h.app.tasks["pf.slow_task"], h.app.tasks["pf.do_stuff"]
    first = slow_task.delay(1.5)
    with pytest.raises(OnceQueued) as raised:
        slow_task.delay(1.5)
    assert raised.value.task_id == first.id
    single = do_stuff.delay(1, a="b", seconds=1.5)
    assert do_stuff.delay(1, a="b", seconds=1.5) == single
    h.start_workers(count=1, concurrency=2)
    wait_for(lambda: h.records("compat-start", "pf.slow_task")
             and h.records("compat-start", "pf.do_stuff"), 30, what="both to start")
    with pytest.raises(OnceQueued):
        slow_task.delay(1.5)  # running
    assert do_stuff.delay(1, a="b", seconds=1.5) == single  # running
    assert first.get(timeout=30) == "Done!"
    assert single.get(timeout=30) == "I just woke up"
    assert len(h.records("compat", "pf.slow_task")) == 1
    assert len(h.records("compat", "pf.do_stuff")) == 1
