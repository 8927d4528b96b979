"""Ctrl-C for a command that must clean up: asked for by the first press, forced by the
second.

Python turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread happens
to be.  When that is a finaliser (a client's ``__del__`` run by the garbage collector),
Python prints "Exception ignored in ..." with a traceback and drops the exception: the
command goes on as if nothing had been pressed.  So the first press only records the
request, and the command's loops call :meth:`CtrlC.check` at each step, which raises
there, where it cannot be dropped; :meth:`CtrlC.sleep` is a wait that checks as it
goes.  A second press raises at once, for a step that blocks (a server that stopped
answering).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["CtrlC"]


class CtrlC:
    """The presses of Ctrl-C while :meth:`installed` is in force."""

    #: The longest a :meth:`sleep` goes without a check, in seconds.
    STEP = 0.05

    def __init__(self) -> None:
        self.presses = 0

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.presses += 1
        if self.presses > 1:
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if Ctrl-C was pressed."""
        if self.presses:
            raise KeyboardInterrupt

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``; raise ``KeyboardInterrupt`` within :attr:`STEP` of a
        press (a plain ``time.sleep`` resumes after the handler returns)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.check()
            time.sleep(min(left, self.STEP))
        self.check()

    @contextmanager
    def installed(self) -> Iterator[CtrlC]:
        """Handle SIGINT as described above for the duration (main thread only: a
        signal handler can be set nowhere else; elsewhere nothing changes)."""
        self.presses = 0
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)
