"""Per-name rates (``lock_rate``) on PostgreSQL: the rates table's statements behind
the shared compare-and-set loop (:class:`~..rates.SqlRates`).

``{r}`` is the rates table (:mod:`.schema`), made at the first take of a process;
reading rates (``celery dlock show``, ``ls``, ``top``) never makes it.  Each
statement is one autocommitted statement on the server's clock
(``clock_timestamp()`` in microseconds), keyed as the lease rows are
(:func:`~.keys.row_key`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from psycopg import sql

from ....core.rates import RateDocument, ops_of, ops_text, slots_of, slots_text
from ..rates import RateRow, SqlRates
from ..shape import RATES_SUFFIX
from .keys import row_key, row_part, shown_name
from .server import PgServer

__all__ = ["PgRates"]

_NOW = "floor(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
_US = "floor(extract(epoch FROM {col}) * 1000000)::bigint"
_AT = "(timestamptz 'epoch' + %(expires)s::bigint * interval '1 microsecond')"
_KEY = "r.prefix = %(prefix)s AND r.name = %(name)s"

#: The clock, and the name's row if there is one (live or not).
READ = sql.SQL(
    f"SELECT c.now, r.version, r.tat, r.interval_us, r.tau_us, r.ops, r.slots, "
    f"{_US.format(col='r.expires_at')} FROM (SELECT {_NOW} AS now) c "
    f"LEFT JOIN {{r}} r ON {_KEY}")
#: The name's first row; no row back when one is there already.
INSERT = sql.SQL(
    "INSERT INTO {r} (prefix, name, shown, version, tat, interval_us, tau_us, ops, "
    "slots, expires_at) VALUES (%(prefix)s, %(name)s, %(shown)s, 1, %(tat)s, "
    f"%(interval)s, %(tau)s, %(ops)s, %(slots)s, {_AT}) "
    "ON CONFLICT (prefix, name) DO NOTHING RETURNING version")
#: The name's row, written if still at ``version``; no row back when it is not.
UPDATE = sql.SQL(
    "UPDATE {r} AS r SET version = r.version + 1, tat = %(tat)s, "
    "interval_us = %(interval)s, tau_us = %(tau)s, ops = %(ops)s, slots = %(slots)s, "
    f"expires_at = {_AT} WHERE {_KEY} AND r.version = %(version)s RETURNING r.version")
#: Every live row under a prefix, and the clock.
ROWS = sql.SQL(
    f"SELECT r.shown, c.now, r.tat, r.interval_us, r.tau_us FROM {{r}} r, "
    f"(SELECT {_NOW} AS now) c WHERE r.prefix = %(prefix)s "
    f"AND {_US.format(col='r.expires_at')} > c.now ORDER BY r.name")


def _written(document: RateDocument) -> dict[str, Any]:
    return {"tat": document.tat, "interval": document.interval, "tau": document.tau,
            "ops": ops_text(document.ops), "slots": slots_text(document.slots),
            "expires": document.expires}


class PgRates(SqlRates):
    """The rates of one PostgreSQL server (its lease table's ``_rates`` table)."""

    label = "PostgreSQL"

    def __init__(self, server: PgServer) -> None:
        self.server = server

    def _run(self, statement: sql.SQL, params: dict[str, Any], what: str,
             name: str | None) -> list[tuple[Any, ...]]:
        table = self.server.side_table(RATES_SUFFIX)
        return self.server.run(statement.format(r=table), params, what, name,
                               side=RATES_SUFFIX)

    def _read(self, prefix: str, name: str, *, create: bool = True
              ) -> tuple[int, RateRow | None]:
        if not create and not self.server.ensure_side_table(RATES_SUFFIX, name,
                                                            create=False):
            return 0, None  # no table: no state, and none is made by reading
        row_prefix, row_name = row_key(prefix, name)
        rows = self._run(READ, {"prefix": row_prefix, "name": row_name},
                         "a rate read", name)
        now, version, tat, interval, tau, ops, slots, expires = rows[0]
        if version is None:
            return int(now), None
        return int(now), RateRow(int(version), RateDocument(
            int(tat), int(interval), int(tau), ops_of(ops), slots_of(slots),
            int(expires)))

    def _insert(self, prefix: str, name: str, document: RateDocument) -> bool:
        row_prefix, row_name = row_key(prefix, name)
        return bool(self._run(INSERT, {"prefix": row_prefix, "name": row_name,
                                       "shown": shown_name(name),
                                       **_written(document)}, "a rate take", name))

    def _update(self, prefix: str, name: str, version: int,
                document: RateDocument) -> bool:
        row_prefix, row_name = row_key(prefix, name)
        return bool(self._run(UPDATE, {"prefix": row_prefix, "name": row_name,
                                       "version": version, **_written(document)},
                              "a rate take", name))

    def _rows(self, prefix: str) -> Iterator[tuple[str, int, RateDocument]]:
        if not self.server.ensure_side_table(RATES_SUFFIX, create=False):
            return
        for shown, now, tat, interval, tau in self._run(
                ROWS, {"prefix": row_part(prefix)}, "a rate read", None):
            yield str(shown), int(now), RateDocument(int(tat), int(interval), int(tau))
