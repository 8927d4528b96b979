"""Helpers for tests that run Celery apps against the session's Redis."""

from __future__ import annotations

import gc
from typing import Any


def close_app(app: Any) -> None:
    """Let go of an app's result consumer while its Redis is still up.

    AsyncResult objects unsubscribe when collected; collected after the session's
    server stopped, they would try to reconnect.  Collect them now, then close.
    """
    gc.collect()
    backend = app.backend
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()
    app.close()
