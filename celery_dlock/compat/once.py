"""``QueueOnce``: celery-once's options on a :class:`~celery_dlock.LockedTask`.

Change ``from celery_once import QueueOnce, AlreadyQueued`` to
``from celery_dlock.compat import QueueOnce, AlreadyQueued``; the tasks stay as they
are.  ``once={...}`` (on the task, or per call in ``apply_async``) is translated to
celery-dlock's own options; the enqueue is celery-dlock's (:mod:`celery_dlock.task.
modes`), there is no second implementation:

=======================  ==========================================================
celery-once              celery-dlock
=======================  ==========================================================
(the default)            ``lock_mode="until_finished"``, ``on_duplicate="raise"``:
                         a second call while the first is queued or running raises
                         :class:`~celery_dlock.AlreadyQueued` (``countdown``,
                         ``task_id``)
``graceful=True``        ``on_duplicate="drop"``; the call returns what celery-once
                         returns: ``EagerResult(None, None, "REJECTED")``
``keys=[...]``           ``lock_args=(...)`` (``[]``: the task name alone)
``timeout=N``            ``lock_queue_ttl=N``: how long a queued call keeps the name
                         when its message is lost.  A running call keeps it until it
                         ends, with a lock renewed every ``lock_ttl/3`` (a dead
                         worker's frees within ``lock_ttl``), never for a fixed time
``unlock_before_run``    ``lock_mode="until_started"``
``ONCE['settings']       the default ``timeout``; the other ``ONCE`` settings
['default_timeout']``    (``backend``, ``url``, ``blocking``, ...) are not used: the
                         locks live in the store of ``dlock_url`` (a warning says so
                         once)
=======================  ==========================================================

An option the task sets itself (``lock_mode=``, ``lock_queue_ttl=``, ...) wins over
the one ``once`` translates to.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from celery import states
from celery.result import EagerResult

from ..core.errors import InvalidLockConfig
from ..task.duplicates import DroppedResult
from ..task.locked_task import LockedTask
from ..task.settings import check_bool, conf_value
from .options import (
    argument_names,
    check_keys,
    positive_seconds,
    set_translated,
    warn_unused_once,
)

__all__ = ["ONCE_OPTIONS", "QueueOnce", "translate_once"]

#: The keys of celery-once's ``once`` option.
ONCE_OPTIONS = ("graceful", "keys", "timeout", "unlock_before_run")


def check_once(where: str, once: Any) -> dict[str, Any]:
    """``once`` checked: a mapping of :data:`ONCE_OPTIONS` with good values."""
    if not isinstance(once, Mapping):
        raise InvalidLockConfig(f"{where} must be a dict such as {{'graceful': True}}, "
                                f"got {once!r}")
    check_keys(where, once, ONCE_OPTIONS)
    checked: dict[str, Any] = {}
    for flag in ("graceful", "unlock_before_run"):
        if once.get(flag) is not None:
            checked[flag] = check_bool(f"{where}[{flag!r}]", once[flag])
    if once.get("keys") is not None:
        checked["keys"] = argument_names(f"{where}['keys']", once["keys"],
                                         one_string=False)
    if once.get("timeout") is not None:
        checked["timeout"] = positive_seconds(f"{where}['timeout']", once["timeout"])
    return checked


def default_timeout(app: Any) -> float | None:
    """``app.conf.ONCE['settings']['default_timeout']`` (None when unset); warns once
    that the rest of ``ONCE`` is not used."""
    conf = conf_value(app, "ONCE") if app is not None else None
    if not isinstance(conf, Mapping):
        return None
    settings = conf.get("settings")
    settings = settings if isinstance(settings, Mapping) else {}
    unused = sorted({*(k for k in conf if k != "settings"),
                     *(f"settings[{k!r}]" for k in settings if k != "default_timeout")})
    if unused:
        warn_unused_once(
            app, "ONCE",
            f"app.conf.ONCE: {', '.join(unused)} not used by celery_dlock.compat."
            f"QueueOnce: its locks live in the lock store of app.conf.dlock_url "
            f"(by default the broker's Redis, when it is one); only "
            f"settings['default_timeout'] is read")
    value = settings.get("default_timeout")
    if value is None:
        return None
    return positive_seconds("app.conf.ONCE['settings']['default_timeout']", value)


def translate_once(once: Mapping[str, Any], timeout: float | None) -> dict[str, Any]:
    """celery-dlock's options for a checked ``once`` (``timeout``: the default one)."""
    values: dict[str, Any] = {
        "lock_mode": "until_started" if once.get("unlock_before_run") else
                     "until_finished",
        "on_duplicate": "drop" if once.get("graceful") else "raise",
        "lock_queue_ttl": once.get("timeout", timeout),
    }
    if "keys" in once:
        values["lock_args"] = once["keys"]
    return values


class QueueOnce(LockedTask):
    """celery-once's ``QueueOnce`` on celery-dlock: a second ``delay`` or
    ``apply_async`` of the same call while the first is queued or running raises
    :class:`~celery_dlock.AlreadyQueued` (see the module's table)."""

    abstract = True

    #: celery-once's options: ``graceful``, ``keys``, ``timeout``,
    #: ``unlock_before_run``.
    once: ClassVar[Mapping[str, Any]] = MappingProxyType(
        {"graceful": False, "unlock_before_run": False})

    lock_mode = "until_finished"
    on_duplicate = "raise"

    #: Whether a duplicate returns celery-once's graceful result (from ``once``).
    _once_graceful: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        cls._translate_once(None)
        super().__init_subclass__(**kwargs)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        cls._translate_once(app)
        super().on_bound(app)

    @classmethod
    def _translate_once(cls, app: Any) -> None:
        name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}"
        once = check_once(f"task {name!r} option once", cls.once)
        set_translated(cls, QueueOnce, translate_once(once, default_timeout(app)))
        cls._once_graceful = bool(once.get("graceful"))

    def apply_async(self, args: Any = None, kwargs: Any = None, *more: Any,
                    **options: Any) -> Any:
        """Celery's ``apply_async``, with celery-once's per-call
        ``once={'graceful': ..., 'timeout': ..., 'unlock_before_run': ...}``.

        ``keys`` cannot change per call (it names the lock, which every caller and
        the worker must agree on): it is refused.  ``unlock_before_run``, which
        celery-once ignores per call, is honoured (``lock_mode`` of that call)."""
        graceful = self._once_graceful
        once = options.pop("once", None)
        if once is not None:
            once = check_once("apply_async(once=...)", once)
            if "keys" in once:
                raise InvalidLockConfig(
                    f"apply_async(once=...) of {self.name!r}: 'keys' cannot be set "
                    f"per call: it names the lock; set once={{'keys': [...]}} on the "
                    f"task")
            if "graceful" in once:
                graceful = once["graceful"]
                options.setdefault("on_duplicate", "drop" if graceful else "raise")
            if "timeout" in once:
                options.setdefault("lock_queue_ttl", once["timeout"])
            if "unlock_before_run" in once:
                options.setdefault("lock_mode", "until_started"
                                   if once["unlock_before_run"] else "until_finished")
        result = super().apply_async(args, kwargs, *more, **options)
        if graceful and isinstance(result, DroppedResult):
            return EagerResult(None, None, states.REJECTED)
        return result
