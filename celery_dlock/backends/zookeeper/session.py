"""ZooKeeper sessions: one kazoo client per ensemble and session timeout, per process.

A ZooKeeper hold is an ephemeral node, and an ephemeral node lives exactly as long as
the session that created it.  So the session timeout *is* the ttl: the server deletes
a dead (or frozen, or cut off) holder's nodes once it has heard nothing from its
session for that long, counted on the server's clock.  Locks are therefore grouped by
ttl: every lock of one ensemble whose ttl rounds to the same session timeout shares
one :class:`ZkSession` (one connection, one heartbeat), and a process with one ttl has
one session per ensemble however many holds it keeps.

A session timeout is never shorter than :data:`MIN_SESSION_TIMEOUT`: kazoo's own ping
(every third of the timeout, less up to 0.4 s of jitter) cannot keep a shorter
session alive reliably.  A lock with a shorter ttl still has its local deadline at
its ttl (it is told then, and deletes its node), but a holder that dies keeps the lock
until its session ends, up to :data:`MIN_SESSION_TIMEOUT`.

The server may grant another timeout than asked (it clamps to its
``minSessionTimeout`` and ``maxSessionTimeout``).  A longer one is kept (a dead
holder's lock then waits that long); a shorter one would let the server free a hold
before its holder's deadline, so a lock whose ttl exceeds what the server grants is
refused (:class:`~celery_dlock.InvalidLockConfig`) before anything is written.

When the server expires a session (kazoo's ``LOST``), every hold taken on it is
reported lost at once; nodes created under an expired session are never counted as
held again, even while the server is still deleting them.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, TypeVar

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry

from ...core.errors import BackendUnavailable, InvalidLockConfig
from ...core.process import after_fork, at_shutdown
from .answers import UNAVAILABLE, error_for, meaning_of
from .logs import kazoo_logger
from .url import ZkSpec

__all__ = ["CALL_TIMEOUT", "MAX_SESSION_MS", "MIN_SESSION_TIMEOUT", "ZkSession",
           "close_sessions", "session_for"]

logger = logging.getLogger("celery_dlock.zookeeper")

#: The shortest session timeout asked for (seconds); see the module text.
MIN_SESSION_TIMEOUT = 2.0
#: The longest session timeout ZooKeeper can keep (ms): a signed 32-bit count.
MAX_SESSION_MS = 2**31 - 1
#: The longest any one call waits for its reply (seconds; the session timeout when
#: shorter): a server that does not answer is BackendUnavailable, not a hang.
CALL_TIMEOUT = 10.0

_T = TypeVar("_T")


class ZkSession:
    """One kazoo client (one ZooKeeper session at a time) and what happened to it."""

    def __init__(self, spec: ZkSpec, timeout_ms: int) -> None:
        self.spec = spec
        self.timeout_ms = timeout_ms
        self._lock = threading.Lock()
        self._started = False
        #: The session timeout the server granted (ms), once connected.
        self.granted_ms: int | None = None
        #: Session ids this client had that are over (their nodes are not ours).
        self.dead: set[int] = set()
        self._last_id: int | None = None
        #: Lock objects with a hold on this session, told when it expires.
        self.holders: weakref.WeakSet[Any] = weakref.WeakSet()
        #: Its renew target (:func:`.renewal.renew_target`).
        self.renew_target: Any = None
        # kazoo encodes the credential itself (bytes fail in its connection thread).
        auth = [("digest", spec.digest)] if spec.digest else None
        self.client = KazooClient(
            hosts=spec.connect_string, timeout=timeout_ms / 1000.0, auth_data=auth,
            connection_retry=KazooRetry(max_tries=-1, delay=0.05, max_delay=0.5,
                                        max_jitter=0.05),
            command_retry=None, logger=kazoo_logger())
        self._adapt_connection()
        self.client.add_listener(self._on_state)

    def connect_attempt_timeout(self) -> float:
        """How long one connection attempt may wait for the server (seconds): the
        URL's ``connect_timeout``, at most a third of the session timeout, at least
        1 s."""
        return min(self.spec.connect_timeout, max(1.0, self.timeout_ms / 3000.0))

    def _adapt_connection(self) -> None:
        # kazoo keeps the negotiated timeout to itself: it returns the read timeout
        # (two thirds of it) from its connection handler's _connect.  And it waits
        # for the server's answer to a connection request as long as the whole
        # session timeout: a server that took the connection but never answers it
        # (one restarting, or starved) would keep a reconnecting client from trying
        # again until the session is over.  One attempt waits at most
        # connect_attempt_timeout(); then kazoo tries again.
        conn = getattr(self.client, "_connection", None)
        connect = getattr(conn, "_connect", None)
        invoke = getattr(conn, "_invoke", None)
        handler = getattr(self.client, "handler", None)
        create = getattr(handler, "create_connection", None)
        if conn is None or connect is None or invoke is None or create is None:
            return  # pragma: no cover - another kazoo

        def _connect(*args: Any) -> Any:
            reply = connect(*args)
            try:
                self.granted_ms = round(float(reply[0]) * 1.5)
            except (TypeError, ValueError, IndexError):  # pragma: no cover
                pass
            return reply

        def _invoke(timeout: float, *args: Any, **kwargs: Any) -> Any:
            return invoke(min(timeout, self.connect_attempt_timeout()), *args, **kwargs)

        def _create_connection(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("timeout") is not None:
                kwargs["timeout"] = min(kwargs["timeout"],
                                        self.connect_attempt_timeout())
            return create(*args, **kwargs)

        conn._connect = _connect
        conn._invoke = _invoke
        handler.create_connection = _create_connection  # type: ignore[union-attr]

    # -- state --------------------------------------------------------------------------

    def _on_state(self, state: str) -> None:
        # kazoo's thread: never block here.
        if state == KazooState.LOST:
            lost = self._last_id
            if lost is not None:
                self.dead.add(lost)
            holders = list(self.holders)
            if holders:
                threading.Thread(target=self._tell, args=(holders, lost), daemon=True,
                                 name="celery-dlock-zk-lost").start()

    @staticmethod
    def _tell(holders: list[Any], session_id: int | None) -> None:
        for lock in holders:
            try:
                lock._session_expired(session_id)
            except Exception:  # a callback must not stop the others
                logger.exception("telling %r of its expired session failed", lock)

    def session_id(self) -> int:
        """The current session's id (noting the end of an earlier one)."""
        sid = int(self.client.client_id[0]) if self.client.client_id else 0
        with self._lock:
            if self._last_id is not None and sid and sid != self._last_id:
                self.dead.add(self._last_id)
            if sid:
                self._last_id = sid
        return sid

    def is_ours(self, ephemeral_owner: int) -> bool:
        """Whether a node of session ``ephemeral_owner`` can still be a live hold (not
        one of this client's expired sessions)."""
        return ephemeral_owner not in self.dead

    # -- connecting ---------------------------------------------------------------------

    def start(self, what: str, lock_name: str | None = None) -> KazooClient:
        """The connected client; BackendUnavailable when the ensemble does not answer
        within the connect timeout."""
        with self._lock:
            if not self._started:
                try:
                    self.client.start(timeout=self.spec.connect_timeout)
                except (KazooTimeoutError, KazooException, OSError) as exc:
                    try:
                        self.client.stop()
                        self.client.close()
                    except Exception:  # pragma: no cover - best effort
                        pass
                    if meaning_of(exc)[0] != UNAVAILABLE:  # credentials, SASL, ...
                        raise (error_for(exc, what, lock_name) or
                               BackendUnavailable(str(exc), lock_name=lock_name)
                               ) from exc
                    raise BackendUnavailable(
                        f"ZooKeeper unavailable during {what}: no answer from "
                        f"{','.join(self.spec.hosts)} within "
                        f"{self.spec.connect_timeout:g}s ({type(exc).__name__})",
                        lock_name=lock_name) from exc
                self._started = True
        self.session_id()
        return self.client

    def check_ttl(self, ttl_ms: int, lock_name: str) -> None:
        """InvalidLockConfig when the server granted a shorter session than ``ttl_ms``
        (it would free holds before their holders' deadlines)."""
        granted = self.granted_ms
        if granted is not None and granted < ttl_ms:
            raise InvalidLockConfig(
                f"ZooKeeper granted a session timeout of {granted / 1000:g}s, shorter "
                f"than the lock's ttl of {ttl_ms / 1000:g}s (its maxSessionTimeout, "
                f"20 tickTimes by default): lower the ttl or raise the server's "
                f"maxSessionTimeout", lock_name=lock_name)

    def wait(self, what: str, result: Any, lock_name: str | None = None,
             where: str | None = None) -> Any:
        """Wait for a kazoo async result, at most :data:`CALL_TIMEOUT` (or the session
        timeout): kazoo's answers about a node (no node, bad version, ...) are raised
        as they are; every other exception as :mod:`.answers` maps it (a lost
        connection, an expired session or no answer: BackendUnavailable)."""
        timeout = min(CALL_TIMEOUT, max(self.timeout_ms / 1000.0, 1.0))
        try:
            return result.get(timeout=timeout)
        except KazooTimeoutError as exc:
            raise BackendUnavailable(f"ZooKeeper did not answer during {what} within "
                                     f"{timeout:g}s", lock_name=lock_name) from exc
        except (KazooException, OSError) as exc:
            error = error_for(exc, what, lock_name, where)
            if error is None:
                raise
            raise error from exc

    def stop(self) -> None:
        with self._lock:
            if self._started:
                self._started = False
                try:
                    self.client.stop()
                    self.client.close()
                except Exception:  # pragma: no cover - best effort
                    pass


_sessions: dict[tuple[ZkSpec, int], ZkSession] = {}
_sessions_lock = threading.Lock()


def session_timeout_ms(ttl_ms: int) -> int:
    """The session timeout a lock with this ttl uses (see the module text)."""
    return max(ttl_ms, round(MIN_SESSION_TIMEOUT * 1000))


def session_for(spec: ZkSpec, ttl_ms: int) -> ZkSession:
    """This process's session of ``spec`` for a lock with ``ttl_ms`` (no server call)."""
    key = (spec, session_timeout_ms(ttl_ms))
    with _sessions_lock:
        found = _sessions.get(key)
        if found is None:
            found = _sessions[key] = ZkSession(spec, key[1])
        return found


@at_shutdown
def _close_all() -> None:
    close_sessions()  # after the holds were released: their nodes go with them


def close_sessions(host: str | None = None) -> None:
    """Stop every session of this process (only those of ensembles that list
    ``host``, a ``host:port``, when given): tests, or a process about to exit."""
    with _sessions_lock:
        keys = [k for k in _sessions if host is None or host in k[0].hosts]
        sessions = [_sessions.pop(k) for k in keys]
    for session in sessions:
        session.stop()


def _after_fork_in_child() -> None:
    global _sessions, _sessions_lock
    # The parent's kazoo threads do not exist here: a child starts its own sessions.
    _sessions = {}
    _sessions_lock = threading.Lock()


after_fork(_after_fork_in_child)
