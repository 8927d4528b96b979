"""Queue markers on MySQL/MariaDB: the markers table's statements behind the shared
compare-and-set loop (:class:`~..markers.SqlMarkers`).

``{m}`` is the markers table (:mod:`.schema`), made at the first marker step of a
process; reading markers (``celery dlock ls``) never makes it.  ``{t}`` is the lease
table, read for the name's holder and fence.  Each statement is one autocommitted
statement on the server's clock (``UTC_TIMESTAMP(6)`` in ms since the epoch), keyed
as the lease rows are (:func:`~.schema.lock_id`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymysql

from ..markers import MarkerRow, SqlMarkers, holder_of
from ..shape import MARKERS_SUFFIX
from .schema import lock_id
from .server import MyServer
from .statements import NOW

__all__ = ["MyMarkers"]

_EPOCH = "'1970-01-01 00:00:00'"
_NOW_MS = f"TIMESTAMPDIFF(MICROSECOND, {_EPOCH}, {NOW}) DIV 1000"
_LIVE = f"l.owner IS NOT NULL AND l.expires_at > {NOW}"
_AT = f"TIMESTAMPADD(MICROSECOND, %(expires)s * 1000, {_EPOCH})"
_FENCE_IS = ("(%(lease)s IS NULL OR COALESCE((SELECT l.fence FROM {t} l "
             "WHERE l.lock_id = %(id)s), -1) = %(lease)s)")

#: The clock, the name's row (if any) and its lease row's live holder and fence.
READ = (f"SELECT {_NOW_MS}, m.version, m.doc, {_LIVE}, l.info, "
        f"IF({_LIVE}, TIMESTAMPDIFF(MICROSECOND, {_EPOCH}, l.expires_at) DIV 1000, "
        "NULL), COALESCE(l.fence, -1) FROM (SELECT 1 AS one) c "
        "LEFT JOIN {m} m ON m.lock_id = %(id)s LEFT JOIN {t} l ON l.lock_id = %(id)s")
#: The name's first row (a duplicate key when there is one; no row when the fence
#: moved).
INSERT = ("INSERT INTO {m} (lock_id, prefix, name, version, doc, expires_at) "
          f"SELECT %(id)s, %(prefix)s, %(name)s, 1, %(doc)s, {_AT} FROM DUAL "
          f"WHERE {_FENCE_IS}")
#: The name's row, written if still at ``version`` (and the fence as read).
UPDATE = ("UPDATE {m} m SET m.version = m.version + 1, m.doc = %(doc)s, "
          f"m.expires_at = {_AT} WHERE m.lock_id = %(id)s "
          f"AND m.version = %(version)s AND {_FENCE_IS}")
#: Every row under a prefix not past its expiry, and the clock.
ROWS = (f"SELECT m.name, {_NOW_MS}, m.doc FROM {{m}} m WHERE m.prefix = %(prefix)s "
        f"AND (m.expires_at IS NULL OR m.expires_at > {NOW}) ORDER BY m.name")

#: MySQL's error number of a duplicate key.
_DUPLICATE = 1062


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(
        value, (bytes, bytearray)) else str(value)


class MyMarkers(SqlMarkers):
    """The queue markers of one MySQL/MariaDB server (its lease table's
    ``_markers`` table)."""

    label = "MySQL"

    def __init__(self, server: MyServer) -> None:
        self.server = server

    def _statement(self, text: str) -> str:
        return text.format(m=self.server.side_table(MARKERS_SUFFIX),
                           t=self.server.table)

    def _read(self, prefix: str, name: str, *, create: bool = True,
              holder: bool = True) -> MarkerRow | None:
        # the holder comes with the row in the one statement, asked for or not
        if not create and not self.server.ensure_side_table(MARKERS_SUFFIX, name,
                                                            create=False):
            return None  # no table: no marker, and none is made by reading

        def work(cur: Any) -> tuple[Any, ...]:
            cur.execute(self._statement(READ), {"id": lock_id(prefix, name)})
            return tuple(cur.fetchone())

        now, version, doc, live, info, expires, fence = self.server.run(
            work, "a queue marker read", name, side=MARKERS_SUFFIX)
        now = int(now)
        return MarkerRow(now, None if version is None else int(version),
                         None if doc is None else _text(doc),
                         holder_of(live, info, expires, now), int(fence))

    def _write(self, prefix: str, name: str, version: int | None, doc: str,
               expires: int | None, lease: int | None) -> bool:
        params = {"id": lock_id(prefix, name), "doc": doc, "expires": expires,
                  "lease": lease}

        def insert(cur: Any) -> bool:
            try:
                return bool(cur.execute(self._statement(INSERT), {
                    **params, "prefix": prefix, "name": name}))
            except pymysql.err.IntegrityError as exc:
                if exc.args and exc.args[0] == _DUPLICATE:
                    return False  # another call (or this one, sent before) made it
                raise

        def update(cur: Any) -> bool:
            return bool(cur.execute(self._statement(UPDATE),
                                    {**params, "version": version}))

        return self.server.run(insert if version is None else update,
                               "a queue marker write", name, side=MARKERS_SUFFIX)

    def _rows(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        if not self.server.ensure_side_table(MARKERS_SUFFIX, create=False):
            return

        def work(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(self._statement(ROWS), {"prefix": prefix})
            return [tuple(row) for row in cur.fetchall()]

        for name, now, doc in self.server.run(work, "a queue marker read",
                                              side=MARKERS_SUFFIX):
            yield _text(name), int(now), _text(doc)
