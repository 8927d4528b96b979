"""Which Redis the locks live in, and this process's client for it.

The Redis is found as Celery finds its own connections:

1. ``app.conf.dlock_client``: a callable returning a client (any topology);
2. ``app.conf.dlock_url``;
3. the broker URL as Celery resolved it (``broker_url`` in code, or the
   ``CELERY_BROKER_URL`` environment variable, which ``celery -b`` sets), when it is a
   Redis URL;
4. the result backend (``result_backend`` or ``CELERY_RESULT_BACKEND``), when it is a
   Redis URL: so an AMQP or ``filesystem://`` broker with a Redis result backend works
   without ``dlock_url``.

A ``dlock_url`` that names 3 or more independent servers, as a list (or tuple) of
one-server URLs or as ``redlock://h1:6379/0;redlock://h2:6379/0;redlock://h3:6379/0``
(each ``redlock://`` is a ``redis://`` URL under another name), asks for Redlock: the
"client" is then a tuple of clients, one per server, and tasks take a
:class:`~celery_dlock.backends.redis.redlock.lock.RedlockLock`.  So does a
``dlock_client`` that returns a list or tuple of clients.

No URL is ever shown with its password: every message goes through :func:`mask_url`.
"""

from __future__ import annotations

from typing import Any

from ..core import urls
from ..core.errors import InvalidLockConfig
from ..core.registry import Entry, entry_for, entry_named, redis_driver
from . import app_cache
from .schemes import celery_sql_url, check_known, url_backend
from .settings import conf_value

__all__ = ["cached_client", "check_unambiguous", "configured_entry",
           "get_client", "mask_url", "resolve_url", "sql_url_of"]

#: ``value`` fit for a message, passwords masked
#: (:func:`celery_dlock.core.urls.mask_setting`).
mask_url = urls.mask_setting
#: ``url`` when it reads one way only (:func:`celery_dlock.core.urls.check_unambiguous`).
check_unambiguous = urls.check_unambiguous


def _conf_value(conf: Any, name: str) -> Any:
    """A Celery setting as Celery resolves it (``app.conf.broker_url`` reads the
    environment too); plain mappings by key."""
    if hasattr(type(conf), name):
        return getattr(conf, name)
    return conf.get(name)


def transport_options_for(conf: Any, url: str) -> Any:
    """The transport options ``url`` takes: ``dlock_transport_options`` when
    ``dlock_url`` is set, else the broker's (the lock then follows the broker's
    Sentinel).  Only a ``sentinel://`` URL takes any."""
    setting = ("dlock_transport_options" if conf_value(conf, "dlock_url")
               else "broker_transport_options")
    return redis_driver().transport_options(url, conf_value(conf, setting), setting)


def client_for_url(url: str, conf: Any = None, where: str = "--url") -> Any:
    """A client for a URL given by hand (``celery dlock --url``), with the options
    every client of the locks gets and the app's transport options; its errors name
    ``where`` (InvalidLockConfig, or BackendUnavailable for a dead Cluster)."""
    options = dict(redis_driver().default_client_options())
    transport = (conf_value(conf, "dlock_transport_options", {}) if conf is not None
                 else {})
    return redis_driver().client_from_url(url, options, transport, where)


def resolve_url(conf: Any) -> str:
    """The Redis URL for the locks: ``dlock_url``, else a Redis broker URL (code or
    environment), else a Redis result backend.  Raises :class:`InvalidLockConfig`
    naming ``dlock_url``, with every URL masked.  For Redlock, the servers' URLs
    joined by ``;`` (for messages: see :func:`redlock_urls`)."""
    url = conf_value(conf, "dlock_url")
    redlock = redis_driver().redlock_urls(url) if url else None
    if redlock is not None:
        return ";".join(redlock)
    if url:
        found = redis_driver().redis_url_of(url)
        if found is None:
            check_known(url, "app.conf.dlock_url")
        return _each_unambiguous(found, "app.conf.dlock_url")
    broker = _conf_value(conf, "broker_url")
    found = redis_driver().redis_url_of(broker)
    if found is not None:
        return _each_unambiguous(found, "the broker URL (broker_url)")
    backend = _conf_value(conf, "result_backend")
    found = redis_driver().redis_url_of(backend)
    if found is not None:
        return _each_unambiguous(found, "the result backend URL (result_backend)")
    raise InvalidLockConfig(
        "celery-dlock needs a lock store: set app.conf.dlock_url to a Redis, "
        "PostgreSQL, MySQL or ZooKeeper URL (for example 'redis://localhost:6379/0' or "
        "'postgresql://user@db/app'), or dlock_client to a function returning a Redis "
        f"client; neither the broker URL {mask_url(broker)!r} nor the result backend "
        f"{mask_url(backend)!r} is a Redis URL it can use")


def sql_url_of(conf: Any) -> str | None:
    """The SQL URL the locks live at, or None (they live in Redis, or nowhere yet):
    ``dlock_url`` when it names a SQL backend; without ``dlock_url`` and
    ``dlock_client``, and when no Redis is found as :func:`resolve_url` finds it, a
    PostgreSQL broker (``sqla+postgresql://``) or result backend
    (``db+postgresql://``), as PostgreSQL is found as Redis is."""
    if conf_value(conf, "dlock_client"):
        return None
    url = conf_value(conf, "dlock_url")
    if url:
        return url if url_backend(url) is not None else None
    try:
        resolve_url(conf)
        return None
    except InvalidLockConfig:
        pass
    for setting in ("broker_url", "result_backend"):
        found = celery_sql_url(_conf_value(conf, setting))
        if found is not None:
            return found
    return None


def configured_entry(conf: Any) -> Entry | None:
    """The backend ``conf``'s settings name, from them alone (no client is made, no
    server asked): for the checks at declaration and worker start, which ask it
    about capabilities.  None when the settings cannot say yet (a ``dlock_client``
    callable, whose clients are known when it is called; no lock store at all,
    which the first lock reports)."""
    if conf_value(conf, "dlock_client"):
        return None
    url = conf_value(conf, "dlock_url")
    if url:
        return entry_for(url)
    made_from_url = sql_url_of(conf)
    if made_from_url is not None:
        return entry_for(made_from_url)
    try:
        resolve_url(conf)
    except InvalidLockConfig:
        return None
    return entry_named("redis")  # the broker's or result backend's Redis


def _each_unambiguous(url: str, where: str) -> str:
    """``url`` when each of its URLs (a Sentinel list has several) reads one way only
    (:func:`check_unambiguous`)."""
    for part in urls.split_urls(url):
        check_unambiguous(part, where)
    return url


def client_options(conf: Any) -> dict[str, Any]:
    """The keyword arguments of ``redis.Redis.from_url``: the defaults above with
    ``app.conf.dlock_redis_options`` merged over them."""
    options = redis_driver().default_client_options()
    extra = conf_value(conf, "dlock_redis_options", {})
    if not isinstance(extra, dict):
        raise InvalidLockConfig("app.conf.dlock_redis_options must be a dict, got "
                                f"a {type(extra).__name__}")
    options.update(extra)
    return options


def cached_client(app: Any) -> Any:
    """The client :func:`get_client` made for ``app`` in this process, or None."""
    found = app_cache.lookup(app)
    return None if found is None else found.client


def get_client(app: Any) -> Any:
    """This process's Redis client for ``app`` (one per app and process, made anew
    after a fork: :mod:`.app_cache`).

    The app's Redis is found when it is first asked for.

    ``app.conf.dlock_client``, when set, is a callable returning a client (any
    topology redis-py supports: Sentinel, Cluster, ...); otherwise a client is built
    from :func:`resolve_url` with ``app.conf.dlock_redis_options`` merged over
    timeouts suited to locking (5 s socket timeout, 3 s connect timeout, 2 quick
    retries).  For Redlock (:func:`redlock_urls`, or a ``dlock_client`` returning a
    list or tuple), a tuple of clients, one per server.
    """
    found = app_cache.lookup(app)
    if found is not None and found.client is not None:
        return found.client
    conf = app.conf
    factory = conf_value(conf, "dlock_client")
    redis = redis_driver()
    redlock = None if factory else redis.redlock_urls(conf_value(conf, "dlock_url"))
    if factory:
        key = "factory"
    elif redlock is not None:
        key = "redlock:" + ";".join(redlock)
    else:
        key = resolve_url(conf)
    entry = app_cache.entry(app)
    with app_cache.lock():
        if entry.client is not None and entry.client_key == key:
            return entry.client
        if factory is not None:
            if not callable(factory):
                raise InvalidLockConfig("app.conf.dlock_client must be a callable "
                                        "returning a Redis client")
            client = factory()
            if isinstance(client, list):
                client = tuple(client)
        elif redlock is not None:
            options = client_options(conf)
            client = tuple(redis.client_from_url(u, options) for u in redlock)
        else:
            client = redis.client_from_url(key, client_options(conf),
                                           transport_options_for(conf, key))
        entry.client, entry.client_key = client, key
        return client
