"""One lock node and its line of children, on one session: the reads and writes a
:class:`~celery_dlock.backends.zookeeper.lock.ZooKeeperLock` makes (the layout is
:mod:`.nodes`'s).  Every call waits a bounded time (:mod:`.session`); kazoo's answers
about a node (gone, changed) come back as values, a failure as BackendUnavailable."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, NotEmptyError

from ...core.errors import DLockError, LockKeyConflict
from ...core.protocol import GONE, TAKEN
from .nodes import DIR_MARK, NodeData, decode_node, sequence_of
from .session import CALL_TIMEOUT, ZkSession, session_for
from .url import ZkSpec

__all__ = ["Child", "LockNode"]

logger = logging.getLogger("celery_dlock.lock")

#: How many times one call starts over after losing a race with another client.
RACES = 50

Child = tuple[int, str, str]  # (sequence, guid, child name)


class LockNode:
    """The lock node at ``path`` (see :mod:`.nodes`), reached through the session of
    ``spec`` for a ttl of ``session_ttl_ms``."""

    def __init__(self, spec: ZkSpec, session_ttl_ms: int, path: str, name: str) -> None:
        self.spec = spec
        self.session_ttl_ms = session_ttl_ms
        self.path = path
        self.name = name

    @property
    def session(self) -> ZkSession:
        # Looked up on every use: after a fork, the child's own session.
        return session_for(self.spec, self.session_ttl_ms)

    def call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        session = self.session
        client = session.start(what, self.name)
        return session.wait(what, fn(client), self.name, self.path)

    def child(self, name: str) -> str:
        return f"{self.path}/{name}"

    def children(self, make: bool = False) -> list[Child]:
        """The line, lowest sequence first (the lock node made when missing and
        ``make``); LockKeyConflict when the path is another application's."""
        for _ in range(RACES):
            session = self.session
            client = session.start("acquire", self.name)
            data = client.get_async(self.path)
            kids = client.get_children_async(self.path)
            try:
                raw, _ = session.wait("acquire", data, self.name, self.path)
                names = session.wait("acquire", kids, self.name, self.path)
            except NoNodeError:
                if not make:
                    return []
                try:
                    self.call("acquire", lambda c: c.create_async(
                        self.path, DIR_MARK, makepath=True))
                except NodeExistsError:
                    pass
                continue
            if raw != DIR_MARK:
                raise LockKeyConflict(
                    f"ZooKeeper node {self.path!r} holds data celery-dlock did not "
                    f"write (another application uses this path?): nothing was "
                    f"changed; choose another prefix or name", lock_name=self.name)
            return sorted((*sequence_of(n, self.path), n) for n in names)
        raise DLockError(f"the lock node {self.path} kept disappearing",
                         lock_name=self.name)

    def read(self, child: str) -> tuple[NodeData, Any] | None:
        """A child's data and stat (None: gone)."""
        try:
            raw, stat = self.call("read", lambda c: c.get_async(child))
        except NoNodeError:
            return None
        return decode_node(raw, child), stat

    def read_all(self, children: list[str]) -> list[tuple[NodeData, Any] | None]:
        """:meth:`read` of each of ``children``, all sent before the first reply is
        read (one round trip)."""
        if not children:
            return []
        session = self.session
        client = session.start("read", self.name)
        pending = [client.get_async(child) for child in children]
        out: list[tuple[NodeData, Any] | None] = []
        for child, result in zip(children, pending, strict=True):
            try:
                raw, stat = session.wait("read", result, self.name, self.path)
            except NoNodeError:
                out.append(None)
                continue
            out.append((decode_node(raw, child), stat))
        return out

    def write(self, child: str, data: NodeData, version: int) -> bool:
        """Set a child's data at ``version``; False when it changed or went meanwhile
        (its holder deleted it: told of a loss, or at its max hold)."""
        try:
            self.call("write", lambda c: c.set_async(child, data.encode(), version))
        except (BadVersionError, NoNodeError):
            return False
        return True

    def delete(self, child: str, version: int = -1) -> bool:
        """Delete a child (at ``version``); False when it changed meanwhile."""
        try:
            self.call("delete", lambda c: c.delete_async(child, version))
        except NoNodeError:
            return True
        except BadVersionError:
            return False
        return True

    def tidy(self) -> None:
        """Delete the lock node once its line is empty (best effort: a newcomer's
        create that finds it gone makes it again)."""
        try:
            self.call("release", lambda c: c.delete_async(self.path))
        except (NotEmptyError, NoNodeError, DLockError):
            pass

    def code_for(self, owner: str, limit: int = 1) -> int:
        """GONE when nobody holds the lock, TAKEN when another owner does (a
        semaphore's slot is never taken from its holder: GONE)."""
        kids = self.children()
        if not kids or limit > 1:
            return GONE
        found = self.read(self.child(kids[0][2]))
        return TAKEN if found is not None and found[0].owner != owner else GONE

    def remove_guid(self, guid: str) -> None:
        """Delete the child created with ``guid`` (if it exists)."""
        for _, g, name in self.children():
            if g == guid:
                self.delete(self.child(name))

    def remove_later(self, guid: str) -> None:
        """:meth:`remove_guid` once the ensemble answers again (until the session could
        have ended: then the server deleted it)."""
        deadline = time.monotonic() + self.session.timeout_ms / 1000.0 + CALL_TIMEOUT
        while time.monotonic() < deadline:
            try:
                self.remove_guid(guid)
                return
            except DLockError:
                time.sleep(0.5)

    def give_up(self, child: str, acquires: int) -> None:
        """Undo ``acquires`` acquires of the hold in ``child`` if this process's
        session created it (deleting it when none is left): a hold whose holder was
        told it is lost, or whose lock object was dropped without release.  While the
        ensemble does not answer it tries again, until the session could have ended
        (then the server deleted the child): the session outlives an outage shorter
        than its timeout, and would otherwise keep the child, and the lock, for as
        long as the process lives."""
        deadline = time.monotonic() + self.session.timeout_ms / 1000.0 + CALL_TIMEOUT
        while True:
            try:
                self._give_up_once(child, acquires)
                return
            except DLockError as exc:
                if time.monotonic() >= deadline:
                    logger.debug("could not give up the hold of %r: %s", self.name,
                                 exc)
                    return
                time.sleep(0.5)

    def _give_up_once(self, child: str, acquires: int) -> None:
        for _ in range(RACES):
            found = self.read(child)
            if found is None:
                return
            data, stat = found
            if stat.ephemeralOwner != self.session.session_id():
                return
            if data.count <= acquires:
                if self.delete(child, stat.version):
                    self.tidy()
                    return
            else:
                data.count -= acquires
                data.op = ""
                if self.write(child, data, stat.version):
                    return
