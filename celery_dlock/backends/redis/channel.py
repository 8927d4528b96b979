"""Script calls on a few connections of their own: the short path of a plain client.

A LockedTask makes two script calls per run (acquire, release).  Through
``client.evalsha`` each call also pays for redis-py's pool: taking and giving back a
connection (its health probe, its event and metrics hooks) and the command wrapper
around it, which on redis-py 8 costs more CPU than packing, sending and reading the
call itself.  A :class:`ScriptChannel` keeps up to :data:`CHANNEL_CONNECTIONS`
connections made with the client's own connection settings (host, TLS, ACL user,
timeouts, re-send policy) and sends each script on one of them:

* **Same re-sends.**  A call is made with the connection's ``Retry`` exactly as
  ``Redis.execute_command`` makes it: on an error that policy names, the connection
  is closed and the call sent again (the scripts' operation ids make a re-send
  harmless); otherwise the error is raised as the client would raise it.
* **Bounded.**  At most :data:`CHANNEL_CONNECTIONS` per client and process; a call
  that finds them all busy (many threads at once) goes through the client as before,
  so the user's pool limits still bound the rest.
* **Only where it is the same.**  Only an exact ``redis.Redis`` with a plain pool, no
  single-connection mode and no client-side cache has a channel.  Subclasses
  (which may override ``execute_command``), Cluster, Sentinel-managed pools and other
  clients go through the client.
* **Packed here.**  With the client's default encoding (UTF-8, strict) and a
  connection class that packs as redis-py does, a call is packed by
  :func:`~celery_dlock.backends.redis.resp.pack` into the same bytes, at a third of
  the cost of redis-py's Python packer; anything else is packed by redis-py.
* **Fork-safe.**  A child process starts with no channels: it never writes on its
  parent's sockets.  A channel goes with its client (weakly referenced), which closes
  its connections when it is collected.
"""

from __future__ import annotations

import codecs
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import ResponseError

from .bounded import PLAIN_POOLS
from .resp import pack

__all__ = ["CHANNEL_CONNECTIONS", "ScriptChannel", "channel_of"]

#: The most connections a client's channel keeps (per process).
CHANNEL_CONNECTIONS = 4


class ScriptChannel:
    """Connections of their own for one client's script calls (see the module text)."""

    __slots__ = ("__weakref__", "_class", "_idle", "_kwargs", "_lock", "_made",
                 "_packs")

    def __init__(self, pool: Any) -> None:
        self._class = pool.connection_class
        self._kwargs = dict(pool.connection_kwargs)
        self._idle: list[Any] = []
        self._made = 0
        self._lock = threading.Lock()
        self._packs = _packs_as_redis_py(self._class, self._kwargs)

    def _take(self) -> Any:
        try:
            return self._idle.pop()
        except IndexError:
            pass
        with self._lock:
            if self._made >= CHANNEL_CONNECTIONS:
                return None
            self._made += 1
        return self._class(**self._kwargs)

    def call(self, args: Sequence[Any]) -> Any:
        """Send one command, return its reply; ``NotImplemented`` when every
        connection of the channel is busy (the caller then goes through the client)."""
        conn = self._take()
        if conn is None:
            return NotImplemented
        packed = pack(args) if self._packs else None

        def send_and_read() -> Any:
            if packed is None:
                conn.send_command(*args)
            else:
                conn.send_packed_command((packed,))
            return conn.read_response()

        try:
            return conn.retry.call_with_retry(send_and_read,
                                              lambda _error: conn.disconnect())
        except ResponseError:
            raise  # the whole reply was read: the connection is fine
        except BaseException:
            # A timeout, a reset, an interrupt half-way through a reply: whatever
            # is left on the socket must not be read as the next call's reply.
            conn.disconnect()
            raise
        finally:
            self._idle.append(conn)

    def close(self) -> None:
        """Disconnect the idle connections (a busy one is disconnected by its user)."""
        while self._idle:
            self._idle.pop().disconnect()


def _packs_as_redis_py(connection_class: Any, kwargs: dict[str, Any]) -> bool:
    """Whether :func:`.resp.pack` makes the bytes these connections would send: the
    default encoding, and ``send_command`` as redis-py's own ``Connection`` has it."""
    try:
        utf8 = codecs.lookup(kwargs.get("encoding", "utf-8")).name == "utf-8"
    except LookupError:
        return False
    return (utf8 and kwargs.get("encoding_errors", "strict") == "strict"
            and getattr(connection_class, "send_command", None)
            is redis.connection.Connection.send_command)


_channels: weakref.WeakKeyDictionary[Any, ScriptChannel | None] = \
    weakref.WeakKeyDictionary()
_channels_lock = threading.Lock()


def _eligible(client: Any) -> bool:
    if type(client) is not redis.Redis or getattr(client, "connection", None) is not None:
        return False
    pool = getattr(client, "connection_pool", None)
    return type(pool) in PLAIN_POOLS and getattr(pool, "cache", None) is None


def channel_of(client: Any) -> ScriptChannel | None:
    """``client``'s channel in this process, made on first use; None for a client that
    has none (see the module text)."""
    try:
        return _channels[client]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable
        return None
    with _channels_lock:
        channel = _channels.get(client)
        if channel is None and client not in _channels:
            channel = ScriptChannel(client.connection_pool) if _eligible(client) \
                else None
            _channels[client] = channel
            if channel is not None:  # its sockets are closed, not left to the GC
                weakref.finalize(client, channel.close)
        return channel


def _forget_channels() -> None:
    global _channels, _channels_lock
    _channels = weakref.WeakKeyDictionary()
    _channels_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_channels)
