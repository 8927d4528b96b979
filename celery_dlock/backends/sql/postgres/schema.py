"""The tables of the PostgreSQL backend: the lease table and its line of waiters,
their columns and definitions (the check that a table found at their names is ours
is shared: :mod:`celery_dlock.backends.sql.server`).

One row per lock name, kept after release (it carries the name's fence counter, which
must never repeat), see docs/backends.md::

    prefix, name        the lock (primary key)
    owner               the holder's owner token; NULL while free
    count               acquires not yet released (re-entry); 0 while free
    fence               the last fencing token given for this name
    acquired_at         when the current hold was taken (the server's clock)
    expires_at          when it lapses unless renewed ('-infinity' while free)
    ttl_ms              the longest ttl the hold was taken or extended with (ms)
    info                the hold's metadata (task id, worker, host, pid), JSON
    ops                 the latest operation ids (a re-sent call is answered alike)
    forced              who released the last hold by force and why, JSON

Beside it, the line of waiters (:func:`~..shape.line_table_of`: the lease table's
name and ``_waiters``), one row per blocked acquirer::

    prefix, name, owner the lock and the waiter (primary key)
    arrived_at          when it joined the line (the server's clock): the order
    expires_at          when its place lapses unless it tries again (its lease)

And, made at the first rate call of a process only (``lock_rate``), the rates table
(:func:`~..shape.rates_table_of`: the lease table's name and ``_rates``), one row per
rated name (:mod:`celery_dlock.core.rates`; every time in server microseconds)::

    prefix, name        the name, keyed as its lease row (primary key)
    shown               the name as ``celery dlock ls`` shows it (a NUL as ``\\0``)
    version             bumped at every write (compare-and-set)
    tat                 the theoretical arrival time
    interval_us, tau_us the rate's interval and (burst - 1) * interval
    ops                 the last answers (" op:code:slot", newest first)
    slots               the reserved slots not yet claimed (" slot" each)
    expires_at          when the state lapses (one second after tat): a row past
                        it counts as none

And, made at the first marker call of a process only (a ``lock_mode`` other than
``while_running``), the markers table (the lease table's name and ``_markers``), one
row per name sent with a mode (:mod:`celery_dlock.core.marker_steps`)::

    prefix, name        the name, keyed as its lease row (primary key)
    shown               the name as ``celery dlock ls`` shows it
    version             bumped at every write (compare-and-set)
    doc                 the name's marker, claim record, replaced and waiting calls
                        (:class:`celery_dlock.core.expiring.ExpiringKeys`, JSON)
    expires_at          when the last of them lapses (NULL: never); a row past it
                        counts as empty
"""

from __future__ import annotations

from ..shape import (
    MARKERS_SUFFIX,
    RATES_SUFFIX,
    SideTable,
    Tables,
    create_table,
    lease_columns,
)

__all__ = ["COLUMNS", "LINE_COLUMNS", "MARKERS_COLUMNS", "RATES_COLUMNS", "TABLES",
           "create_line_sql", "create_markers_sql", "create_rates_sql", "create_sql"]

#: Each column and the type PostgreSQL reports for it (``format_type``).
COLUMNS: dict[str, str] = lease_columns(
    "text", "text", "text", "integer", "bigint", "timestamp with time zone",
    "timestamp with time zone", "bigint", "jsonb", "text[]", "jsonb")

#: The line table's columns, as :data:`COLUMNS`.
LINE_COLUMNS: dict[str, str] = {
    "prefix": "text",
    "name": "text",
    "owner": "text",
    "arrived_at": "timestamp with time zone",
    "expires_at": "timestamp with time zone",
}


#: The rates table's columns, as :data:`COLUMNS`.
RATES_COLUMNS: dict[str, str] = {
    "prefix": "text",
    "name": "text",
    "shown": "text",
    "version": "bigint",
    "tat": "bigint",
    "interval_us": "bigint",
    "tau_us": "bigint",
    "ops": "text",
    "slots": "text",
    "expires_at": "timestamp with time zone",
}


#: The markers table's columns, as :data:`COLUMNS`.
MARKERS_COLUMNS: dict[str, str] = {
    "prefix": "text",
    "name": "text",
    "shown": "text",
    "version": "bigint",
    "doc": "text",
    "expires_at": "timestamp with time zone",
}


def create_sql(table: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for ``table`` (an already quoted identifier)."""
    return create_table(table, (
        "prefix text NOT NULL, name text NOT NULL, owner text, "
        "count integer NOT NULL DEFAULT 0, fence bigint NOT NULL, "
        "acquired_at timestamptz, expires_at timestamptz NOT NULL, "
        "ttl_ms bigint NOT NULL DEFAULT 0, "
        "info jsonb NOT NULL DEFAULT '{}', ops text[] NOT NULL DEFAULT '{}', "
        "forced jsonb, PRIMARY KEY (prefix, name)"))


def create_line_sql(table: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for the line table ``table`` (quoted)."""
    return create_table(table, (
        "prefix text NOT NULL, name text NOT NULL, owner text NOT NULL, "
        "arrived_at timestamptz NOT NULL, expires_at timestamptz NOT NULL, "
        "PRIMARY KEY (prefix, name, owner)"))


def create_rates_sql(table: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for the rates table ``table`` (quoted)."""
    return create_table(table, (
        "prefix text NOT NULL, name text NOT NULL, shown text NOT NULL, "
        "version bigint NOT NULL, tat bigint NOT NULL, interval_us bigint NOT NULL, "
        "tau_us bigint NOT NULL, ops text NOT NULL DEFAULT '', "
        "slots text NOT NULL DEFAULT '', expires_at timestamptz NOT NULL, "
        "PRIMARY KEY (prefix, name)"))


def create_markers_sql(table: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for the markers table ``table`` (quoted)."""
    return create_table(table, (
        "prefix text NOT NULL, name text NOT NULL, shown text NOT NULL, "
        "version bigint NOT NULL, doc text NOT NULL, expires_at timestamptz, "
        "PRIMARY KEY (prefix, name)"))


#: The tables, for the shared table check (:mod:`celery_dlock.backends.sql.server`).
TABLES = Tables(COLUMNS, create_sql, LINE_COLUMNS, create_line_sql, side=(
    SideTable(RATES_SUFFIX, "rates table", "lock_rate", RATES_COLUMNS,
              create_rates_sql),
    SideTable(MARKERS_SUFFIX, "markers table", "a lock_mode", MARKERS_COLUMNS,
              create_markers_sql)))
