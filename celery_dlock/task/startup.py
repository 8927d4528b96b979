"""The worker refuses to start with a configuration that cannot work.

Connected once (``dispatch_uid``) when a :class:`~celery_dlock.LockedTask` is bound to
an app: on ``worker_init``, when the app has locked tasks, every ``dlock_*`` setting and
every locked task's options are checked (:func:`check_app`), and the store is found
(``dlock_url``, the broker, the result backend) and its URL parsed.  Then the store
itself is checked (:func:`check_store`, as ``celery dlock check`` does: its version,
eviction policy, a lock taken and released, so a table without its grants shows
here).  A misconfiguration, or a store that cannot keep locks, stops the worker with
one line per problem (URLs masked) and exit status 1, instead of a worker that says
"ready." and fails every task.  A store that does not answer at this moment is not a
configuration error: the worker starts and says so (its locked tasks fail closed
until the store answers); so does a problem that may pass (one Redlock node down).
``dlock_check_at_start = False`` leaves the store unchecked at start.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals as celery_signals

from ..core.errors import BackendUnavailable, DLockError
from .backend import (
    backend_for,
    check_limit_supported,
    check_markers_supported,
    forget_app,
)
from .config import SETTINGS, check_conf, read_setting
from .keys import task_key_function
from .rate import check_rates_supported
from .settings import conf_value, enabled

__all__ = ["check_app", "check_store", "install"]

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
        if enabled(app):
            check_markers_supported(app, values["lock_mode"],
                                    f"task {task.name!r} option lock_mode")


def check_store(app: Any) -> list[str]:
    """Check ``app``'s lock store as ``celery dlock check`` does, under every prefix
    its locked tasks use; the lasting problems (one line each), after logging the
    others.  A store that does not answer is logged, not a problem."""
    if not enabled(app) or conf_value(app, "dlock_check_at_start", True) is False:
        return []
    prefixes = sorted({str(read_setting(task, "lock_prefix"))
                       for task in _locked_tasks(app)})
    lasting: list[str] = []
    try:
        backend = backend_for(app)  # a Cluster's client connects as it is made
        for prefix in prefixes:
            for problem in backend.check(prefix):
                if problem.lasting:
                    lasting.append(f"the {backend.kind} lock store: {problem}")
                else:
                    logger.warning("celery-dlock: the %s lock store: %s", backend.kind,
                                   problem)
    except BackendUnavailable as exc:
        logger.warning("celery-dlock: the lock store does not answer (%s); the worker "
                       "starts, and its locked tasks fail closed until it answers", exc)
    finally:
        # What the check made is not kept: the first task reads the settings as
        # they are then, as without the check.
        forget_app(app)
    return lasting


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not _locked_tasks(app):
        return
    try:
        check_app(app)
        problems = check_store(app)
    except DLockError as exc:
        # A signal receiver's exception is only logged by Celery; SystemExit is not
        # caught, so the worker stops with this line on stderr and status 1.
        raise SystemExit(f"celery-dlock: {exc}") from None
    if problems:
        raise SystemExit("\n".join(f"celery-dlock: {p}" for p in problems))


def install() -> None:
    """Connect the ``worker_init`` check (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        celery_signals.worker_init.connect(_on_worker_init, weak=False,
                                           dispatch_uid="celery_dlock.startup_check")
        _installed = True
