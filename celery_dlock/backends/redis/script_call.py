"""How a script call reaches the server: one ``EVALSHA`` (or ``EVAL``) through the
client's own connection pool, sent the way redis-py sends a command, with less of
redis-py's general machinery around it.

For a plain :class:`redis.Redis` (its ``execute_command``, ``evalsha`` and ``eval``
not replaced by a subclass or an instrumentation wrapper, not a single-connection
client), :func:`run` takes a
connection from the client's pool (``get_connection``, which checks it is usable as
for any command), packs the call once in the RESP form redis-py would send (each
argument encoded by the connection's own ``encoder``: the client's encoding, its
errors setting, and its refusal of a type it cannot send), sends it and reads the
reply, re-sending on a failure exactly as the client's command path does (the
connection's ``retry``, disconnecting between tries), and gives the connection back
to the pool.  So ``max_connections``, ``pool.disconnect()``, ``client.close()``, the
health check and the re-send policy govern the lock's calls as they govern the
application's own.  What it leaves out: redis-py's generic per-command steps that a
script call does not need (option parsing, response callbacks, which ``EVALSHA`` has
none of, and the per-command metrics of redis-py's observability hooks: the lock's
script calls are not in those).  It costs the client about a quarter less per call
(benchmarks/README.md, issue 34's round).

Any other client (a cluster client, a subclass with its own ``execute_command``, an
instrumented one), and every client on redis-py 4 (which sends every argument as
UTF-8 whatever the client's encoding), is called through its own
``evalsha``/``eval`` (:class:`~.lua.LuaScript` asks :func:`plain` first).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import redis
from redis import ConnectionPool, Redis
from redis.connection import Encoder  # type: ignore[attr-defined]  # (4.x to 8.x)

__all__ = ["plain", "run"]

#: redis-py's own ``execute_command``, ``evalsha`` and ``eval``, as this module found
#: them.  A client whose class has another of any of them (a subclass's, or an
#: instrumentation's wrapper put on the class, at any time) is called through it.
_STOCK = (Redis.__dict__.get("execute_command"), getattr(Redis, "evalsha", None),
          getattr(Redis, "eval", None))
#: (``type()``, not ``isinstance``: a wrapper object may claim to be a function.)
#: redis-py 4 keeps its own path (see the module's note on encodings).
_USABLE = (all(type(f) is types.FunctionType for f in _STOCK)
           and int(redis.__version__.split(".")[0]) >= 5)


def plain(client: Any) -> bool:
    """Whether ``client`` is a redis-py client whose command path is redis-py's own,
    on a pool of its own connections."""
    kind = type(client)
    return (_USABLE and kind.execute_command is _STOCK[0] and kind.evalsha is _STOCK[1]
            and kind.eval is _STOCK[2] and getattr(client, "connection", None) is None
            and isinstance(getattr(client, "connection_pool", None), ConnectionPool))


def _get_connection(pool: ConnectionPool) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py before 5.3 names the command
        return pool.get_connection("EVALSHA")


def _packed(encoder: Any, args: Sequence[Any]) -> bytes:
    # A str (every argument the lock's scripts are given but the numbers) is encoded
    # here as redis-py's own Encoder does it, with the connection's encoding and
    # errors setting, without the type checks that come first there; anything else,
    # and every argument of another encoder class, goes through ``encoder.encode``.
    text = ((encoder.encoding, encoder.encoding_errors) if type(encoder) is Encoder
            else None)
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if text is not None and type(arg) is str:
            data = arg.encode(*text)
        else:
            data = bytes(encoder.encode(arg))
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


def run(client: Any, *args: Any) -> Any:
    """Send ``args`` (``EVALSHA sha numkeys keys... args...``, or ``EVAL``) with a
    :func:`plain` client and return the reply; a server error is raised as redis-py
    raises it (``NoScriptError``, ``ResponseError``...), a connection that fails as
    the client's re-send policy leaves it."""
    pool = client.connection_pool
    conn = _get_connection(pool)
    try:
        packed = [_packed(conn.encoder, args)]

        def attempt() -> Any:
            conn.send_packed_command(packed)
            return conn.read_response()

        def failed(_: BaseException) -> None:
            conn.disconnect()

        return conn.retry.call_with_retry(attempt, failed)
    finally:
        try:
            should_reconnect = getattr(conn, "should_reconnect", None)
            if should_reconnect is not None and should_reconnect():
                conn.disconnect()
                conn.connect()
        finally:
            pool.release(conn)
