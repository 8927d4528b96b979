"""Helpers for tests that run Celery apps against the session's Redis."""

from __future__ import annotations

import gc
import warnings
from typing import Any


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
