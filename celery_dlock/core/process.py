"""One home for what a process keeps for itself: what a forked child must not
inherit, and what a process closes when it stops.

A child made by ``fork()`` (a prefork pool's process) starts with a copy of its
parent's memory: its clients, connections, renewal threads' bookkeeping, owner tokens.
None of it is the child's: a child never renews or releases its parent's holds, and a
connection must not be shared by two processes.  Each module that keeps such state
registers how to reset it with :func:`after_fork`; one ``os.register_at_fork`` runs
them all in the child, in the order they were registered (the order modules were
imported, so a module's reset runs after those of the modules it imports).

What a process closes when it stops (its holds released first, then its sessions
and connections) is registered with :func:`at_shutdown`; :func:`shutdown` runs it,
in the order registered, each step on its own (one that raises is logged and the
next still runs).  The Celery face calls it at a worker's (or a pool child's) warm
shutdown; a standalone program may call it before it exits.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["after_fork", "at_shutdown", "resets", "shutdown", "shutdown_steps"]

logger = logging.getLogger("celery_dlock.process")

F = TypeVar("F", bound=Callable[[], object])

_resets: list[Callable[[], object]] = []


def after_fork(reset: F) -> F:
    """Run ``reset()`` in every child this process forks from now on (usable as a
    decorator).  It must not raise: a failing reset is reported by the interpreter
    and the next one still runs."""
    _resets.append(reset)
    return reset


def resets() -> tuple[Callable[[], object], ...]:
    """What a child resets, in order (for tests and for reading)."""
    return tuple(_resets)


_shutdown: list[Callable[[], object]] = []


def at_shutdown(step: F) -> F:
    """Run ``step()`` when this process stops (:func:`shutdown`), after the steps
    registered before it (usable as a decorator)."""
    _shutdown.append(step)
    return step


def shutdown_steps() -> tuple[Callable[[], object], ...]:
    """What :func:`shutdown` runs, in order (for tests and for reading)."""
    return tuple(_shutdown)


def shutdown() -> list[object]:
    """Run every step registered with :func:`at_shutdown`, in order; a step that
    raises is logged and the next one still runs.  Returns what each step returned
    (None for one that raised)."""
    results: list[object] = []
    for step in list(_shutdown):
        try:
            results.append(step())
        except Exception:
            logger.exception("celery-dlock: a shutdown step (%s) failed",
                             getattr(step, "__qualname__", step))
            results.append(None)
    return results


def _in_child() -> None:
    for reset in list(_resets):
        reset()


os.register_at_fork(after_in_child=_in_child)
