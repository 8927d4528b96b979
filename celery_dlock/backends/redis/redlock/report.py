"""How a Redlock names its nodes and their failures in logs and errors.

A node is named by where it is (``host:port/db`` or ``unix://path?db=N``), never by its
URL: no password reaches a log line.  A node that answers a call with an error (out of
memory, a read-only replica, a missing ACL permission) refused that call; it is
reported at most once a minute per node, operation and kind of error, so a node that
refuses every write does not flood the log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

__all__ = ["address", "describe", "describe_error", "report_refusals",
           "warn_now_and_then"]

logger = logging.getLogger("celery_dlock.redlock")

#: The shortest time between two reports of one node's refusals of one kind (seconds).
REPORT_EVERY = 60.0

_LOCAL_HOSTS = {"localhost": "127.0.0.1", "::1": "127.0.0.1",
                "ip6-localhost": "127.0.0.1"}
_reported: dict[tuple[str, str, str], float] = {}
_reported_lock = threading.Lock()


def _spelled(client: Any) -> tuple[Any, ...] | None:
    """Where ``client`` connects, as it spells it: ``("tcp", host, port, db)`` or
    ``("unix", path, db)``; None when unknown."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        return None
    db = int(kwargs.get("db", 0) or 0)
    if kwargs.get("path"):
        return ("unix", str(kwargs["path"]), db)
    if "host" in kwargs:
        return ("tcp", str(kwargs["host"]), int(kwargs.get("port", 6379) or 6379), db)
    return None


def address(client: Any) -> tuple[Any, ...] | None:
    """Where ``client`` connects, as a comparable tuple: ``("tcp", host, port, db)``
    (the loopback names spelled one way) or ``("unix", path, db)`` (the real path);
    None when unknown.  ``address(c)[:-1]`` names the server."""
    where = _spelled(client)
    if where is None:
        return None
    if where[0] == "unix":
        return ("unix", os.path.realpath(where[1]), where[2])
    host = where[1].lower()
    return ("tcp", _LOCAL_HOSTS.get(host, host), where[2], where[3])


def describe(client: Any, index: int | None = None) -> str:
    """``host:port/db`` (or ``unix://path?db=N``) of ``client`` as it spells them,
    without credentials; ``node N`` when it cannot tell."""
    where = _spelled(client)
    if where is None:
        return f"node {index}" if index is not None else "a node"
    if where[0] == "unix":
        return f"unix://{where[1]}?db={where[2]}"
    host = f"[{where[1]}]" if ":" in where[1] else where[1]
    return f"{host}:{where[2]}/{where[3]}"


def describe_error(error: BaseException | None) -> str:
    """``OutOfMemoryError: command not allowed ...``; ``no answer in time`` for None."""
    if error is None:
        return "no answer in time"
    return f"{type(error).__name__}: {error}"


def _due(key: tuple[str, str, str]) -> bool:
    """Whether a report of ``key`` is due (none in the last :data:`REPORT_EVERY`)."""
    now = time.monotonic()
    with _reported_lock:
        last = _reported.get(key)
        if last is not None and now - last < REPORT_EVERY:
            return False
        if len(_reported) > 10_000:  # many servers over a long life: start afresh
            _reported.clear()
        _reported[key] = now
        return True


def warn_now_and_then(key: tuple[str, str, str], message: str, *args: Any) -> None:
    """``logger.warning(message, *args)``, at most once a minute per ``key``; debug
    in between."""
    if _due(key):
        logger.warning(message, *args)
    else:
        logger.debug(message, *args)


def report_refusals(name: str, what: str, clients: Sequence[Any],
                    errors: Sequence[BaseException | None]) -> None:
    """Log, as a warning, each node whose call of ``what`` was answered with an error
    (``errors[i]``, None for a node that did not refuse)."""
    for i, error in enumerate(errors):
        if not isinstance(error, ResponseError):
            continue
        where = describe(clients[i], i)
        warn_now_and_then((where, what, type(error).__name__),
                          "lock %r: Redlock node %s refused the %s (%s); the quorum is "
                          "counted without it (reported at most once a minute)", name,
                          where, what, describe_error(error))
