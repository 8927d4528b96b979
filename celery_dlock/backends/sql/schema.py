"""The lease table of the SQL backends: its definition, the check that a table found
at its name is ours, and the words of a refusal.

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
"""

from __future__ import annotations

__all__ = ["COLUMNS", "DEFAULT_TABLE", "GRANTS", "create_sql", "missing_columns"]

#: The table's name unless told otherwise (``?dlock_table=`` in the URL).
DEFAULT_TABLE = "dlock_locks"

#: Each column and the type PostgreSQL reports for it (``format_type``).
COLUMNS: dict[str, str] = {
    "prefix": "text",
    "name": "text",
    "owner": "text",
    "count": "integer",
    "fence": "bigint",
    "acquired_at": "timestamp with time zone",
    "expires_at": "timestamp with time zone",
    "ttl_ms": "bigint",
    "info": "jsonb",
    "ops": "text[]",
    "forced": "jsonb",
}

#: What a user who may not create tables needs on a table made for it beforehand.
GRANTS = "GRANT SELECT, INSERT, UPDATE ON {table} TO <user>"


def create_sql(table: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for ``table`` (an already quoted identifier)."""
    return (f"CREATE TABLE IF NOT EXISTS {table} ("
            "prefix text NOT NULL, name text NOT NULL, owner text, "
            "count integer NOT NULL DEFAULT 0, fence bigint NOT NULL, "
            "acquired_at timestamptz, expires_at timestamptz NOT NULL, "
            "ttl_ms bigint NOT NULL DEFAULT 0, "
            "info jsonb NOT NULL DEFAULT '{}', ops text[] NOT NULL DEFAULT '{}', "
            "forced jsonb, PRIMARY KEY (prefix, name))")


def missing_columns(found: dict[str, str]) -> list[str]:
    """The columns (``name type``) a table with columns ``found`` lacks."""
    return [f"{col} {kind}" for col, kind in COLUMNS.items() if found.get(col) != kind]
