"""``dlock_*`` settings: task option > ``app.conf.dlock_*`` > default; the Redis client.

Every setting has a task option (an ``@app.task(...)`` keyword or class attribute) and
an app-wide ``app.conf`` key; the task option wins.  Values are checked when read, and a
bad one is an :class:`InvalidLockConfig` naming the setting.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from .errors import InvalidLockConfig
from .topology import client_from_url, is_broker_url, is_lock_url, transport_options

__all__ = ["SETTINGS", "Setting", "get_client", "read_setting", "resolve_url"]

POLICIES = ("retry", "wait", "skip", "raise")
LOST_ACTIONS = ("warn", "interrupt")


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise InvalidLockConfig(f"{name} must be a positive number of seconds, "
                                f"got {value!r}")
    return float(value)


def _non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise InvalidLockConfig(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidLockConfig(f"{name} must be a whole number >= 0, got {value!r}")
    return value


def _policy(name: str, value: Any) -> Any:
    if callable(value) or value in POLICIES:
        return value
    raise InvalidLockConfig(f"{name} must be one of {', '.join(POLICIES)} or a callable, "
                            f"got {value!r}")


def _lost_action(name: str, value: Any) -> str:
    if value in LOST_ACTIONS:
        return str(value)
    raise InvalidLockConfig(f"{name} must be one of {', '.join(LOST_ACTIONS)}, "
                            f"got {value!r}")


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidLockConfig(f"{name} must be True or False, got {value!r}")
    return value


def _prefix(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidLockConfig(f"{name} must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class Setting:
    """One setting: its task option, its app.conf key, default and validator."""

    option: str
    conf: str
    default: Any
    check: Callable[[str, Any], Any]
    doc: str


SETTINGS: dict[str, Setting] = {s.option: s for s in (
    Setting("lock_ttl", "dlock_ttl", 30.0, _positive,
            "seconds a hold lives after its last renewal; renewed every ttl/3"),
    Setting("lock_prefix", "dlock_key_prefix", "dlock", _prefix,
            "prefix of every Redis key"),
    Setting("on_contention", "dlock_on_contention", "retry", _policy,
            "what to do when the lock is held: retry, wait, skip, raise or a callable"),
    Setting("lock_wait", "dlock_wait", 10.0, _non_negative,
            "the wait policy blocks this long for a release before falling back to "
            "retry"),
    Setting("lock_retry_backoff", "dlock_retry_backoff", 1.0, _positive,
            "first contention retry delay cap (seconds); doubles per retry, full jitter"),
    Setting("lock_retry_backoff_max", "dlock_retry_backoff_max", 30.0, _positive,
            "largest contention retry delay cap (seconds)"),
    Setting("lock_retry_max", "dlock_retry_max", 20, _count,
            "contention retries before the task fails with LockNotAcquired "
            "(not counted against max_retries)"),
    Setting("lock_fail_open", "dlock_fail_open", False, _bool,
            "run the body unlocked (with a warning) when Redis is unreachable"),
    Setting("lock_lost_action", "dlock_lock_lost_action", "warn", _lost_action,
            "when the lock is lost while the body runs: warn (signal + log), or "
            "interrupt (raise LockLost inside the task)"),
)}


def read_setting(task: Any, option: str) -> Any:
    """Task option > ``app.conf`` > default, validated."""
    setting = SETTINGS[option]
    value = getattr(task, option, None)
    where = f"task {getattr(task, 'name', task)!r} option {option}"
    if value is None:
        app = getattr(task, "app", None)
        conf = getattr(app, "conf", None)
        value = conf.get(setting.conf) if conf is not None else None
        where = f"app.conf.{setting.conf}"
    if value is None:
        return setting.default
    return setting.check(where, value)


# -- the Redis client -------------------------------------------------------------

def resolve_url(conf: Any) -> str:
    """``dlock_url``, else the broker URL when that is a Redis URL (see
    :mod:`celery_dlock.topology` for the spellings)."""
    url = conf.get("dlock_url")
    if url:
        if not is_lock_url(url):
            raise InvalidLockConfig(f"app.conf.dlock_url must be a redis://, rediss://, "
                                    f"unix://, redis+cluster:// or sentinel:// URL, "
                                    f"got {url!r}")
        return str(url)
    broker = conf.get("broker_url")
    if is_broker_url(broker):
        return str(broker)
    raise InvalidLockConfig(
        "celery-dlock needs a Redis: set app.conf.dlock_url (for example "
        "'redis://localhost:6379/0'), or dlock_client to a function returning a client; "
        f"the broker URL {broker!r} is not a Redis URL it can use")


def _default_client_options() -> dict[str, Any]:
    return {
        "socket_timeout": 5.0,
        "socket_connect_timeout": 3.0,
        "health_check_interval": 30,
        # Fail over quickly to BackendUnavailable rather than hang a task.
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
    }


_clients: dict[tuple[int, str], Any] = {}
# The hot path: the client of an app object, without reading its configuration.
_by_app: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_clients_lock = threading.Lock()


def get_client(app: Any) -> Any:
    """This process's Redis client for ``app`` (one per process, rebuilt after fork).

    The app's ``dlock_url`` / ``dlock_client`` are read when it is first asked for.

    ``app.conf.dlock_client``, when set, is a callable returning a client (any
    topology redis-py supports: Sentinel, Cluster, ...); otherwise a client is built
    from :func:`resolve_url` with ``app.conf.dlock_redis_options`` merged over
    timeouts suited to locking (5 s socket timeout, 3 s connect timeout, 2 quick
    retries).
    """
    try:
        return _by_app[app]
    except (KeyError, TypeError):
        pass
    conf = app.conf
    factory = conf.get("dlock_client")
    cache_key = (id(app), "factory" if factory else resolve_url(conf))
    client = _clients.get(cache_key)
    if client is not None:
        return client
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is None:
            if factory is not None:
                if not callable(factory):
                    raise InvalidLockConfig("app.conf.dlock_client must be a callable "
                                            "returning a Redis client")
                client = factory()
            else:
                options = _default_client_options()
                extra = conf.get("dlock_redis_options") or {}
                if not isinstance(extra, dict):
                    raise InvalidLockConfig("app.conf.dlock_redis_options must be a dict")
                options.update(extra)
                client = client_from_url(cache_key[1], options,
                                         transport_options(conf, cache_key[1]))
            _clients[cache_key] = client
        with contextlib.suppress(TypeError):  # an app that takes no weak references
            _by_app[app] = client
        return client


def _forget_clients() -> None:
    global _clients_lock
    _clients.clear()
    _by_app.clear()
    _clients_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_clients)
