"""One home for what a process keeps for itself and a forked child must not inherit.

A child made by ``fork()`` (a prefork pool's process) starts with a copy of its
parent's memory: its clients, connections, renewal threads' bookkeeping, owner tokens.
None of it is the child's: a child never renews or releases its parent's holds, and a
connection must not be shared by two processes.  Each module that keeps such state
registers how to reset it with :func:`after_fork`; one ``os.register_at_fork`` runs
them all in the child, in the order they were registered (the order modules were
imported, so a module's reset runs after those of the modules it imports).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["after_fork", "resets"]

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


def _in_child() -> None:
    for reset in list(_resets):
        reset()


os.register_at_fork(after_in_child=_in_child)
