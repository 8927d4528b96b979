"""LockedTask on Redlock: ``dlock_url`` as a list of URLs, or ``redlock://`` URLs
separated by ``;``; three redis-servers of the test's own hold the locks, the
session's Redis is the broker."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import time
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from celery_helpers import close_app
from click.testing import CliRunner
from dlock_helpers import wait_until
from task_env import new_app, running
from test_docs import snippets

from celery_dlock import InvalidLockConfig, LockedTask, RedlockLock, signals
from celery_dlock.ops.cli import dlock
from celery_dlock.task.config import check_conf, get_client
from celery_dlock.task.hooks import _dead_child_release


def test_a_list_dlock_url_runs_tasks_one_at_a_time(redis_url, trio):
    env = new_app(redis_url, dlock_url=trio.urls(), dlock_ttl=2.0,
                  dlock_on_contention="wait", dlock_wait=20.0)
    fences: list[Any] = []

    def on_acquired(sender: Any = None, fence: Any = None, **_: Any) -> None:
        fences.append(fence)

    signals.lock_acquired.connect(on_acquired, weak=False)

    @env.app.task(base=LockedTask, bind=True, lock_key="stock:{product_id}")
    def work(self: Any, product_id: int, n: int) -> str:
        env.log(kind="start", n=n, t=time.time())
        held = trio.holders(f"{env.prefix}:{{stock:{product_id}}}")
        time.sleep(0.3)
        env.log(kind="end", n=n, t=time.time())
        return f"{type(self.lock).__name__}:{held.count(self.lock._hold_owner)}"

    try:
        with running(env, concurrency=2):
            results = [work.delay(42, n) for n in range(3)]
            # a quorum at least (the third node may answer just after the grant)
            assert sorted(r.get(timeout=60) for r in results)[0] >= "RedlockLock:2"
            assert all(r.get(timeout=1).startswith("RedlockLock:") for r in results)
            spans = sorted((e["t"], e["n"]) for e in env.events(kind="start"))
            ends = {e["n"]: e["t"] for e in env.events(kind="end")}
            for (_, n), (next_start, _) in itertools.pairwise(spans):
                assert ends[n] <= next_start  # no overlap between runs
    finally:
        signals.lock_acquired.disconnect(on_acquired)
    assert fences == [None, None, None]  # no fencing token under Redlock
    key = f"{env.prefix}:{{stock:42}}"
    assert wait_until(lambda: trio.holders(key) == [None] * 3)  # last node follows


def test_a_redlock_url_string_and_its_checks(redis_url, trio):
    spelled = ";".join(f"redlock://127.0.0.1:{s.port}/0" for s in trio.servers)
    app = Celery("rl", broker=redis_url, set_as_current=False)
    app.conf.dlock_url = spelled
    app.conf.dlock_key_prefix = "rls"
    check_conf(app.conf)
    clients = get_client(app)
    assert isinstance(clients, tuple) and len(clients) == 3

    @app.task(base=LockedTask, bind=True, lock_key="k:{x}")
    def held(self: Any, x: int) -> list[str | None]:
        return trio.holders(self.lock.keys.lock)

    owners = held.apply(args=(1,)).get()
    assert owners[0] is not None and owners.count(owners[0]) >= 2
    assert wait_until(lambda: trio.holders("rls:{k:1}") == [None] * 3)
    close_app(app)


def test_redlock_dlock_url_mistakes_are_one_line_without_passwords(redis_url, trio):
    ports = [s.port for s in trio.servers]
    bad = {
        "two": [f"redis://127.0.0.1:{p}/0" for p in ports[:2]],
        "mixed": f"redlock://:hunter2@127.0.0.1:{ports[0]}/0;"
                 f"redis://:hunter2@127.0.0.1:{ports[1]}/0;"
                 f"redlock://127.0.0.1:{ports[2]}/0",
        "cluster": [*(f"redis://127.0.0.1:{p}/0" for p in ports[:2]),
                    f"redis+cluster://:hunter2@127.0.0.1:{ports[2]}"],
    }
    for what, url in bad.items():
        app = Celery("rl", broker=redis_url, set_as_current=False)
        app.conf.dlock_url = url
        with pytest.raises(InvalidLockConfig) as caught:
            check_conf(app.conf)
        message = str(caught.value)
        assert "dlock_url" in message, what
        assert "hunter2" not in message and "\n" not in message, what
        close_app(app)


def test_the_cli_refuses_a_redlock_app_with_one_line(redis_url, trio):
    app = Celery("rl", broker=redis_url, set_as_current=False)
    app.conf.dlock_url = trio.urls()
    obj = CLIContext(app=app, no_color=True, workdir=None)
    out = CliRunner().invoke(dlock, ["ls"], obj=obj)
    assert out.exit_code == 2
    assert "Redlock" in out.stderr and "--url" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    close_app(app)


def test_the_cli_on_one_server_of_a_redlock_app_shows_no_markers(redis_url, trio):
    """With --url (one of its servers) the CLI works on a Redlock app, with no queue
    marker information: a Redlock keeps none (its sends refuse a lock_mode), so a key
    where a marker would be is not read as one."""
    app = Celery("rl", broker=redis_url, set_as_current=False)
    app.conf.dlock_url = trio.urls()
    url = trio.urls()[0]
    r = redis.Redis.from_url(url)
    r.set("dlock:{stock:9}:m", "not-a-queued-call", ex=60)
    clients = [redis.Redis.from_url(u) for u in trio.urls()]
    lock = RedlockLock(clients, "stock:9", ttl=30, auto_renew=False)
    assert lock.acquire(blocking=False)
    obj = CLIContext(app=app, no_color=True, workdir=None)
    try:
        out = CliRunner().invoke(dlock, ["--url", url, "ls"], obj=obj)
        assert out.exit_code == 0, out.output
        assert "QUEUED" not in out.stdout and "stock:9" in out.stdout
        out = CliRunner().invoke(dlock, ["--url", url, "ls", "--json"], obj=obj)
        (row,) = [row for row in json.loads(out.stdout) if row["key"] == "stock:9"]
        assert row["queued_task_id"] is None
        out = CliRunner().invoke(dlock, ["--url", url, "show", "stock:9"], obj=obj)
        assert out.exit_code == 0, out.output
        assert "queued" not in out.stdout and "not-a-queued-call" not in out.stdout
        out = CliRunner().invoke(dlock, ["--url", url, "top", "--iterations", "1"],
                                 obj=obj)
        assert out.exit_code == 0, out.output
        assert "queued" not in out.stdout.lower() and "1 held" in out.stdout
    finally:
        lock.release()
        r.delete("dlock:{stock:9}:m")
        for client in [r, *clients]:
            client.close()
        close_app(app)


def test_the_docs_snippet_runs(trio):
    code = snippets()["redlock"]
    for letter, server in zip("abc", trio.servers, strict=True):
        old = f"redis-{letter}.internal:6379"
        assert old in code
        code = code.replace(old, f"127.0.0.1:{server.port}")
    out = io.StringIO()
    namespace: dict[str, Any] = {"__name__": "doc_snippet_redlock"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "deployments.md:redlock", "exec"), namespace)
    namespace["app"].close()
    assert out.getvalue().strip().splitlines()[-1] == "True"
    assert wait_until(lambda: trio.holders("dlock:{stock:42}") == [None] * 3)


def test_a_dead_childs_hold_is_freed_on_every_node(redis_url, trio):
    """What the worker's main process does when a child dies holding a lock."""
    app = Celery("rl", broker=redis_url, set_as_current=False)
    app.conf.dlock_url = trio.urls()
    app.conf.dlock_key_prefix = "rld"

    @app.task(base=LockedTask, bind=True, lock_key="k:{x}")
    def job(self: Any, x: int) -> None:
        return None

    hold = RedlockLock(list(get_client(app)), "k:7", prefix="rld", auto_renew=False,
                       owner="dead-child", info={"task_id": "T-1"})
    assert hold.acquire(blocking=False)
    assert wait_until(lambda: trio.holders("rld:{k:7}") == ["dead-child"] * 3)
    _dead_child_release(job, "T-2", os.getpid(), None, (7,), {})()  # another task id
    assert trio.holders("rld:{k:7}") == ["dead-child"] * 3
    _dead_child_release(job, "T-1", os.getpid(), None, (7,), {})()
    assert trio.holders("rld:{k:7}") == [None] * 3
    close_app(app)
