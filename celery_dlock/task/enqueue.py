"""Where every enqueue of an app passes: its ``send_task``.

``delay``, ``apply_async``, ``signature.apply_async``, chains, groups, chords, beat
and retries all publish through ``app.send_task``, and so does a producer that sends a
task by name.  When the first :class:`~celery_dlock.LockedTask` is bound to an app, the
app's ``send_task`` is wrapped once (:func:`install`) to

* move lock options given as keywords (``apply_async(..., lock_mode="throttle")``)
  into the message's headers, checked, where they travel with the call;
* hand a call whose ``lock_mode`` is not ``while_running`` to
  :mod:`celery_dlock.task.modes` (imported then, not before).

With the default mode a send costs a dictionary look-up and nothing else: no round
trip, no import of the marker code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .attempt import interrupts_deferred
from .config import take_call_options
from .settings import enabled

__all__ = ["install", "original_send_task"]

_ORIGINAL = "_dlock_original_send_task"
#: ``Celery.send_task``'s positional parameters after ``kwargs``.
_POSITIONAL = ("countdown", "eta", "task_id", "producer", "connection", "router",
               "result_cls", "expires", "publisher", "link", "link_error")


def original_send_task(app: Any) -> Callable[..., Any]:
    """The app's ``send_task`` as it was before :func:`install` (itself if never)."""
    original: Callable[..., Any] = app.__dict__.get(_ORIGINAL) or app.send_task
    return original


def install(app: Any) -> None:
    """Wrap ``app.send_task`` once (idempotent)."""
    if app.__dict__.get(_ORIGINAL) is not None:
        return
    original = app.send_task

    def send_task(name: str, args: Any = None, kwargs: Any = None, *more: Any,
                  **options: Any) -> Any:
        if more:  # Celery's positional parameters after kwargs, by name
            if len(more) > len(_POSITIONAL):
                raise TypeError(f"send_task() takes at most {3 + len(_POSITIONAL)} "
                                f"positional arguments")
            for pname, value in zip(_POSITIONAL, more, strict=False):
                if pname in options:
                    raise TypeError(f"send_task() got multiple values for {pname!r}")
                options[pname] = value
        return _send(app, original, name, args, kwargs, options)

    send_task.__doc__ = original.__doc__
    setattr(app, _ORIGINAL, original)
    app.send_task = send_task


def _send(app: Any, original: Callable[..., Any], name: str, args: Any, kwargs: Any,
          options: dict[str, Any]) -> Any:
    per_call = take_call_options(options)
    mode = per_call.get("lock_mode")
    task = None
    if mode is None:
        task = app.tasks.get(name)
        settings_of = getattr(task, "dlock_settings", None)
        if settings_of is None:
            return original(name, args, kwargs, **options)
        mode = settings_of()["lock_mode"]
    if mode == "while_running" or not enabled(app):
        return original(name, args, kwargs, **options)
    from . import modes  # noqa: PLC0415 (only calls with a mode pay for its import)

    # Sent from a body (lock_lost_action="interrupt"): an interrupt between the
    # marker's claim and the publish would leave the marker with nothing published.
    with interrupts_deferred():
        return modes.send(app, original,
                          task if task is not None else app.tasks.get(name),
                          name, args, kwargs, options, per_call)
