"""What the ``dlock_eager`` fixture does: run an app's tasks eagerly, in the test, with
the real lock on the app's real Redis.

``task.delay(...)`` then runs the body in the calling thread, as an attempt of its own
(a fresh owner, as on a worker): it contends with a ``dlock_hold`` and with any other
holder, and the contention policy applies as for any eager run: ``skip`` returns the
skip result (``celery_dlock.is_skipped``), ``raise`` raises ``LockNotAcquired``,
``wait`` waits then raises, ``retry`` raises (an eager run cannot be re-queued).
Enqueue-time modes (``lock_mode``) do not apply: an eager call is never queued.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ..task.backend import forget_app

__all__ = ["EAGER_SETTINGS", "Eager"]

#: What :class:`Eager` sets, and restores afterwards.
EAGER_SETTINGS: dict[str, Any] = {
    "task_always_eager": True,
    "task_eager_propagates": True,  # an exception of the body reaches the test
    "dlock_enabled": True,  # real locks, also where the app turned them off
}

_App = TypeVar("_App")


class Eager:
    """``eager(app)`` sets :data:`EAGER_SETTINGS` on ``app`` (and returns it);
    :meth:`restore` puts back what each app had, also a setting it never set."""

    def __init__(self) -> None:
        #: Per app: each setting's earlier value, or None when the app had not set it.
        self._saved: list[tuple[Any, dict[str, tuple[Any] | None]]] = []

    def __call__(self, app: _App, **settings: Any) -> _App:
        """Make ``app``'s calls eager with real locks; more ``app.conf`` settings for
        the test may be given as keywords (``result_backend="cache+memory://"``).

        The app's tasks read their ``dlock_*`` settings afresh (also those that ran
        before), and again after :meth:`restore`: a setting of one test never
        reaches the next.  To change a policy for one call only, pass it with the
        call (``task.apply_async(args, on_contention="skip")``)."""
        conf = getattr(app, "conf", None)
        if conf is None or not hasattr(conf, "changes"):
            raise TypeError(f"dlock_eager: {app!r} is not a Celery app")
        wanted = {**EAGER_SETTINGS, **settings}
        saved: dict[str, tuple[Any] | None] = {}
        for key, value in wanted.items():
            saved[key] = (conf.changes[key],) if key in conf.changes else None
            conf[key] = value
        self._saved.append((app, saved))
        forget_app(app)  # what the tasks and the app cached from the old settings
        return app

    def restore(self) -> None:
        """Put every app's settings back, the latest change first, and drop what its
        tasks cached from the test's settings (they read the app's again)."""
        while self._saved:
            app, saved = self._saved.pop()
            conf = app.conf
            for key, old in saved.items():
                if old is None:
                    conf.changes.pop(key, None)
                else:
                    conf[key] = old[0]
            forget_app(app)
