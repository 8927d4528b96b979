"""Renewal of ZooKeeper holds: one :class:`ZkRenewTarget` per session.

The server keeps a session alive while it hears from it (kazoo pings it every third of
the timeout); what the scheduler needs is a *confirmation*, for the holder's local
deadline, that the session and each hold's node are still there.  One renewal is one
round trip on the session, however many holds it has: a ``sync`` (it passes through
the ensemble's leader, which decides session expiry) followed by one ``exists`` per
hold node, all sent before the first reply is read and answered in order.  A reply on
the session proves the server heard from it after the renewal was sent, so the server
cannot expire it before ``sent + session timeout``, and the session timeout is at
least the lock's ttl.  A node that is gone, or that belongs to an expired session of
this client, is reported gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .session import ZkSession

__all__ = ["ZkRenewTarget"]


class ZkRenewTarget:
    """Confirms the holds of one session (see the module text)."""

    def __init__(self, session: ZkSession) -> None:
        self.session = session

    def renew(self, items: Sequence[tuple[str, str, int]]) -> list[int]:
        session = self.session
        client = session.start("renewal")
        current = session.session_id()
        synced = client.sync_async("/")
        pending: list[Any] = [client.exists_async(path) for path, _, _ in items]
        session.wait("renewal", synced)
        if session.session_id() != current:  # pragma: no cover - a new session
            raise RuntimeError("the ZooKeeper session changed during a renewal")
        out = []
        for result in pending:
            stat = session.wait("renewal", result)
            out.append(1 if stat is not None and session.is_ours(stat.ephemeralOwner)
                       else 0)
        return out


def renew_target(session: ZkSession) -> ZkRenewTarget:
    """The one renew target of ``session``."""
    target = session.renew_target
    if not isinstance(target, ZkRenewTarget):
        target = session.renew_target = ZkRenewTarget(session)
    return target
