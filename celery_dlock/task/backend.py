"""The one door from the Celery face to a backend: :func:`backend_for`.

The backend is chosen from the app's configuration in this one place, through the
backend registry (:mod:`celery_dlock.core.registry`), which imports a backend's module
by name when its first backend is made: one Redis, a Cluster, Sentinel or a unix
socket; several servers (a list ``dlock_url``, ``redlock://a;redlock://b;...`` or a
``dlock_client`` returning a list): Redlock; ``postgresql://``, ``mysql://`` or
``mariadb://``, ``zookeeper://``: those backends, whose drivers are imported only
then.  What a backend can do is asked of its capabilities, never of its URL.
Everything else in ``task/`` and ``ops/`` speaks :mod:`celery_dlock.core.protocol`
only.

:func:`lock_from_url` is the same door for code without a Celery app.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.errors import InvalidLockConfig, NotSupported
from ..core.lock_args import DEFAULT_PREFIX
from ..core.lock_options import LockOptions
from ..core.protocol import Backend, Lock
from ..core.registry import LIMIT, MARKERS, Entry, entry_named, redis_driver
from . import app_cache, connection
from .config import check_conf, get_client
from .markers import MarkerStore
from .schemes import check_known, url_backend
from .settings import conf_of

__all__ = ["backend_for", "backend_from_url", "backend_of_client",
           "check_limit_supported", "check_markers_supported", "forget_app",
           "lock_from_url", "markers_for"]

def backend_of_client(client: Any) -> Backend:
    """The backend of a client the configuration gave: a tuple of clients is a
    Redlock, anything else one Redis."""
    backend: Backend = redis_driver().backend_of_client(client)
    return backend


def _url_backend(entry: Entry, url: str) -> Backend:
    """The backend ``entry`` makes from ``url`` alone (its driver imported now)."""
    connection.check_unambiguous(url, "the lock URL")
    backend: Backend = entry.driver().backend_from_url(url)
    return backend


def backend_from_url(url: Any) -> Backend:
    """This process's backend for a lock URL: ``redis://``, ``rediss://``,
    ``unix://``, ``redis+cluster://``, ``sentinel://``, a Redlock list (3 or more
    ``redlock://`` URLs separated by ``;``, or a list of Redis URLs), ``postgresql://``,
    ``postgres://``, ``mysql://``, ``mariadb://`` or ``zookeeper://``.
    :class:`InvalidLockConfig` for any other, naming the known schemes (the URL
    masked)."""
    key = ";".join(url) if isinstance(url, (list, tuple)) else url
    if not isinstance(key, str):
        check_known(url, "lock URL")
    backend: Backend = app_cache.by_url(key, lambda: _make_from_url(url))
    return backend


def _make_from_url(url: Any) -> Backend:
    entry = url_backend(url)
    if entry is not None:
        return _url_backend(entry, url)
    redlock = redis_driver().redlock_urls(url)
    if redlock is not None:
        options = connection.client_options({})
        return backend_of_client(tuple(
            redis_driver().client_from_url(u, options) for u in redlock))
    one = redis_driver().redis_url_of(url)
    if one is None:
        check_known(url, "lock URL")
    connection.check_unambiguous(one, "the lock URL")
    return backend_of_client(connection.client_for_url(one, where="the lock URL"))


def lock_from_url(url: Any, name: str, ttl: float = 30.0, *,
                  prefix: str = DEFAULT_PREFIX, info: Mapping[str, object] | None = None,
                  owner: str | None = None,
                  on_lost: Callable[[Any], object] | None = None,
                  auto_renew: bool = True, pause_budget: float | None = None,
                  blocking_timeout: float | None = None,
                  max_hold: float | None = None, limit: int = 1,
                  fence_ttl: float | None = None) -> Lock:
    """A lock named ``name`` on the backend ``url`` names (see
    :func:`backend_from_url`): a :class:`~celery_dlock.RedisLock`,
    :class:`~celery_dlock.RedlockLock`, PostgreSQL, MySQL/MariaDB or ZooKeeper lock,
    each with the same surface (``acquire``, ``release``, ``extend``, ``owned``,
    ``ensure_held``, ``holder``, ``depth``, ``fence``, ``on_lost``, the context
    manager).  ``limit`` > 1 gives a semaphore of that many slots (a
    :class:`~celery_dlock.RedisSemaphore` on Redis; every backend with the ``limit``
    capability keeps them, Redlock refuses them).  No server call."""
    options = LockOptions(name, ttl, prefix=prefix, info=info, owner=owner,
                          on_lost=on_lost, auto_renew=auto_renew,
                          pause_budget=pause_budget, max_hold=max_hold, limit=limit,
                          blocking_timeout=blocking_timeout, fence_ttl=fence_ttl)
    lock: Lock = backend_from_url(url).lock(options)
    return lock


def _sql_backend_of(app: Any) -> Backend | None:
    """The SQL backend ``app``'s ``dlock_url`` names (None: a Redis one)."""
    conf = app.conf
    url = connection.sql_url_of(conf)
    if url is None:
        return None
    entry = app_cache.entry(app)
    if not entry.checked:
        check_conf(conf)
        entry.checked = True
    return backend_from_url(url)


def backend_for(app: Any) -> Backend:
    """This process's backend for ``app`` (made with its client; both are kept per
    app and process, :mod:`.app_cache`; the app's settings are checked when it is
    first made)."""
    found = app_cache.lookup(app)
    if found is not None and found.backend is not None and \
            (found.backend_client is None or found.backend_client is found.client):
        backend: Backend = found.backend
        return backend  # the path every task run takes: no lock
    if found is None or found.backend is None:
        sql_backend = _sql_backend_of(app)
        if sql_backend is not None:
            entry = app_cache.entry(app)
            entry.backend, entry.backend_client = sql_backend, None
            return sql_backend
    client = get_client(app)
    entry = app_cache.entry(app)
    with app_cache.lock():
        if entry.backend is None or entry.backend_client is not client:
            entry.backend, entry.backend_client = backend_of_client(client), client
        backend = entry.backend
        return backend


def forget_app(app: Any) -> None:
    """Drop what this process cached from ``app``'s configuration: its backend, its
    client (a new one is made from the settings, as at the first call) and the
    ``dlock_*`` settings each of its tasks read when it first ran.  For tests that
    change ``app.conf`` between calls (the ``dlock_eager`` fixture)."""
    app_cache.forget(app)
    for task in list(getattr(app, "tasks", {}).values()):
        vars(task).pop("_dlock_settings", None)


def check_limit_supported(app: Any, limit: Any, where: str) -> None:
    """InvalidLockConfig when ``limit`` > 1 (a semaphore) and the backend ``app``'s
    settings name keeps no semaphores (its capabilities, from the settings alone).
    (A ``dlock_client`` returning several clients is refused at the first lock.)"""
    if limit in (None, 1):
        return
    entry = connection.configured_entry(conf_of(app))
    if entry is not None and not entry.can(LIMIT):
        raise InvalidLockConfig(entry.missing(LIMIT, f"{where}: lock_limit={limit!r}"))


def check_markers_supported(app: Any, mode: Any, where: str) -> None:
    """NotSupported when ``mode`` (a task's declared ``lock_mode``) needs queue
    markers and the backend ``app``'s settings name keeps none (its capabilities,
    from the settings alone: at worker start, before any call is sent)."""
    if mode in (None, "while_running"):
        return
    entry = connection.configured_entry(conf_of(app))
    if entry is not None and not entry.can(MARKERS):
        raise NotSupported(entry.missing(MARKERS, f"{where}: lock_mode={mode!r}"))


def markers_for(app: Any, backend: Backend | None = None) -> MarkerStore:
    """The queue markers of ``app``'s backend (enqueue-time uniqueness modes), or of
    ``backend`` when given (the Redis ``celery dlock --url`` reads).  Raises
    :class:`NotSupported` when that backend keeps none (a Redlock)."""
    if backend is None:
        backend = backend_for(app)
    markers = getattr(backend, "markers", None)
    if MARKERS not in backend.capabilities or markers is None:
        raise NotSupported(entry_named(backend.kind).missing(
            MARKERS, "lock_mode other than while_running"))
    store: MarkerStore = markers()
    return store
