"""``dlock_*`` settings and task options: where each value comes from, and checks.

Every setting has a task option and an app-wide ``app.conf`` key.  A value is taken
from the first of these that sets it, as Celery does for its own task options:

1. the call: the message's headers, ``apply_async(..., headers={"lock_ttl": 5})``
   (:data:`CALL_OPTIONS` only: the options that name the lock cannot change per call);
2. ``app.conf.task_annotations`` for the task;
3. the task class, most derived first (``@app.task(...)`` keywords are attributes of
   the class Celery makes);
4. ``app.conf.dlock_*``;
5. the default.

Values are checked where they are given: task options when the task is declared
(and again once annotations are applied, when the task is bound to its app), app
settings when a worker starts and when the Redis client is first made, per-call headers
when the call is sent and when it runs.  A bad value, or an unknown ``lock_*`` option
or ``dlock_*`` setting, is an :class:`InvalidLockConfig` naming it (and the closest
known name).
"""

from __future__ import annotations

import difflib
import inspect
import math
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import Task
from celery.app.annotations import resolve_all as resolve_all_annotations

from ..backends.redis.topology import is_cluster_url, transport_options
from ..core.errors import InvalidLockConfig
from . import connection
from .connection import mask_url, redis_url_of, resolve_url

__all__ = [
    "CALL_OPTIONS",
    "CONF_KEYS",
    "KEY_OPTIONS",
    "SETTINGS",
    "TASK_OPTIONS",
    "Setting",
    "apply_annotations",
    "call_overrides",
    "check_conf",
    "check_task_options",
    "get_client",
    "mask_url",
    "read_setting",
    "redis_url_of",
    "resolve_url",
]

POLICIES = ("retry", "wait", "skip", "raise")
LOST_ACTIONS = ("fail", "interrupt", "warn")


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
    Setting("lock_lost_action", "dlock_lock_lost_action", "fail", _lost_action,
            "when the lock is lost while the body runs: fail (the body finishes, the "
            "attempt ends FAILURE LockLost), interrupt (raise LockLostInterrupt inside "
            "the task; FAILURE) or warn (signal + log; the result stands)"),
)}


#: Task options that make the lock's name: no app setting, no per-call override.
KEY_OPTIONS = ("lock_key", "lock_args")
#: Every task option of a LockedTask.
TASK_OPTIONS: frozenset[str] = frozenset(SETTINGS) | frozenset(KEY_OPTIONS)
#: Options no call may override, and why.
NOT_PER_CALL = {
    **dict.fromkeys(
        (*KEY_OPTIONS, "lock_prefix"),
        "it names the lock, which every call (and the worker's main process, which "
        "frees a dead child's lock, and celery dlock) must agree on"),
    "lock_lost_action": "a lost lock is handled outside the call, from the task's "
                        "own settings",
}
#: Options one call may override in its message headers.
CALL_OPTIONS: frozenset[str] = frozenset(SETTINGS) - frozenset(NOT_PER_CALL)
#: The ``app.conf`` keys that are not a task option's app-wide value.
OTHER_CONF = {
    "dlock_url": "the Redis of the locks",
    "dlock_client": "a callable returning a redis-py client",
    "dlock_redis_options": "extra redis.Redis.from_url keyword arguments",
    "dlock_transport_options": "master_name and sentinel_kwargs for a sentinel:// URL",
    "dlock_record_events": "keep a history of contention for celery dlock top",
}
#: Every ``app.conf.dlock_*`` key celery-dlock reads.
CONF_KEYS: frozenset[str] = frozenset(s.conf for s in SETTINGS.values()) | \
    frozenset(OTHER_CONF)


def _closest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]}?)" if close else ""


def _unbound(task: Any, value: Any) -> Any:
    # A function given as a task option is a class attribute, so the instance gives
    # it back bound to the task: the option is the function itself.
    if inspect.ismethod(value) and value.__self__ is task:
        return value.__func__
    return value


def read_setting(task: Any, option: str) -> Any:
    """Task option (annotations, class) > ``app.conf`` > default, validated.

    Per-call values are merged on top by :func:`call_overrides`.
    """
    setting = SETTINGS[option]
    value = _unbound(task, getattr(task, option, None))
    where = f"task {getattr(task, 'name', task)!r} option {option}"
    if value is None:
        app = getattr(task, "app", None)
        conf = getattr(app, "conf", None)
        value = conf.get(setting.conf) if conf is not None else None
        where = f"app.conf.{setting.conf}"
    if value is None:
        return setting.default
    return setting.check(where, value)


def call_overrides(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options one call sets in its message headers, checked.

    Headers named ``lock_*`` (and ``on_contention``) are options; an unknown one, one
    that names the lock, or a bad value is an :class:`InvalidLockConfig` naming the
    header.  A policy given per call is a name (a callable cannot travel in a message).
    """
    found: dict[str, Any] = {}
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or \
                not (name.startswith("lock_") or name == "on_contention"):
            continue
        where = f"per-call header {name}"
        if name in NOT_PER_CALL:
            raise InvalidLockConfig(f"{where}: {name} cannot be set per call: "
                                    f"{NOT_PER_CALL[name]}; set it on the task")
        if name not in CALL_OPTIONS:
            raise InvalidLockConfig(f"{where} is not a celery-dlock option"
                                    f"{_closest(name, CALL_OPTIONS)}")
        if name == "on_contention" and not isinstance(value, str):
            raise InvalidLockConfig(f"{where} must be a policy name (retry, wait, skip, "
                                    f"raise), got a {type(value).__name__}")
        found[name] = SETTINGS[name].check(where, value)
    return found


# -- unknown names --------------------------------------------------------------------

_METHODS = (types.FunctionType, property, classmethod, staticmethod)


def _defines(cls: type, name: str) -> bool:
    # Not hasattr(): Task.app is a class property that binds the class to the
    # current app when read.
    return any(name in klass.__dict__ for klass in cls.__mro__)


def check_task_options(cls: type, where: str, base: type) -> None:
    """Refuse an unknown ``lock_*`` / ``dlock_*`` option set on ``cls`` itself.

    ``base`` is the root task class: whatever it defines is known.  In a class made by
    ``@app.task(...)`` every attribute is an option, so a name close to a known option
    (``on_contension``) is refused too; in a hand-written subclass, methods and
    properties are the class's own business.
    """
    decorated = bool(cls.__dict__.get("_decorated"))
    for name, value in cls.__dict__.items():
        if name in TASK_OPTIONS or name.startswith("_") or _defines(base, name):
            continue
        prefixed = name.startswith(("lock_", "dlock_"))
        near = decorated and not _defines(Task, name) and \
            bool(difflib.get_close_matches(name, TASK_OPTIONS, n=1, cutoff=0.85))
        if not (prefixed or near):
            continue
        if not decorated and isinstance(value, _METHODS):
            continue
        raise InvalidLockConfig(f"{where}: unknown option {name}"
                                f"{_closest(name, TASK_OPTIONS)}")
    for option, setting in SETTINGS.items():
        value = cls.__dict__.get(option)
        if value is not None:
            setting.check(f"{where} option {option}", value)


def apply_annotations(cls: type, app: Any) -> None:
    """Set ``task_annotations``' lock options on the task class ``cls``.

    Celery annotates a class only on its first bind, and a class made from an already
    bound base (``@app.task(base=SomeBoundTask)``) counts as bound: its annotations
    would be skipped.  Setting ours again is harmless where Celery did apply them.
    """
    for found in resolve_all_annotations(app.annotations, cls):
        for key, value in found.items():
            if key in TASK_OPTIONS or key.startswith(("lock_", "dlock_")):
                setattr(cls, key, value)


def _conf_keys(conf: Any) -> list[str]:
    try:
        return [k for k in conf if isinstance(k, str)]
    except (AttributeError, TypeError):
        return []


def check_conf(conf: Any) -> None:
    """Check every ``app.conf.dlock_*`` setting: known names, good values, and that a
    Redis can be found (masked URLs in every message)."""
    for key in _conf_keys(conf):
        if key.startswith("dlock_") and key not in CONF_KEYS:
            raise InvalidLockConfig(f"app.conf.{key} is not a celery-dlock setting"
                                    f"{_closest(key, CONF_KEYS)}")
        if key.lower().startswith("dlock_") and key != key.lower():
            raise InvalidLockConfig(f"app.conf.{key}: celery-dlock settings are lower "
                                    f"case{_closest(key.lower(), CONF_KEYS)}")
    for setting in SETTINGS.values():
        value = conf.get(setting.conf)
        if value is not None:
            setting.check(f"app.conf.{setting.conf}", value)
    record = conf.get("dlock_record_events")
    if record is not None:
        _bool("app.conf.dlock_record_events", record)
    factory = conf.get("dlock_client")
    if factory is not None:
        if not callable(factory):
            raise InvalidLockConfig("app.conf.dlock_client must be a callable returning "
                                    f"a Redis client, got a {type(factory).__name__}")
        return
    options = connection.client_options(conf)
    redlock = connection.redlock_urls(conf.get("dlock_url"))
    if redlock is not None:
        if record:
            raise InvalidLockConfig("app.conf.dlock_record_events is not supported with "
                                    "a Redlock dlock_url (several servers)")
        for url in redlock:
            client = connection.client_from_url(url, options)
            try:
                connection.check_client_options(client)
            finally:
                client.close()
        return
    url = resolve_url(conf)
    if is_cluster_url(url):
        return  # a cluster client connects as it is made: checked at first use
    # Parse it as the client will (a bad port, an unknown query argument), without
    # connecting: Redis may be down at this moment, which is not a configuration error.
    client = connection.client_from_url(url, options, transport_options(conf, url))
    try:
        connection.check_client_options(client)
    finally:
        client.close()


def get_client(app: Any) -> Any:
    """This process's Redis client for ``app`` (see :func:`connection.get_client`);
    the app's settings are checked (:func:`check_conf`) when it is first made."""
    client = connection.cached_client(app)
    if client is None:
        check_conf(app.conf)
        client = connection.get_client(app)
    return client
