"""A call's lock lost between the acquire and the body (issue 31's modes chaos run):
the body never starts on it.  In a module of its own: its in-process worker must not
share the process with another module's."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from task_env import new_app, running

from celery_dlock import LockedTask, LockLost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RESULT_TIMEOUT = 60


def test_a_hold_lost_before_the_body_starts_never_runs_the_body(own_server, proxy):
    """Between the acquire and the body a call's lock can be lost while nobody is
    listening yet: here the rate call hangs (the proxy holds it) while an operator
    frees the lock and the renewal finds it gone.  The body must not start on it
    (before, it ran, while another owner could hold the lock); the attempt fails
    with ``LockLost`` and says so once."""
    e = new_app(own_server.url, dlock_url=proxy.url)
    ran: list[str] = []

    @e.app.task(base=LockedTask, shared=False, bind=True, name="early_loss",
                lock_key="early:{x}", lock_ttl=1, lock_rate="100/s")
    def early(self: Any, x: str) -> str:
        ran.append(x)
        return "ran"

    x = uuid.uuid4().hex[:8]
    held = proxy.hold_request(b"}:rate")  # the rate script's call, with the lock held
    with running(e):
        try:
            res = early.delay(x)
            assert held.arrived.wait(60), "the rate call never came"
            assert e.r.delete(e.lock_key(f"early:{x}")) == 1  # freed by force
            time.sleep(1.5)  # the renewal (every 1/3 s) finds the hold gone
        finally:
            held.let_go()
        with pytest.raises(LockLost, match="before the task's body started"):
            res.get(timeout=RESULT_TIMEOUT)
        # collected while this test's server is up (running() collects, then closes)
        del res
    assert ran == []
