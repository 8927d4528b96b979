"""What every ``celery dlock`` sub-command reads: the backend and key prefix
(:class:`Target`, made on first use), and how an unreachable or unconfigured store
(Redis, PostgreSQL, MySQL, ZooKeeper) becomes one line naming it and exit code 2."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..core.errors import BackendUnavailable, InvalidLockConfig, NotSupported
from ..core.lock_args import DEFAULT_PREFIX
from ..core.protocol import Backend
from ..core.registry import INSPECT, redis_driver
from ..task.backend import backend_for, backend_from_url, backend_of_client, markers_for
from ..task.config import mask_url, resolve_url
from ..task.connection import client_for_url, sql_url_of
from ..task.markers import MarkerStore
from ..task.schemes import check_known, url_backend
from ..task.settings import conf_of, conf_value
from .formatting import printable

__all__ = ["EXIT_NOT_FOUND", "EXIT_UNAVAILABLE", "STORE_NAMES", "Target", "fail",
           "reports_redis_errors", "target_of"]

#: The name of each backend kind in messages (the others are Redis's).
STORE_NAMES = {"postgres": "PostgreSQL", "mysql": "MySQL", "zookeeper": "ZooKeeper"}

EXIT_NOT_FOUND = 1
EXIT_UNAVAILABLE = 2

F = TypeVar("F", bound=Callable[..., Any])

#: A queue marker as the commands show it: (task id, seconds left or None).
Queued = tuple[str, float | None]


class Target:
    """Which backend and prefix the sub-commands read; made on first use."""

    def __init__(self, app: Any, url: str | None, prefix: str | None) -> None:
        self.app = app
        self.url = url
        self.prefix: str = prefix or conf_value(app, "dlock_key_prefix", DEFAULT_PREFIX)
        self._backend: Backend | None = None
        self._client: Any = None
        self._markers: MarkerStore | None = None
        self._markers_read = False

    def backend(self) -> Backend:
        """The backend the locks are read from (one Redis; a Redlock is refused in
        one line: give --url with one of its servers)."""
        if self._backend is None:
            made_from_url = url_backend(self.url) is not None if self.url else False
            one_redis = redis_driver().redis_url_of(self.url) if self.url else None
            if self.url and (made_from_url or one_redis is None):
                if not made_from_url:  # a scheme none reads: name --url
                    check_known(self.url, "--url")
                backend = backend_from_url(self.url)
            else:
                backend = (backend_of_client(self._url_client()) if self.url
                           else backend_for(self.app))
            if INSPECT not in backend.capabilities:
                backend.holds(self.prefix)  # raises NotSupported, in one line
            self._backend = backend
        return self._backend

    def client(self) -> Any:
        """The Redis client of the backend (for the event history)."""
        return getattr(self.backend(), "client", None)

    def markers(self) -> MarkerStore | None:
        """The queue markers of the Redis read (enqueue-time ``lock_mode``s), or None
        where the app's backend keeps none (a Redlock): the commands then show no
        marker information."""
        if not self._markers_read:
            self._markers = self._marker_store()
            self._markers_read = True
        return self._markers

    def _marker_store(self) -> MarkerStore | None:
        if not self.url:
            try:
                return markers_for(self.app)
            except NotSupported:
                return None
        try:  # --url: not on a Redlock app (whose sends never write markers)...
            markers_for(self.app)
        except NotSupported:
            return None
        except (InvalidLockConfig, BackendUnavailable, RedisError,
                RedisClusterException):
            pass  # ...and the app's own Redis need not be configured or up
        try:  # ...the markers of the Redis --url names
            return markers_for(self.app, self.backend())
        except NotSupported:
            return None

    def queued(self) -> dict[str, Queued] | None:
        """Every queue marker under the prefix, by lock name (None: not kept)."""
        store = self.markers()
        if store is None:
            return None
        return {name: (task_id, left)
                for name, task_id, left in store.queued(self.prefix)}

    def queued_one(self, name: str) -> Queued | None:
        """The queue marker of ``name``, or None."""
        store = self.markers()
        return None if store is None else store.read(self.prefix, name)

    def _url_client(self) -> Any:
        if self._client is None and self.url:
            self._client = client_for_url(self.url, conf_of(self.app), "--url")
        return self._client

    def where(self) -> str:
        """The Redis being read, for messages (passwords masked)."""
        if self.url:
            return mask_url(self.url)
        conf = conf_of(self.app)
        sql_url = sql_url_of(conf)
        if sql_url is not None:
            return mask_url(sql_url)
        if conf_value(conf, "dlock_client"):
            client = getattr(self._backend, "client", None)
            kwargs = getattr(getattr(client, "connection_pool", None),
                             "connection_kwargs", None) or {}
            if "path" in kwargs:
                return f"unix://{kwargs['path']}"
            if "host" in kwargs:
                return f"{kwargs['host']}:{kwargs.get('port', 6379)}"
            return "the client of app.conf.dlock_client"
        try:
            return mask_url(resolve_url(conf))
        except InvalidLockConfig:
            return "?"

    def store(self) -> str:
        """The kind of store being read, for messages: Redis, PostgreSQL, MySQL or
        ZooKeeper (the backend's kind once made, else the URL's scheme)."""
        kind = getattr(self._backend, "kind", None)
        if kind is None:
            url = self.url
            if url is None:
                try:
                    url = sql_url_of(conf_of(self.app))
                except Exception:  # a setting it cannot read: said elsewhere
                    url = None
            entry = url_backend(url) if url else None
            kind = entry.kind if entry is not None else None
        return STORE_NAMES.get(str(kind), "Redis")

    def close(self) -> None:
        if self.url and self._client is not None:
            self._client.close()


def target_of(ctx: click.Context) -> Target:
    target = ctx.meta["celery_dlock.target"]
    assert isinstance(target, Target)
    return target


def fail(ctx: click.Context, message: str, code: int) -> None:
    click.echo(printable(message), err=True)
    ctx.exit(code)


def _no_app_hint(ctx: click.Context, target: Target) -> str:
    """What to do when neither an app (``-A``) nor ``--url`` was given: the command
    then reads Celery's default app, which has no lock store."""
    if target.url is not None or ctx.find_root().params.get("app"):
        return ""
    return " (no app was given: pass -A / --app, as in celery -A proj dlock ls, or " \
           "--url)"


def reports_redis_errors(fun: F) -> F:
    """Turn an unreachable or unconfigured Redis into one line and exit code 2."""

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        target = target_of(ctx)
        try:
            return fun(*args, **kwargs)
        except InvalidLockConfig as exc:
            fail(ctx, f"celery dlock: {exc}{_no_app_hint(ctx, target)}",
                 EXIT_UNAVAILABLE)
        except (BackendUnavailable, RedisConnectionError, RedisTimeoutError) as exc:
            cause = exc.__cause__ if isinstance(exc, BackendUnavailable) else exc
            fail(ctx, f"cannot reach {target.store()} at {target.where()}: "
                      f"{cause or exc}", EXIT_UNAVAILABLE)
        except RedisError as exc:
            fail(ctx, f"Redis at {target.where()} answered with an error: {exc}",
                  EXIT_UNAVAILABLE)
        return None

    return wrapper  # type: ignore[return-value]
