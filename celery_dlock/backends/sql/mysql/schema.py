"""The MySQL/MariaDB tables: the lease table and its line of waiters, their columns,
definitions and keys (docs/backends.md, MySQL / MariaDB; the check that a table found
at their names is ours is shared: :mod:`celery_dlock.backends.sql.server`).

The lease table's columns are the shared ones (:mod:`..shape`) in MySQL's types, and
one more: the primary key ``lock_id`` is the SHA-256 of prefix and name (hex), so a
name of any length is one short key and is compared byte for byte (``prefix``,
``name`` and ``owner`` are ``BLOB``: no collation folds case or trailing blanks).
The line table (the lease table's name and ``_waiters``) has a row per blocked
acquirer: ``lock_id``, ``owner_id`` (:func:`owner_id`, the SHA-256 of the owner) and
``owner``, ``arrived_at`` (its order) and ``expires_at`` (its lease).
The rates table (the lease table's name and ``_rates``, made at the first rate take
of a process only) has a row per rated name: ``lock_id`` (as the lease row's),
``prefix`` and ``name``, ``version`` (compare-and-set), ``tat``, ``interval_us``,
``tau_us`` (server microseconds), ``ops``, ``slots`` and ``expires_at``
(:mod:`celery_dlock.core.rates`, docs/backends.md).
The markers table (the lease table's name and ``_markers``, made at the first marker
call of a process only) has a row per name sent with a ``lock_mode``: ``lock_id``,
``prefix`` and ``name``, ``version`` (compare-and-set), ``doc`` (the name's markers,
:class:`celery_dlock.core.expiring.ExpiringKeys`) and ``expires_at`` (NULL: never).
"""

from __future__ import annotations

import hashlib
import re

from ..shape import (
    GRANTS,
    MARKERS_SUFFIX,
    RATES_SUFFIX,
    SideTable,
    Tables,
    create_table,
    lease_columns,
)

__all__ = ["BLOB_MAX_BYTES", "COLUMNS", "FREE", "GRANTS", "LINE_COLUMNS",
           "MARKERS_COLUMNS", "RATES_COLUMNS", "TABLES", "create_line_sql",
           "create_markers_sql", "create_rates_sql",
           "create_sql", "lock_id", "owner_id", "quote_table"]

#: Each column and the ``DATA_TYPE`` information_schema reports for it.
COLUMNS: dict[str, str] = {"lock_id": "char", **lease_columns(
    "blob", "blob", "blob", "int", "bigint", "datetime", "datetime", "bigint",
    "text", "text", "text")}

#: The most bytes a ``BLOB`` (prefix, name) or ``TEXT`` (info) column holds.
BLOB_MAX_BYTES = 65_535

#: ``expires_at`` of a free row.
FREE = "1970-01-01 00:00:00"

#: The line table's columns, as :data:`COLUMNS`.
LINE_COLUMNS: dict[str, str] = {
    "lock_id": "char",
    "owner_id": "char",
    "owner": "blob",
    "arrived_at": "datetime",
    "expires_at": "datetime",
}

#: The rates table's columns, as :data:`COLUMNS`.
RATES_COLUMNS: dict[str, str] = {
    "lock_id": "char",
    "prefix": "blob",
    "name": "blob",
    "version": "bigint",
    "tat": "bigint",
    "interval_us": "bigint",
    "tau_us": "bigint",
    "ops": "text",
    "slots": "text",
    "expires_at": "datetime",
}

_NAME = re.compile(r"^[A-Za-z0-9_$]{1,64}(\.[A-Za-z0-9_$]{1,64})?$")


def lock_id(prefix: str, name: str) -> str:
    """The row's key of a lock: one key per (prefix, name), whatever either holds.

    A prefix without a NUL is keyed as every release before this one keyed it (the
    digest of prefix, NUL, name: the first NUL ends the prefix, so no two pairs meet
    and a rolling deploy finds the same rows).  A prefix with a NUL would make that
    ambiguous (``("a\\0b", "c")`` and ``("a", "b\\0c")``): its pair is keyed by
    the digest of a length-prefixed text written in hex, which holds no NUL and so is
    never the text of a pair of the first kind."""
    if "\x00" not in prefix:
        return hashlib.sha256(f"{prefix}\x00{name}".encode()).hexdigest()
    raw = prefix.encode()
    text = b"%d:" % len(raw) + raw + name.encode()
    return hashlib.sha256(b"dlock-lp:" + text.hex().encode()).hexdigest()


def owner_id(owner: str) -> str:
    """The line table's key of an owner (any length, compared byte for byte)."""
    return hashlib.sha256(owner.encode()).hexdigest()


def quote_table(table: str) -> str | None:
    """``table`` (``name`` or ``database.name``) quoted, or None when it is not a
    plain name."""
    if not _NAME.match(table):
        return None
    return ".".join(f"`{part}`" for part in table.split("."))


#: The markers table's columns, as :data:`COLUMNS`.
MARKERS_COLUMNS: dict[str, str] = {
    "lock_id": "char",
    "prefix": "blob",
    "name": "blob",
    "version": "bigint",
    "doc": "mediumtext",
    "expires_at": "datetime",
}

#: Every table is InnoDB, its text utf8mb4.
_OPTIONS = " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"


def create_sql(table: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for ``table`` (an already quoted name)."""
    return create_table(table, (
        "lock_id CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, "
        "prefix BLOB NOT NULL, name BLOB NOT NULL, owner BLOB NULL, "
        "`count` INT NOT NULL DEFAULT 0, fence BIGINT NOT NULL DEFAULT 0, "
        "acquired_at DATETIME(6) NULL, expires_at DATETIME(6) NOT NULL, "
        "ttl_ms BIGINT NOT NULL DEFAULT 0, info TEXT NOT NULL, ops TEXT NOT NULL, "
        "forced TEXT NULL, PRIMARY KEY (lock_id), KEY dlock_prefix (prefix(64))"),
        _OPTIONS)


def create_line_sql(table: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for the line table ``table`` (quoted)."""
    return create_table(table, (
        "lock_id CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, "
        "owner_id CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, "
        "owner BLOB NOT NULL, arrived_at DATETIME(6) NOT NULL, "
        "expires_at DATETIME(6) NOT NULL, PRIMARY KEY (lock_id, owner_id)"), _OPTIONS)


def create_rates_sql(table: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for the rates table ``table`` (quoted)."""
    return create_table(table, (
        "lock_id CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, "
        "prefix BLOB NOT NULL, name BLOB NOT NULL, version BIGINT NOT NULL, "
        "tat BIGINT NOT NULL, interval_us BIGINT NOT NULL, tau_us BIGINT NOT NULL, "
        "ops TEXT NOT NULL, slots TEXT NOT NULL, expires_at DATETIME(6) NOT NULL, "
        "PRIMARY KEY (lock_id), KEY dlock_prefix (prefix(64))"), _OPTIONS)


def create_markers_sql(table: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for the markers table ``table`` (quoted)."""
    return create_table(table, (
        "lock_id CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, "
        "prefix BLOB NOT NULL, name BLOB NOT NULL, version BIGINT NOT NULL, "
        "doc MEDIUMTEXT NOT NULL, expires_at DATETIME(6) NULL, "
        "PRIMARY KEY (lock_id), KEY dlock_prefix (prefix(64))"), _OPTIONS)


#: The tables, for the shared table check (:mod:`celery_dlock.backends.sql.server`).
TABLES = Tables(COLUMNS, create_sql, LINE_COLUMNS, create_line_sql, side=(
    SideTable(RATES_SUFFIX, "rates table", "lock_rate", RATES_COLUMNS,
              create_rates_sql),
    SideTable(MARKERS_SUFFIX, "markers table", "a lock_mode", MARKERS_COLUMNS,
              create_markers_sql)))
