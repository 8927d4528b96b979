"""No password is printed, logged or stored (issue 11, item 11).

A ``dlock_url`` with the wrong scheme, or a non-Redis broker URL with credentials, used
to appear verbatim in the error: so in the worker log, in the FAILURE stored in the
result backend, and in ``celery dlock`` output.  Real in-process worker, real Redis
result backend, Celery's own click group for the CLI.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app, test_app
from click.testing import CliRunner
from dlock_helpers import closed_port

from celery_dlock import InvalidLockConfig, LockedTask
from celery_dlock.ops.cli import dlock
from celery_dlock.task.config import get_client

SECRET = "S3cretPW"
RESULT_TIMEOUT = 30


def test_stored_failure_and_worker_log_hold_no_password(redis_url, r, caplog, capfd):
    tag = uuid.uuid4().hex[:8]
    app = test_app(f"sec{tag}", redis_url, queue=f"q-sec{tag}", result_expires=600,
                   result_serializer="json", worker_hijack_root_logger=False)

    @app.task(base=LockedTask, shared=False, name=f"sec{tag}.t", lock_key="s:{x}")
    def t(x: str) -> str:
        return x

    caplog.set_level(logging.INFO)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        # Set after the worker started (its start-up check saw a good Redis): the task
        # is the first to read it.
        app.conf.dlock_url = f"http://user:{SECRET}@nope:8080/x"
        result = t.delay("1")
        with pytest.raises(InvalidLockConfig) as caught:
            result.get(timeout=RESULT_TIMEOUT)
        stored = r.get(f"celery-task-meta-{result.id}")
    close_app(app)
    assert stored is not None and b"FAILURE" in stored
    assert SECRET.encode() not in stored
    assert b"http://user:**@nope:8080/x" in stored
    assert SECRET not in str(caught.value)
    logged = caplog.text + "".join(str(rec.args) for rec in caplog.records)
    logged += "".join(capfd.readouterr())
    assert "InvalidLockConfig" in logged  # the failure was logged ...
    assert SECRET not in logged  # ... without the password


def _cli(app: Celery, *args: str) -> Any:
    obj = CLIContext(app=app, no_color=True, workdir=None)
    return CliRunner().invoke(dlock, list(args), obj=obj)


def test_cli_with_a_wrong_scheme_dlock_url(redis_url):
    app = Celery("sec", broker=redis_url, set_as_current=False)
    app.conf.dlock_url = f"http://:{SECRET}@host"
    out = _cli(app, "ls")
    assert out.exit_code == 2
    assert SECRET not in out.output
    assert "http://:**@host" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_non_redis_broker_credentials_are_masked(redis_url):
    app = Celery("sec", broker=f"amqp://guest:{SECRET}@rabbit:5672//",
                 backend=f"db+postgresql://scott:{SECRET}@pg/celery",
                 set_as_current=False)
    with pytest.raises(InvalidLockConfig) as caught:
        get_client(app)
    assert SECRET not in str(caught.value)
    assert "amqp://guest:**@rabbit:5672//" in str(caught.value)
    out = _cli(app, "ls")
    assert out.exit_code == 2 and SECRET not in out.output


def test_cli_url_that_cannot_be_parsed_is_one_masked_line():
    url = f"redis://:{SECRET}@127.0.0.1:notaport/0"
    out = _cli(Celery("sec", set_as_current=False), "--url", url, "ls")
    assert out.exit_code == 2, out.output
    assert SECRET not in out.output
    assert "Traceback" not in out.output
    assert len(out.stderr.strip().splitlines()) == 1


def test_unreachable_redis_with_password_is_masked():
    url = f"redis://user:{SECRET}@127.0.0.1:{closed_port()}/0"
    out = _cli(Celery("sec", set_as_current=False), "--url", url, "ls")
    assert out.exit_code == 2
    assert SECRET not in out.output and "redis://user:**@127.0.0.1:" in out.stderr


@pytest.mark.parametrize(("url", "shown"), [
    (f"redis://:{SECRET}@h:6379/0", "redis://:**@h:6379/0"),
    (f"redis://user:{SECRET}@h/0", "redis://user:**@h/0"),
    (f"redis://{SECRET}@h/0", "redis://**@h/0"),
    (f"rediss://u:{SECRET}@h:1/0?ssl_cert_reqs=none", "rediss://u:**@h:1/0?ssl_cert_reqs=none"),
    (f"redis://h:6379/0?password={SECRET}", "redis://h:6379/0?password=**"),
    (f"sentinel://:{SECRET}@a:26379;sentinel://:{SECRET}@b:26379",
     "sentinel://:**@a:26379;sentinel://:**@b:26379"),
    (f"amqp://guest:{SECRET}@localhost//", "amqp://guest:**@localhost//"),
    (f"redis://:{SECRET}@h:notaport/0", "redis://:**@h:notaport/0"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("unix:///tmp/r.sock?db=1", "unix:///tmp/r.sock?db=1"),
    ([f"amqp://u:{SECRET}@a//", f"amqp://u:{SECRET}@b//"],
     "['amqp://u:**@a//', 'amqp://u:**@b//']"),
    ({"password": SECRET}, "<a dict>"),
    (None, "None"),
])
def test_mask_url(url, shown):
    from celery_dlock.task.config import mask_url

    assert mask_url(url) == shown
