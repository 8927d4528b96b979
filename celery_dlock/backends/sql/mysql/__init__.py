"""The MySQL and MariaDB backend (``pip install celery-dlock[mysql]``, PyMySQL): a
lease row per lock name on the server's own clock, each decision one short
transaction, waiters polling (docs/backends.md, "MySQL / MariaDB").  What it shares
with PostgreSQL is in :mod:`celery_dlock.backends.sql`; here is the dialect: its
statements, tables, errors, server, lock, backend and renewal.

Importing this package imports PyMySQL (an ImportError without it, so the backend
registry names the extra to install); nothing imports it unless asked.
"""

from __future__ import annotations

from .backend import MYSQL_SCHEMES, MySQLBackend, backend_from_url
from .lock import MySQLLock

__all__ = ["MYSQL_SCHEMES", "MySQLBackend", "MySQLLock", "backend_from_url"]
