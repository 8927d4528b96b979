"""``Singleton``: celery-singleton's options on a :class:`~celery_dlock.LockedTask`.

Change ``from celery_singleton import Singleton, DuplicateTaskError, clear_locks`` to
``from celery_dlock.compat import ...``; the tasks stay as they are.  The options are
translated to celery-dlock's own (the enqueue is :mod:`celery_dlock.task.modes`):

==============================  ===================================================
celery-singleton                celery-dlock
==============================  ===================================================
(the default)                   ``lock_mode="until_finished"``,
                                ``on_duplicate="return_existing"``: a second
                                ``delay`` while the first is queued or running
                                returns the first's ``AsyncResult`` (same id)
``unique_on=[...]`` or ``"a"``  ``lock_args=(...)`` (``[]``: the task name alone)
``raise_on_duplicate=True``     ``on_duplicate="raise"``; the call raises
                                :class:`DuplicateTaskError` (an
                                :class:`~celery_dlock.AlreadyQueued`) with the
                                existing ``task_id``
``lock_expiry=N``               ``lock_queue_ttl=N``: how long a *queued* call keeps
                                the name (a running call keeps it until it ends,
                                with a renewed lock).  Unset: ``lock_queue_ttl``'s
                                default (one hour), never "forever"
``singleton_raise_on_duplicate``  the default of ``raise_on_duplicate``
``singleton_lock_expiry``       the default of ``lock_expiry``
``singleton_backend_url``,      not used: the locks live in the store of
``_backend_class``,             ``dlock_url``, under ``dlock_key_prefix``, keyed on
``_backend_kwargs``,            the JSON form of the arguments (a warning says so
``_key_prefix``,                once)
``_json_encoder_class``
==============================  ===================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from ..task.duplicates import AlreadyQueued
from ..task.locked_task import LockedTask
from ..task.settings import check_bool, conf_value
from .options import argument_names, positive_seconds, set_translated, warn_unused_once

__all__ = ["DuplicateTaskError", "Singleton"]

#: celery-singleton's app settings that have no meaning here.
UNUSED_CONF = ("singleton_backend_url", "singleton_backend_class",
               "singleton_backend_kwargs", "singleton_key_prefix",
               "singleton_json_encoder_class")


class DuplicateTaskError(AlreadyQueued):
    """celery-singleton's error for a duplicate with ``raise_on_duplicate``: an
    :class:`~celery_dlock.AlreadyQueued` whose ``task_id`` is the existing call's."""

    def __init__(self, message: str = "", task_id: str | None = None, *,
                 lock_name: str | None = None, countdown: float | None = None,
                 arguments: str | None = None) -> None:
        super().__init__(message, lock_name=lock_name, task_id=task_id,
                         arguments=arguments,
                         countdown=countdown)


def _app_defaults(app: Any) -> tuple[bool | None, float | None]:
    """``singleton_raise_on_duplicate`` and ``singleton_lock_expiry``, checked; warns
    once about the settings that are not used."""
    if app is None:
        return None, None
    unused = [k for k in UNUSED_CONF if conf_value(app, k) is not None]
    if unused:
        warn_unused_once(
            app, "singleton",
            f"app.conf {', '.join(unused)} not used by celery_dlock.compat.Singleton: "
            f"its locks live in the lock store of app.conf.dlock_url (by default "
            f"the broker's Redis, when it is one), under app.conf.dlock_key_prefix")
    raises = conf_value(app, "singleton_raise_on_duplicate")
    expiry = conf_value(app, "singleton_lock_expiry")
    return (None if raises is None else
            check_bool("app.conf.singleton_raise_on_duplicate", raises),
            None if expiry is None else
            positive_seconds("app.conf.singleton_lock_expiry", expiry))


class Singleton(LockedTask):
    """celery-singleton's ``Singleton`` on celery-dlock: a second ``delay`` of the same
    call while the first is queued or running returns the first's ``AsyncResult``
    (see the module's table)."""

    abstract = True

    #: The arguments that make two calls the same (None: all; a string: one).
    unique_on: ClassVar[Sequence[str] | str | None] = None
    #: Raise :class:`DuplicateTaskError` instead of returning the existing result
    #: (app: ``singleton_raise_on_duplicate``).
    raise_on_duplicate: ClassVar[bool | None] = None
    #: Seconds a queued call keeps the name (app: ``singleton_lock_expiry``).
    lock_expiry: ClassVar[float | None] = None

    _dlock_own_options = frozenset({"lock_expiry"})

    lock_mode = "until_finished"
    on_duplicate = "return_existing"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        cls._translate_singleton(None)
        super().__init_subclass__(**kwargs)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        cls._translate_singleton(app)
        super().on_bound(app)

    @classmethod
    def _translate_singleton(cls, app: Any) -> None:
        where = f"task {cls.__dict__.get('name') or cls.__qualname__!r}"
        raises, expiry = _app_defaults(app)
        if cls.raise_on_duplicate is not None:
            raises = check_bool(f"{where} option raise_on_duplicate",
                                cls.raise_on_duplicate)
        if cls.lock_expiry is not None:
            expiry = positive_seconds(f"{where} option lock_expiry", cls.lock_expiry)
        values: dict[str, Any] = {
            "on_duplicate": "raise" if raises else "return_existing",
            "lock_queue_ttl": expiry,
        }
        if cls.unique_on is not None:
            names = argument_names(f"{where} option unique_on", cls.unique_on,
                                   one_string=True)
            values["lock_args"] = names if any(names) else ()
        set_translated(cls, Singleton, values)

    def apply_async(self, *args: Any, **options: Any) -> Any:
        """Celery's ``apply_async``; a duplicate with ``raise_on_duplicate`` raises
        :class:`DuplicateTaskError` carrying the existing call's ``task_id``."""
        try:
            return super().apply_async(*args, **options)
        except DuplicateTaskError:
            raise
        except AlreadyQueued as exc:
            raise DuplicateTaskError(
                f"Attempted to queue a duplicate of task ID {exc.task_id}",
                task_id=exc.task_id, lock_name=exc.lock_name,
                countdown=exc.countdown, arguments=exc.arguments) from None
