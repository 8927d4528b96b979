"""Lock URLs of the Redis family as the Celery face gives them: one server in
redis-py's, Celery's and kombu's spellings, a Redlock list, and a client made from
one with its errors naming the setting, the URL masked.

Which URL the locks use (``dlock_url``, else the broker's or the result backend's)
is the Celery face's choice (:mod:`celery_dlock.task.connection`); this module reads
no settings.  A ``;`` separates URLs only where another ``scheme://`` follows it, as
:mod:`celery_dlock.core.urls` says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

import redis
from redis.exceptions import RedisClusterException

from ...core import urls
from ...core.errors import BackendUnavailable, InvalidLockConfig
from ...core.urls import mask_setting
from .topology import client_from_url as topology_client
from .topology import is_cluster_url, is_sentinel_url

__all__ = ["REDLOCK_MIN_NODES", "REDLOCK_SCHEME", "check_client_options",
           "client_from_url", "redis_url_of", "redlock_urls"]

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
# Celery's and kombu's spellings of a Redis unix socket.
_SOCKET_SCHEMES = ("redis+socket://", "socket://")
def _celery_query(url: str) -> str:
    """Celery's spellings in a Redis URL's query, as redis-py takes them:
    ``ssl_cert_reqs=CERT_REQUIRED`` (Celery's documented form) -> ``required``."""
    base, question, query = url.partition("?")
    if not question or "CERT_" not in query:
        return url
    pairs = [(k, v[len("CERT_"):].lower() if k == "ssl_cert_reqs" and
              v.startswith("CERT_") else v)
             for k, v in parse_qsl(query, keep_blank_values=True)]
    return f"{base}?{urlencode(pairs)}"


def redis_url_of(url: Any) -> str | None:
    """``url`` as a URL redis-py opens, when it names one Redis server; else None.

    Accepts ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://`` and
    Celery's ``sentinel://h1;sentinel://h2`` (see
    :mod:`celery_dlock.backends.redis.topology`), and Celery's unix socket spellings
    ``redis+socket:///path`` and ``socket:///path`` (``virtual_host=N`` is the db);
    ``ssl_cert_reqs=CERT_REQUIRED`` (Celery's spelling) becomes redis-py's
    ``required``.  A list, or several URLs separated by ``;`` (broker failover),
    is not one server: None.  A ``;`` separates URLs where another ``scheme://``
    follows it, or after the host; in a password it is part of the password.
    """
    if not isinstance(url, str):
        return None
    if is_cluster_url(url) or is_sentinel_url(url):
        return url  # several nodes by design (see celery_dlock.backends.redis.topology)
    if len(urls.split_urls(url)) > 1 or ";" in url.rpartition("@")[2]:
        return None
    if url.startswith(_REDIS_SCHEMES):
        return _celery_query(url)
    for scheme in _SOCKET_SCHEMES:
        if url.startswith(scheme):
            rest = url[len(scheme):]
            path, _, query = rest.partition("?")
            pairs = [("db" if k == "virtual_host" else k, v)
                     for k, v in parse_qsl(query, keep_blank_values=True)]
            return f"unix://{path}" + (f"?{urlencode(pairs)}" if pairs else "")
    return None


REDLOCK_SCHEME = "redlock://"
#: The fewest servers a Redlock ``dlock_url`` may name.
REDLOCK_MIN_NODES = 3


def redlock_urls(value: Any) -> tuple[str, ...] | None:
    """The one-server URLs of a Redlock ``dlock_url`` (a list or tuple of URLs, or
    ``redlock://``-URLs separated by ``;``); None when ``value`` does not ask for
    Redlock.  :class:`InvalidLockConfig` naming ``dlock_url`` (masked) for a part that
    is not one server, or fewer than 3 of them."""
    if isinstance(value, str):
        parts = urls.split_urls(value)
        redlock = [p.lower().startswith(REDLOCK_SCHEME) for p in parts]
        if not any(redlock):
            return None
        if not all(redlock):
            raise InvalidLockConfig(
                f"app.conf.dlock_url mixes redlock:// with other URLs: "
                f"{mask_setting(value)!r}; give every server as redlock://host:port/db")
        parts = ["redis://" + p[len(REDLOCK_SCHEME):] for p in parts]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        return None
    found_urls: list[str] = []
    for part in parts:
        found = redis_url_of(part) if isinstance(part, str) else None
        if found is None or is_cluster_url(found) or \
                is_sentinel_url(found):
            raise InvalidLockConfig(
                f"app.conf.dlock_url: every Redlock server must be one redis://, "
                f"rediss:// or unix:// URL, got {mask_setting(part)!r}")
        found_urls.append(urls.check_unambiguous(
            found, f"app.conf.dlock_url (Redlock server {len(found_urls) + 1})"))
    if len(found_urls) < REDLOCK_MIN_NODES:
        raise InvalidLockConfig(
            f"app.conf.dlock_url names {len(found_urls)} Redis server(s): a Redlock "
            f"needs {REDLOCK_MIN_NODES} or more independent servers (one server: a "
            f"plain URL)")
    return tuple(found_urls)


#: Where a lock URL comes from, unless the caller says otherwise.
FROM_SETTINGS = "app.conf.dlock_url, or the broker/result backend it defaults to"


def client_from_url(url: str, options: Mapping[str, Any], transport: Any = None,
                    where: str = FROM_SETTINGS) -> Any:
    """A client for ``url`` (:func:`.topology.client_from_url`; no connection is
    opened, but a Cluster client asks a node for its slots) whose errors name
    ``where`` the URL was given and mask it: :class:`InvalidLockConfig` for a URL
    or option redis-py refuses, :class:`BackendUnavailable` for a Cluster that does
    not answer."""
    try:
        return topology_client(url, options, transport)
    except (ValueError, TypeError) as exc:
        text = str(exc).replace(url, mask_setting(url))
        raise InvalidLockConfig(f"cannot use the Redis URL {mask_setting(url)!r} "
                                f"({where}): {text}") from None
    except (RedisClusterException, redis.RedisError) as exc:
        # redis-py's cluster client asks a node for the slots when it is made: no
        # node answering is Redis being unreachable, like a refused command later.
        text = str(exc).replace(url, mask_setting(url))
        raise BackendUnavailable(f"Redis unavailable at {mask_setting(url)}: {text}") \
            from None


def check_client_options(client: Any) -> None:
    """Make (not open) one connection of ``client``'s pool, so an unknown keyword in
    ``dlock_redis_options`` or in the URL's query is found now, not at the first
    command."""
    pool = getattr(client, "connection_pool", None)
    if pool is None or not hasattr(pool, "make_connection"):
        return
    try:
        conn = pool.make_connection()
    except (TypeError, ValueError, redis.RedisError) as exc:
        raise InvalidLockConfig(f"app.conf.dlock_redis_options (or the query of the "
                                f"Redis URL) is refused by redis-py: {exc}") from None
    conn.disconnect()


