"""What each exception kazoo can raise means here: one table, :data:`ANSWERS`.

Every exception of ``kazoo.exceptions`` (kazoo 2.x), kazoo's timeout and the socket's
``OSError`` is listed, in the order :func:`error_for` checks them (a subclass before
its base).  Each is one of:

* :data:`ANSWER`: the server's answer about a node (gone, changed, there, not empty):
  raised as it is, for the caller to act on (the lock's reads and writes do);
* :data:`CONFLICT`: the path is another application's (an ephemeral node where the
  lock keeps children): :class:`~celery_dlock.LockKeyConflict`, nothing changed;
* :data:`CONFIG`: the same call would be refused again on a healthy ensemble (an ACL,
  the credentials, a quota, a server without what the lock needs):
  :class:`~celery_dlock.InvalidLockConfig`, never a reason to run a body unlocked;
* :data:`UNAVAILABLE`: the ensemble could not be reached, did not answer, lost the
  session or is cut off from its quorum: :class:`~celery_dlock.BackendUnavailable`;
* :data:`UNEXPECTED`: an answer to a call the lock never makes (a transaction, a
  watcher, a reconfiguration, kazoo's recipes): a plain
  :class:`~celery_dlock.DLockError` saying so, never taken for an outage.

A kazoo exception this table does not list (a later kazoo's) is
:data:`UNAVAILABLE`, the fail-closed reading.
"""

from __future__ import annotations

from kazoo import exceptions as kz
from kazoo.handlers.threading import KazooTimeoutError

from ...core.errors import (
    BackendUnavailable,
    DLockError,
    InvalidLockConfig,
    LockKeyConflict,
)

__all__ = ["ANSWER", "ANSWERS", "CONFIG", "CONFLICT", "UNAVAILABLE", "UNEXPECTED",
           "error_for", "meaning_of"]

ANSWER = "answer"
CONFLICT = "conflict"
CONFIG = "config"
UNAVAILABLE = "unavailable"
UNEXPECTED = "unexpected"

#: Each exception, what it means (above) and why, in plain words.
ANSWERS: tuple[tuple[type[BaseException], str, str], ...] = (
    # -- the server's answers about a node ---------------------------------------------
    (kz.NoNodeError, ANSWER, "no such node"),
    (kz.BadVersionError, ANSWER, "the node changed meanwhile"),
    (kz.NodeExistsError, ANSWER, "the node exists"),
    (kz.NotEmptyError, ANSWER, "the node has children"),
    # -- another application's node ----------------------------------------------------
    (kz.NoChildrenForEphemeralsError, CONFLICT,
     "an ephemeral node (another application's) is where the lock keeps children"),
    # -- refused whatever the server's health ------------------------------------------
    (kz.NoAuthError, CONFIG,
     "the node's ACL does not let this user do that (give the URL's user:password a "
     "digest the ACL grants, or another prefix)"),
    (kz.AuthFailedError, CONFIG, "the server refused the URL's credentials"),
    (kz.SessionClosedRequireSaslError, CONFIG,
     "the server requires SASL authentication"),
    (kz.SASLException, CONFIG, "SASL authentication failed"),
    (kz.InvalidACLError, CONFIG, "the server refused the ACL of a new node"),
    (kz.QuotaExceededError, CONFIG, "a quota on the path is used up"),
    (kz.EphemeralOnLocalSessionError, CONFIG,
     "the server gives this client a local session, which cannot own ephemeral "
     "nodes (set localSessionsUpgradingEnabled)"),
    (kz.BadArgumentsError, CONFIG, "the server refused the call's arguments"),
    (kz.UnimplementedError, CONFIG,
     "the server lacks an operation the lock needs (ZooKeeper 3.5 or later)"),
    (kz.ConfigurationError, CONFIG, "kazoo refused its configuration"),
    # -- the ensemble is down, slow, or cut off ----------------------------------------
    (kz.ConnectionClosedError, UNAVAILABLE, "the connection was closed"),
    (kz.SessionExpiredError, UNAVAILABLE, "the session expired"),
    (kz.SessionMovedError, UNAVAILABLE, "the session moved to another server"),
    (kz.UnknownSessionError, UNAVAILABLE, "the server does not know the session"),
    (kz.ConnectionLoss, UNAVAILABLE, "the connection was lost"),
    (kz.ConnectionDropped, UNAVAILABLE, "the connection dropped"),
    (kz.OperationTimeoutError, UNAVAILABLE, "the operation timed out"),
    (kz.RequestTimeoutError, UNAVAILABLE, "the request timed out"),
    (kz.NotReadOnlyCallError, UNAVAILABLE,
     "the server is read-only (cut off from its quorum)"),
    (kz.ThrottledOpError, UNAVAILABLE, "the server throttled the call (overloaded)"),
    (kz.NewConfigNoQuorumError, UNAVAILABLE, "the ensemble has no quorum"),
    (kz.ReconfigInProcessError, UNAVAILABLE, "the ensemble is being reconfigured"),
    (kz.SystemZookeeperError, UNAVAILABLE, "a system error on the server"),
    (kz.RuntimeInconsistency, UNAVAILABLE, "a runtime inconsistency on the server"),
    (kz.DataInconsistency, UNAVAILABLE, "a data inconsistency on the server"),
    (kz.MarshallingError, UNAVAILABLE, "a request or reply could not be read"),
    (kz.ZookeeperStoppedError, UNAVAILABLE, "the client was stopped"),
    (kz.CancelledError, UNAVAILABLE, "the call was cancelled"),
    (KazooTimeoutError, UNAVAILABLE, "no answer in time"),
    (OSError, UNAVAILABLE, "the network failed"),
    # -- answers to calls the lock never makes -----------------------------------------
    (kz.RolledBackError, UNEXPECTED, "a transaction was rolled back"),
    (kz.NoWatcherError, UNEXPECTED, "no such watcher"),
    (kz.ReconfigDisabledError, UNEXPECTED, "reconfiguration is disabled"),
    (kz.InvalidCallbackError, UNEXPECTED, "an invalid callback"),
    (kz.LockTimeout, UNEXPECTED, "a kazoo lock recipe timed out"),
    (kz.WriterNotClosedException, UNEXPECTED, "a kazoo recipe's writer was left open"),
    (kz.APIError, UNEXPECTED, "an API error"),
    # -- any other server error, and a later kazoo's exceptions: fail closed -----------
    (kz.ZookeeperError, UNAVAILABLE, "an error the server named"),
    (kz.KazooException, UNAVAILABLE, "an error kazoo named"),
)


def meaning_of(exc: BaseException) -> tuple[str, str]:
    """What ``exc`` means here and why (:data:`ANSWERS`); an exception of neither
    kazoo nor the network is :data:`UNEXPECTED`."""
    for kind, meaning, why in ANSWERS:
        if isinstance(exc, kind):
            return meaning, why
    return UNEXPECTED, "not an answer of kazoo's"


def error_for(exc: BaseException, what: str, lock_name: str | None = None,
              where: str | None = None) -> DLockError | None:
    """The DLockError for ``exc``, raised by kazoo during ``what`` (at the node
    ``where``); None for the server's answers about a node (:data:`ANSWER`)."""
    meaning, why = meaning_of(exc)
    kind = type(exc).__name__
    at = f" at {where!r}" if where else ""
    if meaning == ANSWER:
        return None
    if meaning == CONFLICT:
        return LockKeyConflict(
            f"ZooKeeper refused {what}{at}: {why} ({kind}); nothing was changed: "
            f"choose another prefix or name", lock_name=lock_name)
    if meaning == CONFIG:
        return InvalidLockConfig(f"ZooKeeper refused {what}{at}: {why} ({kind})",
                                 lock_name=lock_name)
    if meaning == UNAVAILABLE:
        detail = f"{kind} {exc}".rstrip() if str(exc) else kind
        return BackendUnavailable(f"ZooKeeper unavailable during {what}: {why} "
                                  f"({detail})", lock_name=lock_name)
    return DLockError(f"ZooKeeper gave an answer celery-dlock does not expect during "
                      f"{what}{at}: {why} ({kind})", lock_name=lock_name)
