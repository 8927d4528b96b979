"""The ``lock_rate`` state of lock names as operators see it: read through a
backend's optional ``rates()`` capability, and written as a cell or a line
(``celery dlock ls``, ``show`` and ``top``)."""

from __future__ import annotations

from typing import Any

from ..core.rates import RateState

__all__ = ["rate_cell", "rate_state", "rate_states", "rate_text"]


def rate_state(backend: Any, prefix: str, key: str) -> RateState | None:
    """The lock_rate state of ``key`` (None: no call lately, or a backend that keeps
    no rates)."""
    rates = getattr(backend, "rates", None)
    return None if rates is None else rates().state(prefix, key)


def rate_states(backend: Any, prefix: str) -> dict[str, RateState]:
    """Every lock_rate state under ``prefix``, by name (none on a backend that keeps
    no rates)."""
    rates = getattr(backend, "rates", None)
    return {} if rates is None else dict(rates().states(prefix))


def rate_cell(rate: RateState | None) -> str | None:
    """A rate's state in a table cell: free now of its burst, next slot."""
    if rate is None:
        return None
    return f"{rate.available}/{rate.burst} next {rate.next_in:.2f}s"


def rate_text(rate: RateState) -> str:
    """A rate's state in one line."""
    return (f"{rate.available} of {rate.burst} may start now, next slot in "
            f"{rate.next_in:.3f}s (one every {rate.interval:.3f}s)")
