"""The one door from the Celery face to a backend: :func:`backend_for`.

The backend is chosen from the app's configuration in this one place (one Redis, a
Cluster, Sentinel or a unix socket: a :class:`RedisBackend`; several servers, from a
list ``dlock_url``, ``redlock://a;redlock://b;...`` or a ``dlock_client`` returning a
list: a :class:`RedlockBackend`).  Everything else in ``task/`` and ``ops/`` speaks
:mod:`celery_dlock.core.protocol` only.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ..backends.redis.backend import RedisBackend
from ..backends.redis.redlock.backend import RedlockBackend, check_redlock_limit
from ..core.errors import InvalidLockConfig, NotSupported
from ..core.protocol import Backend
from .config import get_client
from .connection import redlock_urls
from .markers import MarkerStore
from .settings import conf_value

__all__ = ["backend_for", "backend_of_client", "check_limit_supported", "markers_for"]

_lock = threading.Lock()
_by_app: weakref.WeakKeyDictionary[Any, tuple[Any, Backend]] = weakref.WeakKeyDictionary()


def backend_of_client(client: Any) -> Backend:
    """The backend of a client the configuration gave: a tuple of clients is a
    Redlock, anything else one Redis."""
    if isinstance(client, tuple):
        return RedlockBackend(client)
    return RedisBackend(client)


def backend_for(app: Any) -> Backend:
    """This process's backend for ``app`` (made with its client, which is cached per
    app and process; the app's settings are checked when it is first made)."""
    client = get_client(app)
    try:
        cached = _by_app.get(app)
    except TypeError:  # an app that cannot be weakly referenced
        return backend_of_client(client)
    if cached is not None and cached[0] is client:
        return cached[1]  # the path every task run takes: no lock
    with _lock:
        try:
            cached = _by_app.get(app)
        except TypeError:  # an app that cannot be weakly referenced
            return backend_of_client(client)
        if cached is None or cached[0] is not client:
            cached = (client, backend_of_client(client))
            _by_app[app] = cached
        return cached[1]


def check_limit_supported(app: Any, limit: Any, where: str) -> None:
    """InvalidLockConfig when ``limit`` > 1 (a semaphore) and ``app``'s
    ``dlock_url`` is a Redlock (several servers), which keeps no semaphores.  (A
    ``dlock_client`` returning several clients is refused at the first lock.)"""
    if limit in (None, 1) or redlock_urls(conf_value(app, "dlock_url")) is None:
        return
    try:
        check_redlock_limit(limit)
    except InvalidLockConfig as exc:
        raise InvalidLockConfig(f"{where}: {exc}") from None


def markers_for(app: Any, backend: Backend | None = None) -> MarkerStore:
    """The queue markers of ``app``'s backend (enqueue-time uniqueness modes), or of
    ``backend`` when given (the Redis ``celery dlock --url`` reads).  Raises
    :class:`NotSupported` when that backend keeps none (a Redlock)."""
    if backend is None:
        backend = backend_for(app)
    markers = getattr(backend, "markers", None)
    if markers is None:
        raise NotSupported(
            f"lock_mode other than while_running needs queue markers, which the "
            f"{backend.kind} backend does not keep (use one Redis, a Cluster or "
            f"Sentinel for tasks with an enqueue-time lock_mode)")
    store: MarkerStore = markers()
    return store
