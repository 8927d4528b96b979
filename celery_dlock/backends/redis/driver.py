"""The Redis family's module for the backend registry
(:mod:`celery_dlock.core.registry`): one Redis (a server, a Cluster, Sentinel) and
Redlock (3 or more independent servers) share it."""

from __future__ import annotations

from typing import Any

from ...core.protocol import Backend
from .backend import RedisBackend
from .redlock.backend import RedlockBackend
from .topology import default_client_options, is_cluster_url, transport_options
from .urls import check_client_options, client_from_url, redis_url_of, redlock_urls

__all__ = ["backend_from_url", "backend_of_client", "check_client_options",
           "client_from_url", "default_client_options", "is_cluster_url",
           "redis_url_of", "redlock_urls", "transport_options"]


def backend_of_client(client: Any) -> Backend:
    """The backend of a client the configuration gave: a tuple of clients is a
    Redlock, anything else one Redis."""
    if isinstance(client, tuple):
        return RedlockBackend(client)
    return RedisBackend(client)


def backend_from_url(url: str) -> Backend:
    """The backend of one Redis URL as redis-py opens it (the Celery face has read
    Celery's spellings and Redlock lists already), with the default client options."""
    return RedisBackend(client_from_url(url, default_client_options()))
