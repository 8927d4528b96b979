"""Queue markers on PostgreSQL: the markers table's statements behind the shared
compare-and-set loop (:class:`~..markers.SqlMarkers`).

``{m}`` is the markers table (:mod:`.schema`), made at the first marker step of a
process; reading markers (``celery dlock ls``) never makes it.  ``{t}`` is the lease
table, read for the name's holder and fence.  Each statement is one autocommitted
statement on the server's clock (``clock_timestamp()`` in ms), keyed as the lease
rows are (:func:`~.keys.row_key`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from psycopg import sql

from ..markers import MarkerRow, SqlMarkers, holder_of
from ..shape import MARKERS_SUFFIX
from .keys import row_key, row_part, shown_name
from .server import PgServer

__all__ = ["PgMarkers"]

_NOW = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
_LIVE = "l.owner IS NOT NULL AND l.expires_at > clock_timestamp()"
_AT = "(timestamptz 'epoch' + %(expires)s::bigint * interval '1 millisecond')"
_FENCE_IS = ("(%(lease)s::bigint IS NULL OR COALESCE((SELECT l.fence FROM {t} l "
             "WHERE l.prefix = %(prefix)s AND l.name = %(name)s), -1) = %(lease)s)")

#: The clock, the name's row (if any) and its lease row's live holder and fence.
READ = sql.SQL(
    f"SELECT c.now, m.version, m.doc, {_LIVE}, l.info, CASE WHEN {_LIVE} THEN "
    "floor(extract(epoch FROM l.expires_at) * 1000)::bigint END, "
    "COALESCE(l.fence, -1) FROM (SELECT " + _NOW + " AS now) c "
    "LEFT JOIN {m} m ON m.prefix = %(prefix)s AND m.name = %(name)s "
    "LEFT JOIN {t} l ON l.prefix = %(prefix)s AND l.name = %(name)s")
#: The name's first row; no row back when there is one, or the fence moved.
INSERT = sql.SQL(
    "INSERT INTO {m} (prefix, name, shown, version, doc, expires_at) "
    f"SELECT %(prefix)s, %(name)s, %(shown)s, 1, %(doc)s, {_AT} WHERE {_FENCE_IS} "
    "ON CONFLICT (prefix, name) DO NOTHING RETURNING version")
#: The name's row, written if still at ``version`` (and the fence as read).
UPDATE = sql.SQL(
    "UPDATE {m} AS m SET version = m.version + 1, doc = %(doc)s, "
    f"expires_at = {_AT} WHERE m.prefix = %(prefix)s AND m.name = %(name)s "
    f"AND m.version = %(version)s AND {_FENCE_IS} RETURNING m.version")
#: Every row under a prefix not past its expiry, and the clock.
ROWS = sql.SQL(
    f"SELECT m.shown, c.now, m.doc FROM {{m}} m, (SELECT {_NOW} AS now) c "
    "WHERE m.prefix = %(prefix)s AND (m.expires_at IS NULL "
    "OR m.expires_at > clock_timestamp()) ORDER BY m.name")


class PgMarkers(SqlMarkers):
    """The queue markers of one PostgreSQL server (its lease table's ``_markers``
    table)."""

    label = "PostgreSQL"

    def __init__(self, server: PgServer) -> None:
        self.server = server

    def _run(self, statement: sql.SQL, params: dict[str, Any], what: str,
             name: str | None) -> list[tuple[Any, ...]]:
        query = statement.format(m=self.server.side_table(MARKERS_SUFFIX),
                                 t=self.server.table)
        return self.server.run(query, params, what, name, side=MARKERS_SUFFIX)

    def _read(self, prefix: str, name: str, *, create: bool = True,
              holder: bool = True) -> MarkerRow | None:
        # the holder comes with the row in the one statement, asked for or not
        if not create and not self.server.ensure_side_table(MARKERS_SUFFIX, name,
                                                            create=False):
            return None  # no table: no marker, and none is made by reading
        row_prefix, row_name = row_key(prefix, name)
        rows = self._run(READ, {"prefix": row_prefix, "name": row_name},
                         "a queue marker read", name)
        now, version, doc, live, info, expires, fence = rows[0]
        now = int(now)
        return MarkerRow(now, None if version is None else int(version), doc,
                         holder_of(live, info, expires, now), int(fence))

    def _write(self, prefix: str, name: str, version: int | None, doc: str,
               expires: int | None, lease: int | None) -> bool:
        row_prefix, row_name = row_key(prefix, name)
        params = {"prefix": row_prefix, "name": row_name, "doc": doc,
                  "expires": expires, "lease": lease}
        if version is None:
            return bool(self._run(INSERT, {**params, "shown": shown_name(name)},
                                  "a queue marker write", name))
        return bool(self._run(UPDATE, {**params, "version": version},
                              "a queue marker write", name))

    def _rows(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        if not self.server.ensure_side_table(MARKERS_SUFFIX, create=False):
            return
        for shown, now, doc in self._run(ROWS, {"prefix": row_part(prefix)},
                                         "a queue marker read", None):
            yield str(shown), int(now), str(doc)
