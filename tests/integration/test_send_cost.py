"""What a send costs the lock store, per ``lock_mode``.

``while_running`` (the default) adds nothing at enqueue: no command reaches the Redis
the locks live in, and the uniqueness code (:mod:`celery_dlock.task.modes`) is not
even imported on the producer.  Every other mode costs one script call per send.

The lock store here is a redis-server of the test's own (``dlock_url``), apart from
the broker (the session's Redis), so its ``INFO commandstats`` counts only what the
locks did.  No worker runs: every message stays in its queue.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery_helpers import close_app, test_conf

from celery_dlock import LockedTask
from celery_dlock.ops.embedded import EmbeddedRedis

MODES = ("until_started", "until_finished", "queued_and_running", "throttle")
SENDS = 10


@pytest.fixture
def env(redis_url: str, own_server: EmbeddedRedis) -> Iterator[SimpleNamespace]:
    tag = uuid.uuid4().hex[:8]
    queue = f"q-cost-{tag}"
    app = Celery("cost_app", set_as_current=False)
    app.conf.update(test_conf(redis_url, queue=queue, prefix=f"dlcost{tag}",
                              result_backend=None, dlock_url=own_server.url))

    @app.task(base=LockedTask, bind=True, name="cost_app.job", lock_key="cost:{x}",
              shared=False)
    def job(self: Any, x: str) -> None:  # never runs
        return None

    store = redis.Redis.from_url(own_server.url)
    broker = redis.Redis.from_url(redis_url)
    try:
        yield SimpleNamespace(app=app, job=job, store=store)
    finally:
        broker.delete(queue)
        broker.close()
        store.close()
        close_app(app)


def commands(client: redis.Redis) -> dict[str, int]:
    """Calls per command so far (``INFO`` itself left out)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"])
            for name, value in stats.items()
            if name != "cmdstat_info" and isinstance(value, dict)}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: n - before.get(name, 0) for name, n in after.items()
            if n != before.get(name, 0)}


def test_a_default_mode_send_sends_nothing_to_the_lock_store(env):
    before = commands(env.store)
    connections = env.store.info("stats")["total_connections_received"]
    for _ in range(SENDS):
        env.job.delay(uuid.uuid4().hex)
        env.job.apply_async((uuid.uuid4().hex,), lock_mode="while_running")
    assert delta(before, commands(env.store)) == {}
    # Not even a connection (this test's own client connected before).
    assert env.store.info("stats")["total_connections_received"] == connections


@pytest.mark.parametrize("mode", MODES)
def test_every_other_mode_costs_one_script_call_per_send(env, mode):
    env.job.apply_async((uuid.uuid4().hex,), lock_mode=mode)  # loads the script
    before = commands(env.store)
    for _ in range(SENDS):
        env.job.apply_async((uuid.uuid4().hex,), lock_mode=mode)  # a fresh name each
    calls = delta(before, commands(env.store))
    assert calls.get("evalsha") == SENDS, calls
    assert "eval" not in calls and "script|load" not in calls, calls


_PRODUCER = textwrap.dedent("""
    import json, sys
    from celery import Celery
    from celery_dlock import LockedTask

    app = Celery("producer", broker=sys.argv[1], set_as_current=False)
    app.conf.update(task_default_queue=sys.argv[2], dlock_key_prefix=sys.argv[3])

    @app.task(base=LockedTask, bind=True, name="producer.job", lock_key="p:{x}",
              shared=False)
    def job(self, x):
        return None

    seen = {}
    job.delay("a")
    seen["while_running"] = sorted(m for m in sys.modules
                                   if m.startswith("celery_dlock.task.modes"))
    job.apply_async(("b",), lock_mode="until_started")
    seen["until_started"] = sorted(m for m in sys.modules
                                   if m.startswith("celery_dlock.task.modes"))
    print(json.dumps(seen))
""")


def test_the_uniqueness_code_is_imported_only_by_a_send_with_a_mode(redis_url):
    tag = uuid.uuid4().hex[:8]
    queue = f"q-import-{tag}"
    proc = subprocess.run([sys.executable, "-c", _PRODUCER, redis_url, queue,
                           f"dlimp{tag}"], capture_output=True, text=True,
                          timeout=60, check=False)
    r = redis.Redis.from_url(redis_url)
    try:
        assert proc.returncode == 0, proc.stderr
        seen = json.loads(proc.stdout)
        assert seen["while_running"] == []  # a fresh process, after a default send
        assert seen["until_started"] == ["celery_dlock.task.modes"]
        assert r.llen(queue) == 2
    finally:
        r.delete(queue, f"dlimp{tag}:{{p:b}}:m")
        r.close()
