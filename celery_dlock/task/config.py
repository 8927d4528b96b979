"""Checks of ``dlock_*`` settings and task options, per-call overrides, and the
client.  The settings table, where a value comes from and the one reader of them are
in :mod:`celery_dlock.task.settings`.

Values are checked where they are given: task options when the task is declared
(and again once annotations are applied, when the task is bound to its app), app
settings when a worker starts and when the Redis client is first made, per-call headers
when the call is sent and when it runs.  A bad value, or an unknown ``lock_*`` option
or ``dlock_*`` setting, is an :class:`InvalidLockConfig` naming it (and the closest
known name).
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Collection, Mapping
from typing import Any

from celery import Task
from celery.app.annotations import resolve_all as resolve_all_annotations

from ..core.errors import InvalidLockConfig
from ..core.registry import redis_driver
from . import connection
from .connection import mask_url, resolve_url
from .settings import (
    CALL_OPTIONS,
    CONF_KEYS,
    KEY_OPTIONS,
    NOT_PER_CALL,
    SETTINGS,
    TASK_OPTIONS,
    Setting,
    check_bool,
    conf_value,
    did_you_mean,
    read_setting,
)

__all__ = [
    "CALL_KEYWORDS",
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
    "resolve_url",
    "take_call_options",
]

#: Call options that are not named ``lock_*``.
_POLICY_OPTIONS = ("on_contention", "on_duplicate")
#: Keyword arguments of ``apply_async``/``send_task`` that are lock options.
CALL_KEYWORDS: frozenset[str] = CALL_OPTIONS | frozenset(KEY_OPTIONS) | \
    frozenset(NOT_PER_CALL)


#: How close (difflib's ratio) a keyword must be to a lock option to be taken for a
#: misspelling of it when it has no ``lock_`` / ``on_`` prefix to give it away.
_NEAR_MISS = 0.8
#: The ``on_*`` keywords a call may mean as lock options, and how close a misspelling is.
_POLICY_NEAR_MISS = 0.7


def _near_miss(name: str) -> bool:
    """Whether an ``apply_async``/``send_task`` keyword that is not a lock option looks
    like a misspelt one: ``lock_*``/``dlock_*`` (``lock_mdoe``), an ``on_*`` close to
    a policy (``on_duplicat``), or any name very close to a lock option
    (``lockmode``)."""
    if name.startswith(("lock_", "dlock_", "lock-")):
        return True
    if name.startswith("on_"):
        return bool(difflib.get_close_matches(name, _POLICY_OPTIONS, n=1,
                                              cutoff=_POLICY_NEAR_MISS))
    return bool(difflib.get_close_matches(name, CALL_KEYWORDS, n=1, cutoff=_NEAR_MISS))


def _refuse_near_misses(options: Mapping[str, Any]) -> None:
    for name in options:
        if isinstance(name, str) and name not in CALL_KEYWORDS and _near_miss(name):
            raise InvalidLockConfig(
                f"per-call keyword {name} is not a celery-dlock option"
                f"{did_you_mean(name, CALL_KEYWORDS | frozenset(_POLICY_OPTIONS))}; "
                f"nothing was sent")


def take_call_options(options: dict[str, Any]) -> dict[str, Any]:
    """Move the lock options given as keywords to ``apply_async``, ``send_task`` or a
    signature's options (``lock_mode="until_finished"``) into the call's headers,
    where they travel with the message, and return every per-call option, checked.

    A keyword beats the same option in ``headers={...}`` (both spellings work).  A
    keyword that looks like a misspelt lock option (``lock_mdoe``, ``on_duplicat``) is
    refused, as the same header is, before anything is sent: silently ignored, it
    would leave the call without the option its caller asked for.
    """
    _refuse_near_misses(options)
    given = options.keys() & CALL_KEYWORDS
    headers = options.get("headers")
    if given:
        headers = dict(headers or {})
        for name in given:
            headers[name] = options.pop(name)
        options["headers"] = headers
    if not headers:
        return {}
    return call_overrides(headers)


def call_overrides(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options one call sets in its message headers, checked.

    Headers named ``lock_*`` (and ``on_contention``) are options; an unknown one, one
    that names the lock, or a bad value is an :class:`InvalidLockConfig` naming the
    header.  A policy given per call is a name (a callable cannot travel in a message).
    """
    found: dict[str, Any] = {}
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or \
                not (name.startswith("lock_") or name in _POLICY_OPTIONS):
            continue
        where = f"per-call header {name}"
        if name in NOT_PER_CALL:
            raise InvalidLockConfig(f"{where}: {name} cannot be set per call: "
                                    f"{NOT_PER_CALL[name]}; set it on the task")
        if name not in CALL_OPTIONS:
            raise InvalidLockConfig(f"{where} is not a celery-dlock option"
                                    f"{did_you_mean(name, CALL_OPTIONS)}")
        if name in _POLICY_OPTIONS and not isinstance(value, str):
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


def check_task_options(cls: type, where: str, base: type,
                       known: Collection[str] = ()) -> None:
    """Refuse an unknown ``lock_*`` / ``dlock_*`` option set on ``cls`` itself.

    ``base`` is the root task class: whatever it defines is known, and so are the
    names in ``known`` (options a subclass of it reads itself, such as the
    ``lock_expiry`` of :class:`celery_dlock.compat.Singleton`).  In a class made by
    ``@app.task(...)`` every attribute is an option, so a name close to a known option
    (``on_contension``) is refused too; in a hand-written subclass, methods and
    properties are the class's own business.
    """
    decorated = bool(cls.__dict__.get("_decorated"))
    for name, value in cls.__dict__.items():
        if name in TASK_OPTIONS or name in known or name.startswith("_") or \
                _defines(base, name):
            continue
        prefixed = name.startswith(("lock_", "dlock_"))
        near = decorated and not _defines(Task, name) and \
            bool(difflib.get_close_matches(name, TASK_OPTIONS, n=1, cutoff=0.85))
        if not (prefixed or near):
            continue
        if not decorated and isinstance(value, _METHODS):
            continue
        raise InvalidLockConfig(f"{where}: unknown option {name}"
                                f"{did_you_mean(name, TASK_OPTIONS)}")
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
    Redis can be found (masked URLs in every message).  With ``dlock_enabled=False``
    no Redis is needed: a ``dlock_url`` or ``dlock_client`` given is still checked,
    none is required."""
    for key in _conf_keys(conf):
        if key.startswith("dlock_") and key not in CONF_KEYS:
            raise InvalidLockConfig(f"app.conf.{key} is not a celery-dlock setting"
                                    f"{did_you_mean(key, CONF_KEYS)}")
        if key.lower().startswith("dlock_") and key != key.lower():
            raise InvalidLockConfig(f"app.conf.{key}: celery-dlock settings are lower "
                                    f"case{did_you_mean(key.lower(), CONF_KEYS)}")
    for setting in SETTINGS.values():
        value = conf_value(conf, setting.conf)
        if value is not None:
            setting.check(f"app.conf.{setting.conf}", value)
    record = conf_value(conf, "dlock_record_events")
    if record is not None:
        check_bool("app.conf.dlock_record_events", record)
    for flag in ("dlock_enabled", "dlock_check_at_start"):
        if conf_value(conf, flag) is not None:
            check_bool(f"app.conf.{flag}", conf_value(conf, flag))
    factory = conf_value(conf, "dlock_client")
    if conf_value(conf, "dlock_enabled") is False and factory is None and \
            conf_value(conf, "dlock_url") is None:
        return  # every lock is a no-op: no Redis needed (a memory:// broker will do)
    if factory is not None:
        if not callable(factory):
            raise InvalidLockConfig("app.conf.dlock_client must be a callable returning "
                                    f"a Redis client, got a {type(factory).__name__}")
        return
    sql_url = connection.sql_url_of(conf)
    if sql_url is not None:
        if record:
            raise InvalidLockConfig("app.conf.dlock_record_events needs a Redis "
                                    "dlock_url (the history is a Redis list)")
        connection.check_unambiguous(sql_url, "app.conf.dlock_url")
        return  # parsed as it is first used: the server may be down now
    options = connection.client_options(conf)
    redlock = redis_driver().redlock_urls(conf_value(conf, "dlock_url"))
    if redlock is not None:
        if record:
            raise InvalidLockConfig("app.conf.dlock_record_events is not supported with "
                                    "a Redlock dlock_url (several servers)")
        for url in redlock:
            client = redis_driver().client_from_url(url, options)
            try:
                redis_driver().check_client_options(client)
            finally:
                client.close()
        return
    url = resolve_url(conf)
    if redis_driver().is_cluster_url(url):
        return  # a cluster client connects as it is made: checked at first use
    # Parse it as the client will (a bad port, an unknown query argument), without
    # connecting: Redis may be down at this moment, which is not a configuration error.
    client = redis_driver().client_from_url(url, options,
                                        connection.transport_options_for(conf, url))
    try:
        redis_driver().check_client_options(client)
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
