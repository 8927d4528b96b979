"""Ctrl-C of the demo and of top is never lost in a finaliser (ops.interrupt)."""

from __future__ import annotations

import gc
import signal
import sys
import threading
import time
from typing import Any

import pytest

from celery_dlock.ops.interrupt import CtrlC


class _PressedWhileFinalised:
    """Ctrl-C arrives while the garbage collector runs this object's ``__del__``, as it
    did in a redis client's during the demo."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


def _finalise_one() -> None:
    _PressedWhileFinalised()  # dropped at once: __del__ runs here
    gc.collect()


@pytest.fixture
def dropped(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The exceptions Python drops (and would print as "Exception ignored in ...")."""
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


def test_python_drops_a_keyboard_interrupt_raised_in_a_finaliser(
        dropped: list[Any]) -> None:
    """Why the helper exists: with Python's own handler the press is dropped, and the
    code after it runs on."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _finalise_one()
        ran_on = True
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ran_on
    assert [type(d.exc_value) for d in dropped] == [KeyboardInterrupt]


def test_a_press_in_a_finaliser_stops_the_loop_at_its_next_check(
        dropped: list[Any]) -> None:
    ctrl_c = CtrlC()
    steps = 0
    with ctrl_c.installed(), pytest.raises(KeyboardInterrupt):
        for steps in range(1, 100):
            if steps == 3:
                _finalise_one()
            ctrl_c.check()
    assert steps == 3
    assert dropped == []


def test_a_second_press_interrupts_at_once() -> None:
    ctrl_c = CtrlC()
    with ctrl_c.installed():
        signal.raise_signal(signal.SIGINT)
        assert ctrl_c.presses == 1
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_the_previous_handler_comes_back_and_presses_start_from_none() -> None:
    ctrl_c = CtrlC()
    before = signal.getsignal(signal.SIGINT)
    with ctrl_c.installed():
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    with ctrl_c.installed():
        ctrl_c.check()  # the earlier press is not carried over
    assert ctrl_c.presses == 0


def test_a_press_ends_a_sleep_within_a_step() -> None:
    ctrl_c = CtrlC()
    press = threading.Timer(0.2, signal.raise_signal, args=(signal.SIGINT,))
    with ctrl_c.installed():
        started = time.monotonic()
        press.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                ctrl_c.sleep(30)
        finally:
            press.cancel()
        took = time.monotonic() - started
    assert 0.15 < took < 5  # a plain time.sleep would have run its 30 s


def test_an_unpressed_sleep_runs_its_length() -> None:
    ctrl_c = CtrlC()
    started = time.monotonic()
    ctrl_c.sleep(0.2)
    assert time.monotonic() - started >= 0.2
