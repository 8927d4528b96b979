"""Taking a hold on a ZooKeeper lock node: the line of its children, and the hold at
its head (:class:`LineHold`, the first half of
:class:`~celery_dlock.backends.zookeeper.lock.ZooKeeperLock`).

Every owner that holds or waits has one ephemeral sequential child of the lock node
(:mod:`.line`); a lock's lowest child holds it, a semaphore's ``limit`` lowest each
hold a slot (the module text of :mod:`.lock` says why and what each costs).  Here:
joining the line (a create found again by its guid when its reply was lost), taking
the hold when one's child reaches the head, re-entering an owner's hold through any
of its objects, waiting (a lock's waiter watches the child before its own, a
semaphore's the line's children) and leaving the line.  What follows a grant
(release, extend, renewal, a loss) is :mod:`.lock`'s.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kazoo.exceptions import NoNodeError

from ...core.errors import DLockError
from ...core.hold import Hold
from ...core.protocol import Grant, Refused
from .line import RACES as _RACES
from .line import Child, LockNode
from .nodes import NodeData, child_prefix

__all__ = ["WAIT_SLICE", "LineHold"]

logger = logging.getLogger("celery_dlock.lock")

#: The longest a blocked acquirer sleeps on its watch before looking again (seconds):
#: a safety net only (a watch is pushed by the server, kept across reconnects).
WAIT_SLICE = 5.0


class LineHold(Hold):
    """The line of a lock node's children and the hold at its head (see the module
    text); :class:`~.lock.ZooKeeperLock` sets the state up and adds the rest."""

    #: How many owners hold at once (above 1: a semaphore).
    limit: int
    #: The lock node's path.
    path: str
    _node: LockNode
    _nodes: threading.Lock
    _info: dict[str, str]
    # Per owner: the guid of this object's child in line, the child before it, the
    # child this object holds through (path, czxid), whether it waited, and (a
    # semaphore) the line as it saw it last.
    _line: dict[str, str]
    _pred: dict[str, str]
    _held: dict[str, tuple[str, int]]
    _waited: set[str]
    _seen: dict[str, list[str]]

    def _holder_child(self, owner: str) -> str | None:
        """The child through which this object holds the lock for ``owner``, else
        the holder's child when ``owner`` holds it (through another object)."""
        holding = self._depth > 0 and self._hold_owner == owner
        with self._nodes:
            held = self._held.get(owner) if holding else None
        if held is not None:
            return held[0]
        kids = self._node.children()
        if self.limit > 1:
            return self._slot_of(owner, kids)
        if kids:
            child = self._node.child(kids[0][2])
            found = self._node.read(child)
            if found is not None and found[0].owner == owner:
                return child
        return None

    # -- what Hold asks ------------------------------------------------------------------

    def _new_data(self, owner: str, op: str) -> NodeData:
        granted = self._node.session.granted_ms or self._node.session.timeout_ms
        return NodeData(owner=owner, count=1, ttl_ms=granted, op=op,
                        acquired_at=time.time(), pid=os.getpid(), info=self._info,
                        limit=self.limit)

    def _send_acquire(self, owner: str, op: str, *, queue: bool,
                      reentry: bool) -> Grant | Refused | int:
        session = self._node.session
        session.start("acquire", self.name)
        session.check_ttl(self.ttl_ms, self.name)
        if reentry:
            return self._reenter(owner, op)
        if self.limit > 1:
            return self._send_acquire_slot(owner, op, queue=queue)
        for _ in range(_RACES):
            kids = self._node.children(make=True)
            with self._nodes:
                guid = self._line.get(owner)
            mine = next((k for k in kids if guid is not None and k[1] == guid), None)
            if kids and kids[0] != mine:
                head = self._node.child(kids[0][2])
                found = self._node.read(head)
                if found is None:
                    continue
                data, stat = found
                if data.owner == owner and session.is_ours(stat.ephemeralOwner):
                    # The owner holds it already (through another object): re-enter.
                    grant = self._join(head, owner, op)
                    if grant is None:
                        continue
                    if mine is not None:
                        self._leave_line(owner)
                    return grant
                self.last_holder = data.holder(stat.czxid, time.time())
                if mine is None and queue:
                    self._join_line(owner, op)
                    continue
                if mine is not None and not queue:
                    self._leave_line(owner)
                if mine is None or not queue:
                    return Refused()
                index = kids.index(mine)
                with self._nodes:
                    self._pred[owner] = self._node.child(kids[index - 1][2])
                    self._waited.add(owner)
                return Refused()
            if mine is None:
                self._join_line(owner, op)
                continue
            # Ours is the lowest child: we hold the lock.
            grant = self._take(owner, mine)
            if grant is not None:
                return grant
        raise DLockError("too many concurrent changes to the lock's line",
                         lock_name=self.name)

    def _take(self, owner: str, mine: Child) -> Grant | None:
        """The hold of ``owner`` through its own child ``mine``, now at the head of
        the line (None: it changed meanwhile; look again)."""
        child = self._node.child(mine[2])
        found = self._node.read(child)
        if found is None:
            with self._nodes:
                self._line.pop(owner, None)
            return None
        data, stat = found
        with self._nodes:
            waited = owner in self._waited
        if waited:
            # We waited in line: the hold starts now.
            data.acquired_at = time.time()
            if not self._node.write(child, data, stat.version):
                return None
        with self._nodes:
            self._line.pop(owner, None)
            self._pred.pop(owner, None)
            self._seen.pop(owner, None)
            self._waited.discard(owner)
            self._held[owner] = (child, stat.czxid)
        self._node.session.holders.add(self)
        return Grant(stat.czxid, False)

    def _send_acquire_slot(self, owner: str, op: str, *,
                           queue: bool) -> Grant | Refused:
        """:meth:`_send_acquire` of a semaphore: the ``limit`` lowest children hold."""
        session = self._node.session
        for _ in range(_RACES):
            kids = self._node.children(make=True)
            with self._nodes:
                guid = self._line.get(owner)
            mine = next((k for k in kids if guid is not None and k[1] == guid), None)
            head = kids[:self.limit]
            others = [self._node.child(k[2]) for k in head if k != mine]
            found = self._node.read_all(others)
            if any(f is None for f in found):
                continue  # a holder left meanwhile: look again
            held = next((child for child, f in zip(others, found, strict=True)
                         if f is not None and f[0].owner == owner
                         and session.is_ours(f[1].ephemeralOwner)), None)
            if held is not None:
                # The owner holds a slot already (through another object): re-enter.
                grant = self._join(held, owner, op)
                if grant is None:
                    continue
                if mine is not None:
                    self._leave_line(owner)
                return grant
            if mine is not None and mine in head:
                # Ours is among the lowest: we hold a slot.
                taken = self._take(owner, mine)
                if taken is None:
                    continue
                return taken
            first = found[0] if found else None
            if first is not None:
                self.last_holder = first[0].holder(first[1].czxid, time.time())
            if mine is None:
                if queue or len(kids) < self.limit:
                    self._join_line(owner, op)
                    continue
                return Refused()
            if not queue:
                # A race: others joined before our child; never overtake them.
                self._leave_line(owner)
                return Refused()
            with self._nodes:
                self._seen[owner] = [k[2] for k in kids]
                self._waited.add(owner)
            return Refused()
        raise DLockError("too many concurrent changes to the semaphore's line",
                         lock_name=self.name)

    def _slot_of(self, owner: str, kids: list[Child]) -> str | None:
        """The child of ``owner`` among the ``limit`` lowest of ``kids`` (one of this
        process's session first), else None."""
        head = [self._node.child(k[2]) for k in kids[:self.limit]]
        found = self._node.read_all(head)
        session = self._node.session
        mine = [(child, f) for child, f in zip(head, found, strict=True)
                if f is not None and f[0].owner == owner]
        for child, f in mine:
            if session.is_ours(f[1].ephemeralOwner):
                return child
        return mine[0][0] if mine else None

    def _join_line(self, owner: str, op: str) -> None:
        """Create this object's child for ``owner`` (found again by its guid if a lost
        reply hid an earlier create)."""
        guid = os.urandom(8).hex()
        with self._nodes:
            self._line[owner] = guid
        data = self._new_data(owner, op).encode()
        try:
            path = self._node.child(child_prefix(guid))
            self._node.call("acquire", lambda c: c.create_async(
                path, data, ephemeral=True, sequence=True))
        except NoNodeError:
            pass  # the lock node was tidied away meanwhile: the caller starts over

    def _join(self, child: str, owner: str, op: str) -> Grant | None:
        """One more acquire of ``owner``'s hold in ``child`` (None: it changed)."""
        for _ in range(_RACES):
            found = self._node.read(child)
            if found is None:
                return None
            data, stat = found
            if data.owner != owner:
                return None
            if data.op != op:
                data.count += 1
                data.op = op
                if not self._node.write(child, data, stat.version):
                    continue
            with self._nodes:
                self._held[owner] = (child, stat.czxid)
            self._node.session.holders.add(self)
            return Grant(stat.czxid, True)
        return None

    def _reenter(self, owner: str, op: str) -> Grant | int:
        with self._nodes:
            held = self._held.get(owner)
        if held is not None and held[1] == self._fence:
            found = self._node.read(held[0])
            if found is not None and found[0].owner == owner and \
                    self._node.session.is_ours(found[1].ephemeralOwner):
                grant = self._join(held[0], owner, op)
                if grant is not None:
                    return grant
        return self._node.code_for(owner, self.limit)

    def _wait_turn(self, owner: str, refused: Refused, left: float | None) -> None:
        with self._nodes:
            pred = self._pred.pop(owner, None)
            seen = self._seen.pop(owner, None)
        slice_ = WAIT_SLICE if left is None else min(WAIT_SLICE, left)
        if seen is not None:
            self._wait_line(seen, slice_)
            return
        if pred is None:
            time.sleep(min(slice_, 0.05))
            return
        woken = threading.Event()
        stat = self._node.call("wait", lambda c: c.exists_async(
            pred, watch=lambda _event: woken.set()))
        if stat is not None and slice_ > 0:
            woken.wait(slice_)

    def _wait_line(self, seen: list[str], slice_: float) -> None:
        """A semaphore's waiter: sleep until the line changes (a watch on the lock
        node's children: any holder's delete may free our slot, not only the one just
        before ours), or ``slice_`` seconds."""
        woken = threading.Event()
        try:
            now = self._node.call("wait", lambda c: c.get_children_async(
                self.path, watch=lambda _event: woken.set()))
        except NoNodeError:
            return  # the line is gone: look again at once
        if not set(seen) <= set(now):
            return  # someone left since we looked: look again at once
        if slice_ > 0:
            woken.wait(slice_)

    def acquire(self, blocking: bool = True, timeout: float | None = None, *,
                blocking_timeout: float | None = None) -> bool:
        try:
            return super().acquire(blocking, timeout, blocking_timeout=blocking_timeout)
        except DLockError:
            # A create whose reply was lost may have left a child in line that
            # nobody waits on: it would hold the lock when its turn came.
            self._leave_line(self._current_owner())
            raise

    def _leave_line(self, owner: str) -> None:
        with self._nodes:
            guid = self._line.pop(owner, None)
            self._pred.pop(owner, None)
            self._seen.pop(owner, None)
            self._waited.discard(owner)
        if guid is None:
            return
        try:
            self._node.remove_guid(guid)
        except DLockError as exc:
            logger.debug("could not leave the line of %r now (%s): trying again in "
                         "the background", self.name, exc)
            threading.Thread(target=self._node.remove_later, args=(guid,), daemon=True,
                             name="celery-dlock-zk-leave").start()
