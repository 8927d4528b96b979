"""Helpers for tests that run Celery apps against the session's Redis."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest


def close_app(app: Any) -> None:
    """Let go of an app's result consumer while its Redis is still up.

    AsyncResult objects unsubscribe when collected; collected after the session's
    server stopped, they would try to reconnect.  Collect them now, then close.

    The collection may also finalize a socket that an earlier test's client left open;
    its ResourceWarning is that test's, not this one's, so it is not raised here (as
    at any other moment the collector runs, where it is unraisable).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    backend = app.backend
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()
    app.close()


def _celery_version() -> tuple[int, ...]:
    import celery

    return tuple(int(p) for p in celery.__version__.split(".")[:2] if p.isdigit())


#: For tests whose in-process worker (``celery.contrib.testing``) must run an ETA
#: (countdown) message: before Celery 5.7 that worker never runs one once an earlier
#: test in the process used it.  Real workers do, on every pool, at the floors too:
#: tests/integration/test_contention_retry_workers.py.
needs_inprocess_eta = pytest.mark.skipif(
    _celery_version() < (5, 7),
    reason="celery.contrib.testing's in-process worker before Celery 5.7 never runs a "
           "countdown message after an earlier test; real workers are checked by "
           "test_contention_retry_workers.py")
