"""What the lease and line tables (and the side tables, each made only where a task
needs it: the rates table for ``lock_rate``, the markers table for a ``lock_mode``)
of every SQL dialect share: the lease row's columns, the GRANTs a user who may not
create tables needs, and the refusal of a table of another shape at their names
(PostgreSQL: :mod:`.postgres.schema`, MySQL/MariaDB: :mod:`.mysql.schema`).

No driver is imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...core.errors import LockKeyConflict

__all__ = ["DEFAULT_TABLE", "GRANTS", "LEASE_COLUMNS", "LINE_SUFFIX", "MARKERS_SUFFIX",
           "RATES_SUFFIX", "SIDE_GRANTS", "SideTable", "Tables", "check_shape",
           "create_table", "lease_columns", "line_table_of", "missing_columns",
           "rates_table_of", "side_table_of"]

#: The table's name unless told otherwise (``?dlock_table=`` in the URL).
DEFAULT_TABLE = "dlock_locks"

#: The line table's name is the lease table's and this.
LINE_SUFFIX = "_waiters"

#: The rates table's name is the lease table's and this (``lock_rate`` only).
RATES_SUFFIX = "_rates"

#: The markers table's name is the lease table's and this (a ``lock_mode`` other than
#: ``while_running`` only).
MARKERS_SUFFIX = "_markers"

#: The lease row's columns, in the dialects' order.
LEASE_COLUMNS = ("prefix", "name", "owner", "count", "fence", "acquired_at",
                 "expires_at", "ttl_ms", "info", "ops", "forced")

#: What a user who may not create tables needs on the tables made for it beforehand
#: (``{table}`` the lease table, ``{line}`` its line).
GRANTS = ("GRANT SELECT, INSERT, UPDATE ON {table} TO <user>; "
          "GRANT SELECT, INSERT, UPDATE, DELETE ON {line} TO <user>")

#: What such a user needs besides on a side table (``{table}``), only where a task
#: needs it (``{needs}``).
SIDE_GRANTS = "GRANT SELECT, INSERT, UPDATE ON {table} TO <user> (only for {needs})"


def line_table_of(table: str) -> str:
    """The line table's name beside the lease table ``table`` (``schema.table``
    keeps its schema)."""
    return table + LINE_SUFFIX


def rates_table_of(table: str) -> str:
    """The rates table's name beside the lease table ``table`` (``schema.table``
    keeps its schema)."""
    return side_table_of(table, RATES_SUFFIX)


def side_table_of(table: str, suffix: str) -> str:
    """The side table ``suffix``'s name beside the lease table ``table``."""
    return table + suffix


def lease_columns(*types: str) -> dict[str, str]:
    """Each of :data:`LEASE_COLUMNS` and its type in a dialect (``types`` in their
    order)."""
    return dict(zip(LEASE_COLUMNS, types, strict=True))


@dataclass(frozen=True)
class SideTable:
    """A table beside the lease table, made at the first call that needs it (so a
    user who needs none of it needs neither the table nor its GRANT): its name's
    suffix, what it is in messages, what needs it, its columns and its DDL."""

    suffix: str
    what: str
    needs: str
    columns: dict[str, str]
    create: Callable[[str], str]


@dataclass(frozen=True)
class Tables:
    """A dialect's tables: each one's columns (name and the type the server reports
    for it) and its ``CREATE TABLE`` (given the quoted name); the side tables the
    dialect keeps (rates, markers)."""

    columns: dict[str, str]
    create: Callable[[str], str]
    line_columns: dict[str, str]
    create_line: Callable[[str], str]
    side: tuple[SideTable, ...] = ()


def create_table(table: str, columns: str, options: str = "") -> str:
    """``CREATE TABLE IF NOT EXISTS`` for ``table`` (an already quoted name) with
    ``columns`` (their definitions and keys) and the dialect's table ``options``."""
    return f"CREATE TABLE IF NOT EXISTS {table} ({columns}){options}"


def missing_columns(found: dict[str, str], wanted: dict[str, str]) -> list[str]:
    """The columns (``name type``) of ``wanted`` a table with columns ``found``
    lacks (types compared as the server reports them, in lower case)."""
    return [f"{col} {kind}" for col, kind in wanted.items()
            if found.get(col, "").lower() != kind]


def check_shape(shown: str, name: str, what: str, missing: list[str],
                lock_name: str | None) -> None:
    """Refuse the table ``name`` found at the server ``shown`` when it lacks the
    ``missing`` columns (``name type``) of celery-dlock's ``what``."""
    if missing:
        raise LockKeyConflict(
            f"a table {name} at {shown} is not celery-dlock's {what} (it "
            f"lacks {', '.join(missing)}); nothing was changed: name another "
            f"with ?dlock_table=", lock_name=lock_name)
