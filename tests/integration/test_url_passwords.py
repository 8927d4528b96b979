"""Passwords with URL delimiters on real servers: a percent-encoded password works (the
default user and an ACL user), and no output of the package shows any part of it: the
error of a failed connection, a fail-open log line, a FAILURE stored in the result
backend, ``celery dlock`` and ``celery-dlock demo`` (subprocesses, as run by hand).
Worker start-up errors are in test_worker_config.py."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cli_app
import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app, test_app
from dlock_helpers import closed_port
from url_passwords import PASSWORDS, RAW_WORKS, assert_hidden, encoded

from celery_dlock import BackendUnavailable, InvalidLockConfig, LockedTask, RedisLock
from celery_dlock.ops.embedded import EmbeddedRedis
from celery_dlock.task.config import get_client

ACL_USER = "dlock-pw"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=PASSWORDS)
def guarded(request: pytest.FixtureRequest) -> Iterator[tuple[EmbeddedRedis, str]]:
    """A server whose default user and ACL user ``dlock-pw`` have the password."""
    password: str = request.param
    with EmbeddedRedis(password=password) as server:
        admin = redis.Redis.from_url(server.url)
        try:
            admin.execute_command("ACL", "SETUSER", ACL_USER, "reset", "on",
                                  f">{password}", "~*", "&*", "+@all")
        except redis.ResponseError as exc:  # Redis < 6
            pytest.skip(f"this redis-server has no ACL: {exc}")
        finally:
            admin.close()
        yield server, password


@pytest.fixture(scope="module")
def other_password_server() -> Iterator[EmbeddedRedis]:
    """A server that requires another password: every URL below is wrong for it."""
    with EmbeddedRedis(password="the-right-one") as server:
        yield server


def _conf_app(**conf: Any) -> Celery:
    app = Celery(f"urlpw{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(**conf)
    return app


@pytest.mark.parametrize("user", ["", ACL_USER])
def test_the_lock_works_with_the_percent_encoded_password(guarded, user):
    server, password = guarded
    forms = [encoded(password)] + ([password] if password == RAW_WORKS else [])
    for written in forms:
        app = _conf_app(dlock_url=f"redis://{user}:{written}@127.0.0.1:{server.port}/0")
        lock = RedisLock(get_client(app), f"pw:{uuid.uuid4().hex[:8]}", ttl=10)
        assert lock.acquire(blocking=False)
        assert lock.owned() and lock.fence > 0
        lock.release()
        assert not lock.locked()
        whoami = get_client(app).execute_command("ACL", "WHOAMI")
        assert whoami.decode() == (user or "default")
        close_app(app)


def _wrong_urls(password: str, server: EmbeddedRedis) -> dict[str, str]:
    pw = encoded(password)
    return {"wrong": f"redis://:{pw}@127.0.0.1:{server.port}/0",
            "wrong-user": f"redis://{ACL_USER}:{pw}@127.0.0.1:{server.port}/0",
            "unreachable": f"redis://:{pw}@127.0.0.1:{closed_port()}/0"}


@pytest.mark.parametrize("password", PASSWORDS)
def test_a_failed_connection_and_its_log_line_show_no_password(
        password, other_password_server, caplog):
    caplog.set_level(logging.WARNING)
    for what, url in _wrong_urls(password, other_password_server).items():
        app = _conf_app(dlock_url=url, dlock_fail_open=False,
                        dlock_redis_options={"socket_connect_timeout": 1})
        with pytest.raises(BackendUnavailable) as caught:
            RedisLock(get_client(app), "pw:x", ttl=5).acquire(blocking=False)
        assert_hidden(str(caught.value) + repr(caught.value), password)
        assert "\n" not in str(caught.value), what

        @app.task(base=LockedTask, shared=False, name="urlpw.t", lock_key="pw:{x}",
                  lock_fail_open=True)
        def t(x: str) -> str:
            return x

        assert t.apply(args=("1",)).get() == "1"  # ran unlocked, with a warning
        close_app(app)
    warnings = [r for r in caplog.records if "WITHOUT its lock" in r.getMessage()]
    assert len(warnings) == 3
    assert_hidden(caplog.text + "".join(r.getMessage() for r in caplog.records),
                  password)


@pytest.mark.parametrize("password", PASSWORDS)
def test_a_stored_failure_and_the_worker_log_show_no_password(
        password, redis_url, r, other_password_server, caplog, capfd):
    tag = uuid.uuid4().hex[:8]
    url = _wrong_urls(password, other_password_server)["wrong"]
    app = test_app(f"pw{tag}", redis_url, queue=f"q-pw{tag}", result_expires=600,
                   result_serializer="json", worker_hijack_root_logger=False)

    @app.task(base=LockedTask, shared=False, name=f"pw{tag}.t", lock_key="s:{x}",
              on_contention="raise")
    def t(x: str) -> str:
        return x

    caplog.set_level(logging.INFO)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        app.conf.dlock_url = url  # after the start-up check: the task reads it first
        result = t.delay("1")
        with pytest.raises(BackendUnavailable) as caught:
            result.get(timeout=30)
        stored = r.get(f"celery-task-meta-{result.id}")
    close_app(app)
    assert stored is not None and b"FAILURE" in stored
    assert_hidden(stored.decode(), password)
    assert_hidden(str(caught.value), password)
    logged = caplog.text + "".join(str(rec.args) for rec in caplog.records)
    logged += "".join(capfd.readouterr())
    assert "BackendUnavailable" in logged
    assert_hidden(logged, password)


def _one_line(proc: subprocess.CompletedProcess[str], password: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    assert len(proc.stderr.strip().splitlines()) == 1, out
    assert_hidden(out, password)
    return proc.stderr


@pytest.mark.parametrize("password", PASSWORDS)
def test_celery_dlock_ls_shows_no_password(password, other_password_server, redis_url):
    for what, url in _wrong_urls(password, other_password_server).items():
        line = _one_line(cli_app.run_cli(url, "dlpw", "ls"), password)
        assert f"redis://{ACL_USER + ':' if 'user' in what else ':'}**@127.0.0.1:" \
            in line, line
    raw = f"redis://:{password}@127.0.0.1:{other_password_server.port}/0"
    runs = [cli_app.run_cli(redis_url, "dlpw", "--url", raw, "ls")]
    if password != RAW_WORKS:  # ambiguous: refused before anything connects
        runs.append(cli_app.run_cli(raw, "dlpw", "ls"))
    for proc in runs:
        line = _one_line(proc, password)
        if password != RAW_WORKS:
            assert "one way only" in line and "%23" in line, line


@pytest.mark.parametrize("password", PASSWORDS)
def test_the_demo_shows_no_password(password, other_password_server):
    urls = [_wrong_urls(password, other_password_server)["wrong"],
            f"redis://:{password}@127.0.0.1:{other_password_server.port}/0"]
    for url in urls:
        proc = subprocess.run([sys.executable, "-m", "celery_dlock", "demo",
                               "--redis-url", url], cwd=REPO, capture_output=True,
                              text=True, timeout=60, check=False)
        line = _one_line(proc, password)
        assert "Starting" not in proc.stdout
        assert line.startswith("celery-dlock demo: "), line


def test_an_ambiguous_url_given_to_redis_lock_users_is_refused_in_one_line():
    app = _conf_app(dlock_url="redis://:p;a#s?s/w@o:r%d@127.0.0.1:1/0")
    with pytest.raises(InvalidLockConfig) as caught:
        get_client(app)
    assert str(caught.value).startswith("app.conf.dlock_url cannot be read one way")
    assert_hidden(str(caught.value), "p;a#s?s/w@o:r%d")
