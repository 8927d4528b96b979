"""How long ago a hold was renewed, as the server shows it (``HoldInfo.unrenewed_for``:
the longest ttl the hold was taken or extended with, less its time left), alike on
each store that shows it: Redis, PostgreSQL, MySQL/MariaDB.  ``clear_locks`` frees a
hold unrenewed past its holder's deadline (its ttl less a margin), which is so only
once the hold's time left is below that margin: also after a renewal shorter than
the lock's ttl (a ``max_hold`` bound's last renewals) or an ``extend`` that does not
move the expiry."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from marker_stores import backend_of, close_backend, store_url

from celery_dlock.core.lock_options import LockOptions

pytestmark = pytest.mark.slow


@pytest.fixture(params=("redis", "postgres", "mysql"))
def backend(request: pytest.FixtureRequest) -> Iterator[Any]:
    found = backend_of(request.param, store_url(request.param, request))
    try:
        yield found
    finally:
        close_backend(request.param, found)


def shown(backend: Any, prefix: str, name: str) -> tuple[float, float, float]:
    """``(unrenewed_for, lease, ttl left)`` of the hold, as the backend reads it."""
    hold = backend.read(prefix, name)
    assert hold is not None and hold.unrenewed_for is not None, hold
    return float(hold.unrenewed_for), float(hold.lease), float(hold.ttl)


def test_unrenewed_for_is_the_longest_ttl_less_the_time_left(backend: Any) -> None:
    prefix, name = f"t{uuid.uuid4().hex[:8]}", "n"
    lock = backend.lock(LockOptions(name, 3.0, prefix=prefix, auto_renew=False))
    assert lock.acquire(blocking=False)
    try:
        time.sleep(1.0)
        since, lease, _ = shown(backend, prefix, name)
        assert lease == 3.0 and 0.8 <= since <= 2.0
        lock.extend(3.0)  # renewed now
        assert shown(backend, prefix, name)[0] <= 0.5
        time.sleep(0.6)
        lock.extend(1.0)  # shorter, and the expiry does not move: nothing changes
        since, lease, _ = shown(backend, prefix, name)
        assert lease == 3.0 and 0.4 <= since <= 1.5
        time.sleep(1.6)
        # Shorter than the lock's ttl, moving the expiry (a max_hold bound's last
        # renewals): the longest ttl stays the lease, so the figure reaches the
        # holder's deadline exactly when the time left falls below its margin.
        lock.extend(1.5)
        since, lease, left = shown(backend, prefix, name)
        assert lease == 3.0 and 1.0 <= left <= 1.5
        assert since == pytest.approx(lease - left, abs=0.01)
    finally:
        lock.release()


def test_a_renewed_hold_shows_its_last_renewal(backend: Any) -> None:
    """The renewal scheduler (one statement for every hold due) renews every ttl/3."""
    prefix, name = f"t{uuid.uuid4().hex[:8]}", "n"
    lock = backend.lock(LockOptions(name, 1.5, prefix=prefix))
    assert lock.acquire(blocking=False)
    try:
        for _ in range(6):
            time.sleep(0.5)
            assert shown(backend, prefix, name)[0] < 1.2
    finally:
        lock.release()
