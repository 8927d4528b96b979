"""The worker refuses to start with a configuration that cannot work.

Connected once (``dispatch_uid``) when a :class:`~celery_dlock.LockedTask` is bound to
an app: on ``worker_init``, when the app has locked tasks, every ``dlock_*`` setting and
every locked task's options are checked (:func:`check_app`), and the Redis is found
(``dlock_url``, the broker, the result backend) and its URL parsed, without connecting:
a Redis that is down at this moment is not a configuration error.  A misconfiguration
stops the worker with one line naming the setting (URLs masked) and exit status 1,
instead of a worker that says "ready." and fails every task.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals as celery_signals

from ..core.errors import DLockError
from .backend import check_limit_supported
from .config import SETTINGS, check_conf, read_setting
from .keys import task_key_function
from .rate import check_rates_supported
from .settings import enabled

__all__ = ["check_app", "install"]

logger = logging.getLogger("celery_dlock.startup")

_installed = False
_install_lock = threading.Lock()


def _locked_tasks(app: Any) -> list[Any]:
    return [task for task in app.tasks.values()
            if callable(getattr(task, "dlock_settings", None))]


def check_app(app: Any) -> None:
    """Check ``app``'s celery-dlock configuration; raises :class:`InvalidLockConfig`
    (or another :class:`DLockError`) naming the setting."""
    check_conf(app.conf)
    for task in _locked_tasks(app):
        type(task)._dlock_check_options()  # unknown options, annotations included
        values = {option: read_setting(task, option) for option in SETTINGS}
        if values["lock_rate"] is not None and enabled(app):
            check_rates_supported(app, f"task {task.name!r} option lock_rate")
        task_key_function(type(task), task.name)
        check_limit_supported(app, read_setting(task, "lock_limit"),
                              f"task {task.name!r} option lock_limit")


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not _locked_tasks(app):
        return
    try:
        check_app(app)
    except DLockError as exc:
        # A signal receiver's exception is only logged by Celery; SystemExit is not
        # caught, so the worker stops with this line on stderr and status 1.
        raise SystemExit(f"celery-dlock: {exc}") from None


def install() -> None:
    """Connect the ``worker_init`` check (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        celery_signals.worker_init.connect(_on_worker_init, weak=False,
                                           dispatch_uid="celery_dlock.startup_check")
        _installed = True
