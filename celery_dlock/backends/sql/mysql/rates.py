"""Per-name rates (``lock_rate``) on MySQL/MariaDB: the rates table's statements
behind the shared compare-and-set loop (:class:`~..rates.SqlRates`).

``{r}`` is the rates table (:mod:`.schema`), made at the first take of a process;
reading rates (``celery dlock show``, ``ls``, ``top``) never makes it.  Each
statement is one autocommitted statement on the server's clock (``UTC_TIMESTAMP(6)``
in microseconds since the epoch), keyed as the lease rows are
(:func:`~.schema.lock_id`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymysql

from ....core.rates import RateDocument, ops_of, ops_text, slots_of, slots_text
from ..rates import RateRow, SqlRates
from ..shape import RATES_SUFFIX
from .schema import lock_id
from .server import MyServer
from .statements import NOW

__all__ = ["MyRates"]

_EPOCH = "'1970-01-01 00:00:00'"
_NOW_US = f"TIMESTAMPDIFF(MICROSECOND, {_EPOCH}, {NOW})"
_EXPIRES_US = f"TIMESTAMPDIFF(MICROSECOND, {_EPOCH}, r.expires_at)"
_AT = f"TIMESTAMPADD(MICROSECOND, %(expires)s, {_EPOCH})"

#: The clock, and the name's row if there is one (live or not).
READ = (f"SELECT {_NOW_US}, r.version, r.tat, r.interval_us, r.tau_us, r.ops, "
        f"r.slots, {_EXPIRES_US} FROM (SELECT 1 AS one) c "
        "LEFT JOIN {r} r ON r.lock_id = %(id)s")
#: The name's first row (a duplicate key when one is there already).
INSERT = ("INSERT INTO {r} (lock_id, prefix, name, version, tat, interval_us, tau_us, "
          "ops, slots, expires_at) VALUES (%(id)s, %(prefix)s, %(name)s, 1, %(tat)s, "
          f"%(interval)s, %(tau)s, %(ops)s, %(slots)s, {_AT})")
#: The name's row, written if still at ``version`` (rowcount: the rows matched).
UPDATE = ("UPDATE {r} r SET r.version = r.version + 1, r.tat = %(tat)s, "
          "r.interval_us = %(interval)s, r.tau_us = %(tau)s, r.ops = %(ops)s, "
          f"r.slots = %(slots)s, r.expires_at = {_AT} "
          "WHERE r.lock_id = %(id)s AND r.version = %(version)s")
#: Every live row under a prefix, and the clock.
ROWS = (f"SELECT r.name, {_NOW_US}, r.tat, r.interval_us, r.tau_us FROM {{r}} r "
        f"WHERE r.prefix = %(prefix)s AND r.expires_at > {NOW} ORDER BY r.name")

#: MySQL's error number of a duplicate key.
_DUPLICATE = 1062


def _written(document: RateDocument) -> dict[str, Any]:
    return {"tat": document.tat, "interval": document.interval, "tau": document.tau,
            "ops": ops_text(document.ops), "slots": slots_text(document.slots),
            "expires": document.expires}


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(
        value, (bytes, bytearray)) else str(value)


class MyRates(SqlRates):
    """The rates of one MySQL/MariaDB server (its lease table's ``_rates`` table)."""

    label = "MySQL"

    def __init__(self, server: MyServer) -> None:
        self.server = server

    def _statement(self, text: str) -> str:
        return text.format(r=self.server.side_table(RATES_SUFFIX))

    def _read(self, prefix: str, name: str, *, create: bool = True
              ) -> tuple[int, RateRow | None]:
        if not create and not self.server.ensure_side_table(RATES_SUFFIX, name,
                                                            create=False):
            return 0, None  # no table: no state, and none is made by reading

        def work(cur: Any) -> tuple[Any, ...]:
            cur.execute(self._statement(READ), {"id": lock_id(prefix, name)})
            return tuple(cur.fetchone())

        now, version, tat, interval, tau, ops, slots, expires = self.server.run(
            work, "a rate read", name, side=RATES_SUFFIX)
        if version is None:
            return int(now), None
        return int(now), RateRow(int(version), RateDocument(
            int(tat), int(interval), int(tau), ops_of(_text(ops)),
            slots_of(_text(slots)), int(expires)))

    def _insert(self, prefix: str, name: str, document: RateDocument) -> bool:
        params = {"id": lock_id(prefix, name), "prefix": prefix, "name": name,
                  **_written(document)}

        def work(cur: Any) -> bool:
            try:
                cur.execute(self._statement(INSERT), params)
            except pymysql.err.IntegrityError as exc:
                if exc.args and exc.args[0] == _DUPLICATE:
                    return False  # another call (or this one, sent before) made it
                raise
            return True

        return self.server.run(work, "a rate take", name, side=RATES_SUFFIX)

    def _update(self, prefix: str, name: str, version: int,
                document: RateDocument) -> bool:
        params = {"id": lock_id(prefix, name), "version": version,
                  **_written(document)}

        def work(cur: Any) -> bool:
            return bool(cur.execute(self._statement(UPDATE), params))

        return self.server.run(work, "a rate take", name, side=RATES_SUFFIX)

    def _rows(self, prefix: str) -> Iterator[tuple[str, int, RateDocument]]:
        if not self.server.ensure_side_table(RATES_SUFFIX, create=False):
            return

        def work(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(self._statement(ROWS), {"prefix": prefix})
            return [tuple(row) for row in cur.fetchall()]

        for name, now, tat, interval, tau in self.server.run(work, "a rate read",
                                                             side=RATES_SUFFIX):
            yield _text(name), int(now), RateDocument(int(tat), int(interval),
                                                      int(tau))
