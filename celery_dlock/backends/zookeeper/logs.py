"""kazoo's log, as celery-dlock passes it on (logger ``celery_dlock.kazoo``).

While an ensemble is out of reach kazoo tries to reconnect every 50-500 ms (the
retry policy of :mod:`.session`) and logs a warning for each try ("Connection
dropped: ...", "Failed connecting to Zookeeper ..."): dozens of lines a second on a
worker's log, or on the terminal of a script that configured no logging.  The first
warning of each kind in a minute is kept as it is; the repeats are demoted to DEBUG.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["REPEAT_EVERY", "kazoo_logger"]

#: Seconds between two warnings of one kind that are let through.
REPEAT_EVERY = 60.0

_LOGGER_NAME = "celery_dlock.kazoo"


class _DemoteRepeats(logging.Filter):
    """Lets the first WARNING-or-above record of each message template through once
    every :data:`REPEAT_EVERY` seconds; the others go on as DEBUG records."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[tuple[int, str], float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.levelno, str(record.msg))
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is None or now - last >= REPEAT_EVERY:
                self._last[key] = now
                return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def kazoo_logger() -> logging.Logger:
    """The logger kazoo clients are given, with its repeats demoted (once)."""
    logger = logging.getLogger(_LOGGER_NAME)
    if not any(isinstance(f, _DemoteRepeats) for f in logger.filters):
        logger.addFilter(_DemoteRepeats())
    return logger
