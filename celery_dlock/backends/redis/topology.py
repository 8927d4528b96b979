"""Redis clients from URLs: one server, Redis Cluster, or a Sentinel-watched master.

The spellings ``app.conf.dlock_url`` (and the broker URL) may take:

``redis://[[user]:password@]host:port/db``, ``rediss://...`` (TLS), ``unix:///path``
    one server (redis-py's own URL forms, query options included).
``redis+cluster://[[user]:password@]host:port`` (``rediss+cluster://`` for TLS)
    a Redis Cluster, found from that node; a ``redis.cluster.RedisCluster`` client.
``sentinel://[[user]:password@]host:26379[/db];sentinel://host2:26379;...``
    Celery's (kombu's) Sentinel spelling: the sentinels to ask, ``;``-separated; the
    master's name comes from the transport options (``master_name``), and
    ``sentinel_kwargs`` are the sentinels' own connection options (for a password on
    the sentinels: ``{"password": ...}``).  The user, password and db of the first URL
    are the master's, as in kombu.  The client asks the sentinels for the master on
    every new connection, so it follows a failover.

A ``;`` separates URLs only where another ``scheme://`` follows it (a ``;`` in a
password does not); a password with ``; # ? / @ : %`` is written percent-encoded, and a
URL that an unencoded one made ambiguous is refused
(:mod:`celery_dlock.core.urls`).

The transport options come from the Celery face (``dlock_transport_options`` when
``dlock_url`` is set, else the broker's): this module reads no settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.cluster
import redis.sentinel
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ...core import urls
from ...core.errors import InvalidLockConfig

__all__ = [
    "client_from_url",
    "default_client_options",
    "is_cluster_url",
    "is_sentinel_url",
    "transport_options",
]

_CLUSTER = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SENTINEL = "sentinel"
_SENTINEL_PORT = 26379


def _scheme(url: str) -> str:
    head, sep, _ = url.partition("://")
    return head.lower() if sep else ""


def is_cluster_url(url: object) -> bool:
    return isinstance(url, str) and _scheme(url) in _CLUSTER


def is_sentinel_url(url: object) -> bool:
    return isinstance(url, str) and _scheme(url) == _SENTINEL


def transport_options(url: str, options: Any, setting: str) -> Mapping[str, Any]:
    """The transport ``options`` (from the setting named ``setting``) that ``url``
    takes: a ``sentinel://`` URL all of them, others none."""
    if _scheme(url) != _SENTINEL:
        return {}
    options = options or {}
    if not isinstance(options, Mapping):
        raise InvalidLockConfig(f"app.conf.{setting} must be a dict, got {options!r}")
    return options


def default_client_options() -> dict[str, Any]:
    """The keyword arguments every client of the locks gets (``dlock_redis_options``
    are merged over them): timeouts suited to locking, and two quick re-sends."""
    return {
        "socket_timeout": 5.0,
        "socket_connect_timeout": 3.0,
        "health_check_interval": 30,
        # Fail over quickly to BackendUnavailable rather than hang a task.
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        # What ``retry`` re-sends on: redis-py 6+ reads it from ``retry``, older
        # versions only from here (without it they re-send nothing).
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
    }


def client_from_url(url: str, options: Mapping[str, Any],
                    transport: Mapping[str, Any] | None = None) -> Any:
    """A client for ``url`` with ``options`` (redis-py keyword arguments).
    :class:`InvalidLockConfig` for a URL that reads more than one way (quoting none of
    it)."""
    for part in urls.split_urls(url):
        why = urls.ambiguity(part)
        if why is not None:
            raise InvalidLockConfig(f"the Redis URL cannot be read one way only "
                                    f"({why}): {urls.ENCODE_HINT}")
    scheme = _scheme(url)
    if scheme in _CLUSTER:
        plain = _CLUSTER[scheme] + url[len(scheme):]
        cluster_options = {k: v for k, v in options.items()
                           if k != "health_check_interval"}
        return redis.cluster.RedisCluster.from_url(plain, **cluster_options)
    if scheme == _SENTINEL:
        return _sentinel_master(url, options, transport or {})
    return redis.Redis.from_url(url, **options)


def _sentinel_master(url: str, options: Mapping[str, Any],
                     transport: Mapping[str, Any]) -> Any:
    where = "the sentinel:// URL"
    sentinels: list[tuple[str, int]] = []
    master: dict[str, Any] = {}
    for i, part in enumerate(urls.split_urls(url)):
        if _scheme(part) != _SENTINEL or ";" in part.rpartition("@")[2]:
            got = (f"scheme {_scheme(part) or 'none'!r}" if _scheme(part) != _SENTINEL
                   else "a ';' after a host that no sentinel:// follows")
            raise InvalidLockConfig(f"{where}: every ';'-separated part must be a "
                                    f"sentinel:// URL, got {got}")
        parts = urlsplit(part)
        try:
            port = parts.port or _SENTINEL_PORT
        except ValueError:
            raise InvalidLockConfig(f"{where}: part {i + 1} has a bad port") from None
        if not parts.hostname:
            raise InvalidLockConfig(f"{where}: part {i + 1} names no host")
        sentinels.append((parts.hostname, port))
        if not master:
            if parts.username:
                master["username"] = unquote(parts.username)
            if parts.password:
                master["password"] = unquote(parts.password)
            path = parts.path.strip("/")
            if path:
                if not path.isdigit():
                    raise InvalidLockConfig(f"{where}: the database must be a number")
                master["db"] = int(path)
    if not sentinels:
        raise InvalidLockConfig(f"{where} names no sentinel")
    name = transport.get("master_name")
    if not isinstance(name, str) or not name:
        raise InvalidLockConfig(
            "a sentinel:// URL needs the master's name: set dlock_transport_options "
            "(or broker_transport_options, for the broker's URL) to "
            "{'master_name': ...}")
    sentinel_kwargs = transport.get("sentinel_kwargs")
    if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, Mapping):
        raise InvalidLockConfig("transport option sentinel_kwargs must be a dict")
    # The sentinels get the timeouts and retries of the lock's client unless told
    # otherwise (redis-py's own default re-tries for seconds).
    ask = {k: v for k, v in options.items() if k.startswith("socket_") or k == "retry"}
    ask.update(sentinel_kwargs or {})
    min_other = transport.get("min_other_sentinels", 0)
    sentinel_class: Any = redis.sentinel.Sentinel  # (untyped in redis-py)
    sentinel = sentinel_class(sentinels, min_other_sentinels=min_other,
                              sentinel_kwargs=ask, **{**options, **master})
    return sentinel.master_for(name)
