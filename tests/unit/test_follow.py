"""Which sends are inside a canvas (a duplicate there is sent as a follower, so its own
id gets an outcome: celery_dlock/task/follow.py), read from the options Celery's own
canvas code gives ``send_task`` (an in-memory broker; what a follower does on a worker
is tests/integration/test_modes.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery, chain, chord, group

from celery_dlock.task.follow import in_canvas


def sends(route: Callable[[Any], Any]) -> list[bool]:
    """``in_canvas`` of each send that ``route(task)`` makes, in order."""
    app = Celery("follow-unit", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    seen: list[bool] = []
    original = app.send_task

    def send_task(name: str, args: Any = None, kwargs: Any = None,
                  **options: Any) -> Any:
        seen.append(in_canvas(options))
        return original(name, args, kwargs, **options)

    app.send_task = send_task  # type: ignore[method-assign]

    @app.task(shared=False, name="f")
    def f(x: Any = None) -> Any:
        return x

    route(f)
    app.close()
    return seen


@pytest.mark.parametrize(("route", "expected"), [
    (lambda f: f.delay(1), [False]),
    (lambda f: f.apply_async((1,)), [False]),
    (lambda f: f.apply_async((1,), task_id="given"), [False]),
    (lambda f: f.s(1).apply_async(), [False]),
    (lambda f: f.apply_async((1,), countdown=5, expires=60), [False]),
    (lambda f: f.apply_async((1,), link=f.s()), [True]),
    (lambda f: f.apply_async((1,), link_error=f.si()), [True]),
    (lambda f: group(f.si(1), f.si(2)).apply_async(), [True, True]),
    (lambda f: chord([f.si(1), f.si(2)], f.s()).apply_async(), [True, True]),
    (lambda f: chain(f.si(1), f.s()).apply_async(), [True]),
], ids=["delay", "apply_async", "task_id", "signature", "countdown", "link",
        "link_error", "group", "chord", "chain"])
def test_only_canvas_members_are_in_a_canvas(route: Callable[[Any], Any],
                                             expected: list[bool]) -> None:
    assert sends(route) == expected
