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
this client, is reported gone; when a force release noted who freed it and why (a
semaphore's hold, :mod:`.released`), with that reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kazoo.exceptions import NoNodeError

from ...core.errors import DLockError
from ...core.renew_target import LossNote
from .released import note_for, released_path_of
from .session import ZkSession

__all__ = ["ZkRenewTarget"]


class ZkRenewTarget:
    """Confirms the holds of one session (see the module text)."""

    def __init__(self, session: ZkSession) -> None:
        self.session = session

    def renew(self, items: Sequence[tuple[str, str, int]]) -> list[int | LossNote]:
        session = self.session
        client = session.start("renewal")
        current = session.session_id()
        synced = client.sync_async("/")
        pending: list[Any] = [client.exists_async(path) for path, _, _ in items]
        session.wait("renewal", synced)
        if session.session_id() != current:  # pragma: no cover - a new session
            raise RuntimeError("the ZooKeeper session changed during a renewal")
        out: list[int | LossNote] = []
        for result in pending:
            stat = session.wait("renewal", result)
            out.append(1 if stat is not None and session.is_ours(stat.ephemeralOwner)
                       else 0)
        gone = [i for i, code in enumerate(out) if code == 0]
        if gone:
            for i, note in zip(gone, self._notes([items[i] for i in gone]),
                               strict=True):
                if note is not None:
                    out[i] = LossNote(0, note[0], note[1])
        return out

    def _notes(self, items: Sequence[tuple[str, str, int]]
               ) -> list[tuple[int, str] | None]:
        """For each hold found gone: who freed it by force and why, when a note says
        (best effort: None when it cannot be read; the loss is reported anyway)."""
        session = self.session
        out: list[tuple[int, str] | None] = [None] * len(items)
        try:
            client = session.start("renewal")
            pending = [(i, client.get_async(path)) for i, (key, _, _) in
                       enumerate(items) if (path := released_path_of(key)) is not None]
            for i, result in pending:
                try:
                    raw, _ = session.wait("renewal", result)
                except NoNodeError:
                    continue
                out[i] = note_for(raw, items[i][1], None)
        except DLockError:
            pass
        return out


def renew_target(session: ZkSession) -> ZkRenewTarget:
    """The one renew target of ``session``."""
    target = session.renew_target
    if not isinstance(target, ZkRenewTarget):
        target = session.renew_target = ZkRenewTarget(session)
    return target
