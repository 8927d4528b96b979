"""The holds the page lists, read once and shared for a moment.

Every list page and the summary need the store's holds under the prefix (the way
``celery dlock ls`` reads them: in batches, never one request per lock).  Several
operators, several tabs and the refresh of each would read them again and again; a
:class:`Snapshot` keeps the last read for ``max_age`` seconds (a second by default)
and every page of that moment uses it, so the store sees at most one full read per
``max_age`` however many pages are open.  A release forgets it: the next page reads
afresh.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ...core.holds import HoldInfo
from ..target import Target

__all__ = ["Snapshot"]


class Snapshot:
    """The holds of ``target``'s prefix, read at most once per ``max_age`` seconds
    (callers serialise: the app reads one page at a time)."""

    def __init__(self, target: Target, max_age: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.max_age = max_age
        self._clock = clock
        self._read_at: float | None = None
        self._holds: list[HoldInfo] = []

    def holds(self) -> list[HoldInfo]:
        now = self._clock()
        if self._read_at is None or now - self._read_at >= self.max_age:
            self._holds = list(self.target.backend().holds(self.target.prefix))
            self._read_at = self._clock()
        return self._holds

    def forget(self) -> None:
        self._read_at = None
