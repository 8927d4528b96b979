"""``ZooKeeperLock``: a reentrant, renewed, owner-checked lock on a ZooKeeper ensemble.

The lock recipe of ZooKeeper's own documentation, with the one hold bookkeeping of
:class:`~celery_dlock.core.hold.Hold`::

    /dlock/report%3A2026                      the lock node (persistent, marked ours)
        3f...a1-lock-0000000007   owner A, count 2   <- lowest sequence: A holds it
        9c...04-lock-0000000008   owner B            <- waits for ...07 to go (a watch)
        51...e9-lock-0000000009   owner C            <- waits for ...08 to go

* **Exclusion and FIFO.**  Every owner that holds or waits has one ephemeral sequential
  child; the lowest holds the lock.  A waiter sets a watch on the child just before
  its own and sleeps until the server pushes its deletion: no polling, no herd, served
  in arrival order.  A non-blocking acquire joins only an empty line.
* **Semaphores** (``limit`` above 1; Curator's ``InterProcessSemaphoreV2`` guards
  its leases with a second lock, the line orders them here): the ``limit`` lowest
  children hold a slot each, still in
  arrival order; an owner holding one of them on this session re-enters it, and a
  non-blocking acquire joins only a line shorter than ``limit`` (and leaves it when
  its child landed beyond the first ``limit``).  Any holder's delete may free a
  waiter's slot, not only the child just before it, so a waiter watches the lock
  node's children instead.  That is a herd: every waiter wakes on every change of
  the line (a holder leaving, a newcomer joining) and lists it again, so a release
  costs one listing, one read of the holders and one watch per waiter.  A lock
  (``limit`` 1) keeps the predecessor watch.
* **Re-entry** (per owner, as on Redis) counts in the holder's child (``count``,
  changed with the child's version, so two objects of one owner never lose an
  update); the last release deletes the child, only that child, and only at the
  version it read: a release never touches another owner's hold.
* **ttl = the session timeout.**  The children are ephemeral: when the holder dies, is
  frozen or cut off, the server deletes them once its session times out, counted on
  the server's clock (:mod:`.session`).  The holder's local deadline counts the same
  ttl from the send time of its last confirmed renewal (:mod:`.renewal`), so it is
  told before the server can free the lock.  A hold that is not renewed
  (``auto_renew=False``) is told at its deadline and deletes its own child then.
* **Fence = the holder child's creation zxid** (``czxid``): ZooKeeper's transaction
  ids totally order every change of the ensemble, and survive restarts of an ensemble
  that keeps its data, so the fences of successive holders of a name strictly
  increase (docs/backends.md, "ZooKeeper", for what an ensemble rebuilt from empty
  data dirs does).
* **Idempotence.**  A child's data carries the id of the last operation that changed
  it, so a release or re-entry re-sent after a lost reply changes nothing twice; a
  create whose reply was lost is found again by its guid.

Every failure to reach the ensemble is :class:`~celery_dlock.BackendUnavailable`;
data of another application at the lock's path is :class:`LockKeyConflict`, and
nothing is changed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from kazoo.exceptions import NoNodeError

from ...core.errors import (
    DLockError,
    Holder,
    InvalidLockConfig,
    NotSupported,
)
from ...core.lock_args import DEFAULT_PREFIX
from ...core.lock_options import LockOptions, check_limit
from ...core.protocol import GONE, OK, STILL_HELD, Grant
from ...core.renew_target import RenewTarget
from ...core.scheduler import RenewalScheduler
from .line import RACES as _RACES
from .line import LockNode
from .nodes import (
    lock_path,
)
from .released import note_for, released_path
from .renewal import renew_target
from .session import MAX_SESSION_MS
from .taking import WAIT_SLICE, LineHold
from .url import ZkSpec, parse_url

__all__ = ["WAIT_SLICE", "ZooKeeperLock"]

logger = logging.getLogger("celery_dlock.lock")



class ZooKeeperLock(LineHold):
    """A reentrant distributed lock on a ZooKeeper ensemble.

    :param zk: the ensemble: a ``zookeeper://host:port[,host:port...][/chroot]`` URL
        or a parsed :class:`~celery_dlock.backends.zookeeper.url.ZkSpec`.
    :param name: the lock's name; any non-empty string.
    :param ttl: seconds: the session timeout of the session that keeps the hold (at
        least 2 s on the server, :mod:`.session`), and the holder's local deadline
        after its last confirmed renewal.
    :param max_hold: as :class:`~celery_dlock.RedisLock`'s; the session would keep the
        hold past it, so once the holder is told, its child is deleted.
    :param limit: how many owners hold at once (above 1: a semaphore of that many
        slots, each hold with the whole surface of a lock's; every process must give
        a name the same limit).

    The other parameters are :class:`~celery_dlock.RedisLock`'s.
    """

    def __init__(
        self,
        zk: str | ZkSpec,
        name: str,
        ttl: float = 30.0,
        *,
        auto_renew: bool = True,
        owner: str | None = None,
        on_lost: Callable[[ZooKeeperLock], object] | None = None,
        prefix: str = DEFAULT_PREFIX,
        info: Mapping[str, object] | None = None,
        blocking_timeout: float | None = None,
        scheduler: RenewalScheduler | None = None,
        pause_budget: float | None = None,
        max_hold: float | None = None,
        limit: int = 1,
    ) -> None:
        self._open(zk, LockOptions(
            name, ttl, prefix=prefix, owner=owner, on_lost=on_lost, info=info,
            blocking_timeout=blocking_timeout, scheduler=scheduler,
            auto_renew=auto_renew, pause_budget=pause_budget, max_hold=max_hold,
            limit=limit))

    def _open(self, where: Any, options: LockOptions) -> None:
        name = options.name
        #: How many owners hold at once (above 1: a semaphore, see the module text).
        self.limit = check_limit(options.limit, name)
        spec = where if isinstance(where, ZkSpec) else parse_url(where)
        super().__init__(options)
        if self.ttl_ms > MAX_SESSION_MS:
            raise InvalidLockConfig(
                f"a ZooKeeper hold lives as long as its session, and a session "
                f"timeout is at most 2**31 - 1 ms (about 24.8 days), got "
                f"ttl {options.ttl!r}", lock_name=name)
        self.spec = spec
        #: The lock node (its children are the holder and the line).
        self.path = lock_path(options.prefix, name)
        self._released = released_path(options.prefix, name)
        self._info = options.info_fields
        # The session is chosen by the ttl the lock was made with (extend cannot
        # move a hold to another session).
        self._node = LockNode(spec, self.ttl_ms, self.path, name)
        self._nodes = threading.Lock()
        # Per owner: the guid of this object's child in line, the child before it,
        # and the child this object holds through (path, czxid).
        self._line: dict[str, str] = {}
        self._pred: dict[str, str] = {}
        self._held: dict[str, tuple[str, int]] = {}
        self._waited: set[str] = set()
        # Per owner waiting for a semaphore's slot: the line as it saw it last.
        self._seen: dict[str, list[str]] = {}
        # The final release whose delete was sent: (op, child path).
        self._deleted: tuple[str, str] | None = None
        # The child and depth of the current hold, for a lock object dropped while
        # holding (its finalizer gives the acquires back; on Redis the hold would
        # expire once renewal stopped, here the session would keep it alive).
        self._tracker: dict[str, Any] = {"child": None, "depth": 0}
        weakref.finalize(self, _abandoned, self._node, self._tracker)

    # -- talking to ZooKeeper --------------------------------------------------------

    def _sync_generation(self) -> None:
        gen = self._generation
        super()._sync_generation()
        if gen != self._generation:  # a forked child: none of these are its own
            self._line, self._pred, self._held, self._seen = {}, {}, {}, {}
            self._waited, self._deleted = set(), None

    def _give_back(self, owner: str) -> None:
        with self._nodes:
            held = self._held.pop(owner, None)
        if held is not None:
            try:
                self._node.delete(held[0])
            except DLockError as exc:  # it goes with the session
                logger.debug("could not give back %r: %s", self.name, exc)

    def _send_release(self, owner: str, op: str) -> int:
        child = self._holder_child(owner)
        for _ in range(_RACES):
            if child is None:
                return self._node.code_for(owner, self.limit)
            found = self._node.read(child)
            if found is None:
                if self._deleted == (op, child):
                    return OK  # our delete landed; its reply was lost
                return self._node.code_for(owner, self.limit)
            data, stat = found
            if data.owner != owner or \
                    not self._node.session.is_ours(stat.ephemeralOwner):
                return self._node.code_for(owner, self.limit)
            if data.op == op:
                return STILL_HELD  # this release was applied already
            if data.count > 1:
                data.count -= 1
                data.op = op
                if self._node.write(child, data, stat.version):
                    return STILL_HELD
                continue
            self._deleted = (op, child)
            if self._node.delete(child, stat.version):
                with self._nodes:
                    if self._held.get(owner, ("",))[0] == child:
                        del self._held[owner]
                self._node.tidy()
                return OK
        raise DLockError("too many concurrent changes to the hold",
                         lock_name=self.name)

    def _send_extend(self, owner: str, ttl_ms: int, op: str) -> int:
        status = self._read_status(owner, self._holder_child(owner))
        if status == OK and ttl_ms > self._node.session.timeout_ms:
            raise NotSupported(
                f"a ZooKeeper hold lives as long as its session, whose timeout is the "
                f"lock's ttl ({self._node.session.timeout_ms / 1000:g}s): extend can "
                f"confirm it for up to that long, not lengthen it to {ttl_ms / 1000:g}s"
                f"; make the lock with the longer ttl (docs/backends.md, ZooKeeper)",
                lock_name=self.name)
        return status

    def _read_status(self, owner: str, child: str | None = None) -> int:
        if child is None:
            child = self._holder_child(owner)
        if child is None:
            return self._node.code_for(owner, self.limit)
        found = self._node.read(child)
        if found is None or found[0].owner != owner or \
                not self._node.session.is_ours(found[1].ephemeralOwner):
            return self._node.code_for(owner, self.limit)
        return OK

    def _renew_target(self) -> RenewTarget | None:
        target: RenewTarget = renew_target(self._node.session)
        return target

    def _renew_key(self) -> str:
        with self._nodes:
            held = self._held.get(self._hold_owner or "")
        return held[0] if held is not None else self.path

    def _gone_reason(self, code: int, owner: str) -> str:
        if code == GONE:
            return ("its node is gone (its ZooKeeper session expired, or it was "
                    "released by force)")
        return "taken by another owner"

    def _explain_loss(self, default: str, owner: str, fence: int | None) -> str:
        """``default``, or who released this semaphore's hold by force and why (the
        note of :mod:`.released`; a lock's force release leaves none)."""
        if self.limit == 1:
            return default
        try:
            raw, _ = self._node.call("read", lambda c: c.get_async(self._released))
        except (NoNodeError, DLockError):
            return default
        note = note_for(raw, owner, fence)
        return default if note is None else note[1]

    def _session_expired(self, session_id: int | None) -> None:
        """The server expired a session: report the hold if it was taken on it."""
        with self._nodes:
            held = self._held.get(self._hold_owner or "")
        if held is None or session_id is None:
            return
        found = None
        try:
            found = self._node.read(held[0])
        except DLockError:
            pass
        if found is None or found[1].ephemeralOwner == session_id:
            self._mark_lost("its ZooKeeper session expired")

    def _mark_lost(self, reason: str, hold_id: int | None = None) -> bool:
        with self._nodes:
            held = self._held.get(self._hold_owner or "")
            depth = self._depth
        told = super()._mark_lost(reason, hold_id)
        if told and held is not None:
            # Told first; then the child goes (a hold past its deadline that the
            # server still keeps: a lock that is not renewed, a stalled renewal).
            threading.Thread(target=self._node.give_up, args=(held[0], depth),
                             daemon=True, name="celery-dlock-zk-drop").start()
        return told

    # -- a lock object dropped while holding -------------------------------------------

    def _acquired(self, owner: str, grant: Grant, sent_at: float,
                  margin: float) -> None:
        super()._acquired(owner, grant, sent_at, margin)
        self._track()

    def release(self) -> None:
        try:
            super().release()
        finally:
            self._track()

    def release_all(self) -> int:
        try:
            return super().release_all()
        finally:
            self._track()

    def _track(self) -> None:
        with self._nodes:
            held = self._held.get(self._hold_owner or "") if self._depth > 0 else None
            self._tracker["child"] = held[0] if held is not None else None
            self._tracker["depth"] = self._depth

    # -- reading ------------------------------------------------------------------------

    def locked(self) -> bool:
        """Whether anyone holds the lock (a semaphore: a slot)."""
        return bool(self._node.children())

    def holder(self) -> Holder | None:
        """Who holds the lock now (None when free); a semaphore's first holder in
        line."""
        kids = self._node.children()
        if not kids:
            return None
        if self.limit > 1:
            holders = self.holders()
            return holders[0] if holders else None
        found = self._node.read(self._node.child(kids[0][2]))
        if found is None:
            return None
        return found[0].holder(found[1].czxid, time.time())

    def holders(self) -> list[Holder]:
        """Every holder now, in line order (a lock: its one holder, if any)."""
        kids = self._node.children()[:self.limit]
        now = time.time()
        return [f[0].holder(f[1].czxid, now)
                for f in self._node.read_all([self._node.child(k[2]) for k in kids])
                if f is not None]

    def waiting_count(self) -> int:
        """How many owners wait in line (beyond the ``limit`` holders)."""
        return max(0, len(self._node.children()) - self.limit)

    def __repr__(self) -> str:
        limit = f" limit={self.limit}" if self.limit > 1 else ""
        return (f"<ZooKeeperLock {self.name!r}{limit} ttl={self.ttl:g}s "
                f"depth={self._depth} fence={self._fence}>")


def _abandoned(node: LockNode, tracker: dict[str, Any]) -> None:
    """A lock object was dropped while holding: give its acquires back (its finalizer;
    never raises, and never waits)."""
    child, depth = tracker.get("child"), tracker.get("depth") or 0
    if child is None or depth <= 0:
        return
    try:
        threading.Thread(target=node.give_up, args=(child, depth), daemon=True,
                         name="celery-dlock-zk-abandon").start()
    except Exception:  # pragma: no cover - an interpreter shutting down
        pass
