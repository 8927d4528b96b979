"""``celery-dlock demo --redis-url`` leaves the user's Redis as it found it."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from dlock_helpers import child_pids, wait_until

from celery_dlock.ops import demo
from celery_dlock.ops.embedded import EmbeddedRedis

REPO = Path(__file__).resolve().parents[2]
DEMO = [sys.executable, "-m", "celery_dlock", "demo", "--workers", "1",
        "--concurrency", "2"]


def _snapshot(r: redis.Redis) -> dict[bytes, bytes | None]:
    return {key: r.dump(key) for key in r.scan_iter(count=1000)}


def _assert_unchanged(r: redis.Redis, before: dict[bytes, bytes | None]) -> None:
    """The keyspace is as ``before``; on failure, the keys that came or went."""
    after = _snapshot(r)
    assert after == before, sorted(set(after) ^ set(before))


def _seed(r: redis.Redis) -> None:
    """Keys of somebody else's, some of them near the demo's own names."""
    r.set("mine", "1")
    r.set("dlock-demo", "not the demo's")
    r.rpush("celery", "someone else's queue")
    r.hset("dlock:{stock:1}", mapping={"owner": "another app"})


@pytest.mark.slow
def test_a_full_run_removes_everything_it_created(own_server: EmbeddedRedis) -> None:
    r = redis.Redis.from_url(own_server.url)
    _seed(r)
    before = _snapshot(r)
    proc = subprocess.run([*DEMO, "--stock", "5", "--buyers", "20",
                           "--redis-url", own_server.url],
                          cwd=REPO, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exactly 5 units were sold" in proc.stdout
    _assert_unchanged(r, before)
    r.close()


@pytest.mark.slow
def test_ctrl_c_mid_run_stops_the_workers_and_removes_everything(
        own_server: EmbeddedRedis) -> None:
    r = redis.Redis.from_url(own_server.url)
    _seed(r)
    before = _snapshot(r)
    proc = subprocess.Popen([*DEMO, "--stock", "2000", "--buyers", "20000",
                             "--redis-url", own_server.url],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        # Selling has begun: the plain phase's counter is there and moving.
        assert wait_until(lambda: any(r.scan_iter(match="dlock-demo-*:plain:done")),
                          timeout=90, interval=0.1)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr, stderr
    assert "interrupted" in stderr
    _assert_unchanged(r, before)
    r.close()


def _pool_processes(queue: str) -> list[int]:
    """The prefork processes of the worker this test started on ``queue``."""
    workers = [pid for pid in child_pids(os.getpid())
               if queue.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 1, workers
    assert wait_until(lambda: len(child_pids(workers[0])) >= 2, timeout=30,
                      interval=0.05)
    return child_pids(workers[0])


@pytest.mark.slow
def test_workers_killed_before_their_warm_shutdown_leave_nothing_behind(
        own_server: EmbeddedRedis) -> None:
    """A worker that does not stop in time is killed with messages it had taken but
    not acknowledged: kombu's unacked record keeps them, and the cleanup removes the
    demo's entries there too."""
    r = redis.Redis.from_url(own_server.url)
    _seed(r)
    before = _snapshot(r)
    tag = uuid.uuid4().hex[:8]
    prefix = queue = f"dlock-demo-{tag}"
    app = demo._client_app(own_server.url, queue)
    task_ids = [uuid.uuid4().hex for _ in range(2000)]
    try:
        with demo._workers(own_server.url, prefix, queue, 1, 2, io.StringIO(),
                           grace=0) as names:
            demo._wait_ready(app, names, timeout=60)
            # Its pool processes hang: the worker takes messages and cannot finish them
            # (nor acknowledge them: a message is acknowledged when a process takes it
            # up), so it does not stop in time. Unstopped, it could drain all 2000
            # before the way out, and leave nothing to clean up.
            for child in _pool_processes(queue):
                os.kill(child, signal.SIGSTOP)
            for task_id in task_ids:
                app.send_task("demo.buy_plain", args=(1,), task_id=task_id)
            # the worker has messages reserved that it has not acknowledged
            assert wait_until(lambda: r.hlen("unacked") > 0, timeout=60, interval=0.02)
        assert r.hlen("unacked") > 0  # killed: nothing put them back
        demo._cleanup(r, prefix, queue, task_ids, set())
    finally:
        app.close()
    _assert_unchanged(r, before)
    r.close()
