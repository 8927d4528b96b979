"""Which backend a URL asks for, as the backend registry
(:mod:`celery_dlock.core.registry`) says from its scheme (no backend is imported here).

The Redis family (``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://``,
``sentinel://``, a Redlock list) is read by :mod:`.connection` into a client; every
other backend is made from its URL alone (:func:`url_backend`).  An unknown scheme
gets one clear error.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from ..core.errors import InvalidLockConfig
from ..core.registry import Entry, entry_for, known_schemes
from ..core.urls import mask_url

__all__ = ["celery_sql_url", "check_known", "url_backend"]


#: The backends made from a client (the Celery face makes it from the URL and the app's
#: options, or a ``dlock_client`` callable returns it).
_CLIENT_KINDS = ("redis", "redlock")

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


def url_backend(url: Any) -> Entry | None:
    """The backend made from ``url`` alone (PostgreSQL, MySQL/MariaDB, ZooKeeper: any
    but the Redis family, whose client the Celery face makes), or None."""
    entry = entry_for(url)
    if entry is None or entry.kind in _CLIENT_KINDS:
        return None
    return entry


def check_known(url: Any, where: str) -> NoReturn:
    """:class:`InvalidLockConfig` for a URL of a scheme no backend reads (``where``
    names the setting), listing the known ones; the URL is shown masked."""
    shown = mask_url(url) if isinstance(url, str) else f"a {type(url).__name__}"
    raise InvalidLockConfig(f"{where} must be a URL of a known scheme (known schemes: "
                            f"{known_schemes()}), got {shown!r}")
