"""A Cluster URL (``redis+cluster://``) that no node answers: redis-py's cluster client
connects when it is made, and that failure is Redis being unreachable like any other
(``BackendUnavailable``, one masked line), handled by the task's policy, never a raw
cluster exception and never the body run unlocked."""

from __future__ import annotations

import time

import cli_app
import pytest
from celery import Celery
from celery_helpers import close_app
from servers import free_port
from task_env import new_app, running

from celery_dlock import BackendUnavailable, LockedTask, is_skipped
from celery_dlock.task.config import get_client

SECRET = "cl-s3cret"


@pytest.fixture
def dead_cluster_url() -> str:
    return f"redis+cluster://:{SECRET}@127.0.0.1:{free_port()}/0"


def test_making_the_client_is_backend_unavailable_with_the_url_masked(dead_cluster_url):
    app = Celery("dlcu", set_as_current=False)
    app.conf.dlock_url = dead_cluster_url
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as caught:
            get_client(app)
        assert time.monotonic() - started < 20
        text = str(caught.value)
        assert SECRET not in text and SECRET not in repr(caught.value)
        assert ":**@127.0.0.1" in text, text
    finally:
        close_app(app)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_the_task_policy_handles_it_and_the_body_never_runs(dead_cluster_url, redis_url,
                                                            policy):
    env = new_app(redis_url, dlock_url=dead_cluster_url, dlock_on_contention=policy)

    @env.app.task(base=LockedTask, shared=False, lock_key="cu:{x}")
    def work(x: str) -> str:
        env.log(ran=x)
        return "ran"

    with running(env, concurrency=1):
        result = work.delay("a")
        if policy == "skip":
            assert is_skipped(result.get(timeout=30))
        else:
            with pytest.raises(BackendUnavailable) as caught:
                result.get(timeout=30)
            assert SECRET not in str(caught.value)
        assert env.events(ran="a") == []


def test_fail_open_runs_the_body_without_the_lock(dead_cluster_url, redis_url):
    env = new_app(redis_url, dlock_url=dead_cluster_url, dlock_fail_open=True)

    @env.app.task(base=LockedTask, shared=False, lock_key="cu:{x}")
    def work(x: str) -> str:
        env.log(ran=x)
        return "ran"

    with running(env, concurrency=1):
        assert work.delay("b").get(timeout=30) == "ran"
        assert len(env.events(ran="b")) == 1


def test_the_cli_says_one_masked_line(dead_cluster_url):
    proc = cli_app.run_cli(dead_cluster_url, "dlcu", "ls", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert SECRET not in out
    assert "Traceback" not in out, out
    assert len(proc.stderr.strip().splitlines()) == 1, out
