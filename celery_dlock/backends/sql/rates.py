"""Per-name rates (``lock_rate``) in a SQL table, for every dialect:
:class:`SqlRates`, the compare-and-set loop around the one decision
(:func:`celery_dlock.core.rates.gcra_take`).

A take reads the name's row and the server's clock in one statement, decides in
Python, and writes the new state back in one statement that changes the row only if
no one wrote it since (``version``), or inserts it only if there is none; when that
changes nothing, another call got there first, and it reads again.  Every statement
is autocommitted on its own (no session state: a pooler may sit between), and a
re-sent one (a lost reply) is harmless: its compare-and-set then fails, and the read
after it finds the call's operation id and its first answer.  A row past its
``expires_at`` counts as none (a later write of the name overwrites it).

The dialect (PostgreSQL: :mod:`.postgres.rates`) sends the statements.  No driver is
imported here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from ...core.errors import BackendUnavailable
from ...core.rates import (
    Rate,
    RateDecision,
    RateDocument,
    RateState,
    TakesByOperation,
    gcra_take,
    interval_tau,
    rate_state,
)

__all__ = ["TRIES", "RateRow", "SqlRates"]

#: How many times a take reads and tries to write before giving up (the row kept
#: changing under it: :class:`BackendUnavailable`).
TRIES = 100


class RateRow(NamedTuple):
    """A name's row as read: its ``version`` and state."""

    version: int
    document: RateDocument


class SqlRates(TakesByOperation):
    """The :class:`~celery_dlock.core.protocol.RateStore` of one SQL server (the
    dialect subclasses it with its statements)."""

    #: The database's name in messages.
    label = ""

    # -- what a dialect provides ----------------------------------------------------

    def _read(self, prefix: str, name: str, *, create: bool = True
              ) -> tuple[int, RateRow | None]:
        """The server's clock (us) and ``name``'s row (live or not), or None; with
        ``create`` false, (0, None) where the table was never made (none is)."""
        raise NotImplementedError

    def _insert(self, prefix: str, name: str, document: RateDocument) -> bool:
        """Insert ``name``'s first row; False (nothing changed) when there is one."""
        raise NotImplementedError

    def _update(self, prefix: str, name: str, version: int,
                document: RateDocument) -> bool:
        """Write ``name``'s row if still at ``version``; False when it is not."""
        raise NotImplementedError

    def _rows(self, prefix: str) -> Iterator[tuple[str, int, RateDocument]]:
        """Every live row under ``prefix``: the name as shown, the server's clock,
        the state."""
        raise NotImplementedError

    # -- the store ------------------------------------------------------------------

    def take_op(self, prefix: str, name: str, rate: Rate, slot: int | None,
                op: str) -> RateDecision:
        """:meth:`take` as the call ``op`` (the same op twice takes one slot)."""
        interval, tau = interval_tau(rate)
        for _ in range(TRIES):
            now, row = self._read(prefix, name)
            live = row.document if row is not None and row.document.expires > now \
                else None
            answer = gcra_take(live, now, interval, tau,
                               None if slot is None else int(slot), op)
            written = answer.document is None or (
                self._insert(prefix, name, answer.document) if row is None
                else self._update(prefix, name, row.version, answer.document))
            if written:
                if answer.code == 1:
                    return RateDecision(True)
                return RateDecision(False, answer.wait_us / 1_000_000, answer.given_us)
        raise BackendUnavailable(
            f"{self.label}: the rate state of {name!r} kept changing under this call "
            f"({TRIES} tries); try again", lock_name=name)

    def state(self, prefix: str, name: str) -> RateState | None:
        now, row = self._read(prefix, name, create=False)
        if row is None or row.document.expires <= now:
            return None
        doc = row.document
        return rate_state(doc.tat, doc.interval, doc.tau, now)

    def states(self, prefix: str) -> Iterator[tuple[str, RateState]]:
        """Every name under ``prefix`` with a live rate state, each once."""
        for shown, now, doc in self._rows(prefix):
            yield shown, rate_state(doc.tat, doc.interval, doc.tau, now)
