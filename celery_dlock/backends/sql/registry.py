"""What a process keeps once per server URL (the servers' connections, the renew
targets): :class:`PerUrl`, forgotten in a forked child, whose connections are the
parent's.

No driver is imported here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from ...core.process import after_fork

__all__ = ["PerUrl"]

T = TypeVar("T")


class PerUrl(Generic[T]):
    """One object per URL in this process (a forked child starts with none)."""

    def __init__(self) -> None:
        self._items: dict[str, T] = {}
        self._lock = threading.Lock()
        after_fork(self._after_fork_in_child)

    def get(self, url: str, make: Callable[[], T],
            keep: Callable[[T], bool] = lambda _: True) -> T:
        """The object of ``url``: the one kept (when ``keep`` says so), else a new
        one, ``make()``."""
        with self._lock:
            item = self._items.get(url)
            if item is None or not keep(item):
                item = self._items[url] = make()
            return item

    def values(self) -> list[T]:
        with self._lock:
            return list(self._items.values())

    def _after_fork_in_child(self) -> None:
        self._items.clear()  # the parent's connections are not the child's
        self._lock = threading.Lock()
