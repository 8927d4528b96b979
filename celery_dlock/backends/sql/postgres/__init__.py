"""The PostgreSQL backend (``pip install celery-dlock[postgres]``, psycopg 3): a lease
row per lock name on the server's own clock, waiters woken by ``LISTEN``/``NOTIFY``
(docs/backends.md, "PostgreSQL").  What it shares with MySQL/MariaDB is in
:mod:`celery_dlock.backends.sql`; here is the dialect: its statements, tables, errors,
server, lock, backend and renewal.

Importing this package imports psycopg (an ImportError without it, so the backend
registry names the extra to install); nothing imports it unless asked.
"""

from __future__ import annotations

from .backend import POSTGRES_SCHEMES, PostgresBackend, backend_from_url
from .lock import PostgresLock

__all__ = ["POSTGRES_SCHEMES", "PostgresBackend", "PostgresLock", "backend_from_url"]
