"""Which backend a URL asks for, by its scheme (no backend is imported here).

The Redis family (``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://``,
``sentinel://``, a Redlock list) is read by :mod:`.connection`; the schemes of the
other backends are named here, so that the configuration check and the door
(:mod:`.backend`) agree on them, and an unknown scheme gets one clear error.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from ..core.errors import InvalidLockConfig
from ..core.urls import mask_url

__all__ = ["KNOWN_SCHEMES", "SQL_SCHEMES", "celery_sql_url", "check_known", "sql_kind"]

#: The URL schemes of the backends other than Redis (SQL databases, ZooKeeper), and
#: the backend each names: the door (:mod:`.backend`) makes them from the URL alone.
SQL_SCHEMES = {"postgresql": "postgres", "postgres": "postgres",
               "mysql": "mysql", "mariadb": "mysql", "zookeeper": "zookeeper"}
#: Every scheme a lock URL may have, for error messages.
KNOWN_SCHEMES = ("redis://, rediss://, unix://, redis+cluster://, sentinel://, "
                 "redlock://a;redlock://b;redlock://c (or a list of 3+ Redis URLs), "
                 "postgresql://, postgres://, mysql://, mariadb://, "
                 "zookeeper://host:port[,host:port][/chroot]")


# Celery's spellings of a PostgreSQL broker (kombu's SQLAlchemy transport) and result
# backend, with an optional SQLAlchemy driver: sqla+postgresql+psycopg://...
_CELERY_SQL = re.compile(r"^(?:db|sqla)\+(?:postgresql|postgres)(?:\+[A-Za-z0-9_]+)?://",
                         re.IGNORECASE)


def celery_sql_url(value: Any) -> str | None:
    """A Celery broker or result backend URL naming PostgreSQL
    (``db+postgresql://``, ``sqla+postgresql+psycopg://``, ...) as the lock backend
    reads it (``postgresql://...``); None for anything else."""
    if not isinstance(value, str):
        return None
    found = _CELERY_SQL.match(value)
    return None if found is None else "postgresql://" + value[found.end():]


def _scheme(url: Any) -> str | None:
    if not isinstance(url, str) or "://" not in url:
        return None
    return url.split("://", 1)[0].lower()


def sql_kind(url: Any) -> str | None:
    """The backend other than Redis that ``url`` names (``postgres``, ``mysql``,
    ``zookeeper``), or None."""
    scheme = _scheme(url)
    return SQL_SCHEMES.get(scheme) if scheme is not None else None


def check_known(url: Any, where: str) -> NoReturn:
    """:class:`InvalidLockConfig` for a URL of a scheme no backend reads (``where``
    names the setting), listing the known ones; the URL is shown masked."""
    shown = mask_url(url) if isinstance(url, str) else f"a {type(url).__name__}"
    raise InvalidLockConfig(f"{where} must be a URL of a known scheme (known schemes: "
                            f"{KNOWN_SCHEMES}), got {shown!r}")
