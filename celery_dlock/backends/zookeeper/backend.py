"""The ZooKeeper backend behind :class:`~celery_dlock.core.protocol.Backend`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from ...core.errors import DLockError, LockKeyConflict
from ...core.holds import HoldChanged, HoldInfo
from ...core.lock_options import LockOptions
from ...core.registry import entry_named
from ...core.store_check import Problem, probe
from .line import RACES
from .lock import ZooKeeperLock
from .markers import ZkMarkers
from .nodes import (
    DIR_MARK,
    NodeData,
    decode_dir,
    decode_node,
    is_name_segment,
    lock_path,
    prefix_path,
    sequence_of,
)
from .rates import ZkRates
from .released import add_note, notes_path, released_path
from .session import ZkSession, session_for
from .url import ZkSpec, parse_url

__all__ = ["ZooKeeperBackend", "backend_from_url"]

#: The ttl of the session the backend reads and force-releases with (seconds).
_READER_TTL = 10.0
_PLAIN = ("task_name", "task_id", "worker", "host")


def _hold_info(name: str, data: NodeData, stat: Any) -> HoldInfo:
    info = dict(data.info)
    plain = {k: info.pop(k, None) for k in _PLAIN}
    held_for = None if data.acquired_at is None else max(0.0,
                                                        time.time() - data.acquired_at)
    return HoldInfo(key=name, task_name=plain["task_name"], task_id=plain["task_id"],
                    worker=plain["worker"], pid=data.pid, owner=data.owner,
                    count=data.count, fence=int(stat.czxid), ttl=data.ttl_ms / 1000.0,
                    held_for=held_for, host=plain["host"], extra=info)


def _info_of(name: str, holding: list[tuple[str, NodeData, Any]],
             limit: int | None = None) -> HoldInfo | None:
    """What :meth:`ZooKeeperBackend.read` gives of ``holding``: None when empty, a
    lock's one holder, or a semaphore (``limit``, the largest any holder says: its
    first holder's fields, and every holder)."""
    if not holding:
        return None
    if limit is None:
        limit = max(data.limit for _, data, _ in holding)
    holds = tuple(_hold_info(name, data, stat) for _, data, stat in holding)
    if limit <= 1:
        return holds[0]
    return dataclasses.replace(holds[0], limit=limit, holders=holds)


def _getter(path: str) -> Callable[[Any], Any]:
    return lambda client: client.get_async(path)


def _deleter(path: str, version: int) -> Callable[[Any], Any]:
    return lambda client: client.delete_async(path, version)


class ZooKeeperBackend:
    """The locks of one ZooKeeper ensemble."""

    kind = "zookeeper"
    fences = True
    capabilities = entry_named("zookeeper").capabilities

    def __init__(self, spec: ZkSpec) -> None:
        self.spec = spec

    @property
    def _reader(self) -> ZkSession:
        return session_for(self.spec, round(_READER_TTL * 1000))

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        session = self._reader
        client = session.start(what)
        return session.wait(what, fn(client))

    def lock(self, options: LockOptions) -> ZooKeeperLock:
        return ZooKeeperLock.with_options(self.spec, options)

    def _holding(self, prefix: str, name: str) -> list[tuple[str, NodeData, Any]]:
        """The holders' children of ``name`` (path, data, stat), in line order: the
        lowest child, and as many more as the largest ``limit`` they say (a lock: the
        one); empty when free."""
        path = lock_path(prefix, name)
        session = self._reader
        client = session.start("read", name)
        data, line = client.get_async(path), client.get_children_async(path)
        try:  # both sent at once: one round trip
            raw, _ = session.wait("read", data, name)
            names = session.wait("read", line, name)
        except NoNodeError:
            return []
        if raw != DIR_MARK:
            raise LockKeyConflict(f"ZooKeeper node {path} holds data celery-dlock did "
                                  f"not write: nothing was changed", lock_name=name)
        out: list[tuple[str, NodeData, Any]] = []
        limit = 1
        for _, _, child_name in sorted((*sequence_of(n, path), n) for n in names):
            if len(out) >= limit:
                break
            child = f"{path}/{child_name}"
            try:
                raw, stat = self._call("read", _getter(child))
            except NoNodeError:
                continue  # released meanwhile: the next in line holds it
            data = decode_node(raw, child)
            limit = max(limit, data.limit)
            out.append((child, data, stat))
        return out

    def read(self, prefix: str, name: str) -> HoldInfo | None:
        return _info_of(name, self._holding(prefix, name))

    def holds(self, prefix: str) -> Iterator[HoldInfo]:
        try:
            names = self._call("list", lambda c: c.get_children_async(
                prefix_path(prefix)))
        except NoNodeError:
            return
        for segment in sorted(names):
            if not is_name_segment(segment):
                continue  # the rates' and the queue markers' subtrees
            name = decode_dir(segment)
            try:
                found = self.read(prefix, name)
            except LockKeyConflict:
                continue  # not a lock of ours: not listed
            if found is not None:
                yield found

    def waiting(self, prefix: str, names: Iterable[str]) -> dict[str, int]:
        out = {}
        for name in names:
            # A semaphore's waiters are the children beyond its limit.
            limit = max((data.limit for _, data, _ in self._holding(prefix, name)),
                        default=1)
            lock = ZooKeeperLock.with_options(self.spec, LockOptions(
                name, _READER_TTL, prefix=prefix, limit=limit))
            out[name] = lock.waiting_count()
        return out

    def rates(self) -> ZkRates:
        """Per-name rates (``lock_rate``), in the nodes under ``/<prefix>/.rates``
        (:mod:`.rates`)."""
        return ZkRates(self.spec)

    def markers(self) -> ZkMarkers:
        """Queue markers (a ``lock_mode`` other than ``while_running``), in the
        nodes under ``/<prefix>/.markers`` (:mod:`.markers`)."""
        found: ZkMarkers | None = getattr(self, "_markers", None)
        if found is None:
            found = self._markers = ZkMarkers(self.spec, self.read)
        return found

    def storage_key(self, prefix: str, name: str) -> str:
        """The lock node of ``name`` (under the URL's chroot, if any)."""
        return self.spec.chroot + lock_path(prefix, name)

    def check(self, prefix: str) -> list[Problem]:
        """The probe lock: a prefix node another application owns, an ACL that
        refuses this user, show there."""
        return probe(self, prefix)

    def force_release(self, prefix: str, name: str, *, fence: int | None = None,
                      by: str | None = None, reason: str | None = None,
                      conditions: Mapping[str, str] | None = None) -> HoldInfo | None:
        """Delete the holder's child of ``name`` (the next in line gets the lock); the
        holder is told at its next renewal or contact that its node is gone.  ``by``
        and ``reason`` are not kept for a lock (docs/backends.md); a semaphore
        (:meth:`_force_release_slots`) notes them for its holders."""
        holding = self._holding(prefix, name)
        if not holding:
            return None
        if max(data.limit for _, data, _ in holding) > 1:
            return self._force_release_slots(prefix, name, holding, fence=fence,
                                             by=by, reason=reason,
                                             conditions=conditions)
        child, data, stat = holding[0]
        found = _hold_info(name, data, stat)
        if fence is not None and fence != found.fence:
            raise HoldChanged(f"lock {name!r} is now held with fence {found.fence}, "
                              f"not {fence}: nothing was freed", lock_name=name,
                              current=found)
        if conditions:
            fields = {**data.info, "owner": data.owner,
                      "pid": "" if data.pid is None else str(data.pid)}
            if any(fields.get(k) != v for k, v in conditions.items()):
                return None
        try:
            self._call("release", lambda c: c.delete_async(child, stat.version))
        except NoNodeError:
            return None
        except DLockError:
            raise
        return found

    def _force_release_slots(self, prefix: str, name: str,
                             holding: list[tuple[str, NodeData, Any]], *,
                             fence: int | None, by: str | None, reason: str | None,
                             conditions: Mapping[str, str] | None) -> HoldInfo | None:
        """Delete the holders' children of semaphore ``name`` that match ``fence``
        and ``conditions`` (neither: every holder), each at the version read, so a
        slot taken again meanwhile is left alone; the waiters first in line take the
        freed slots.  With ``by`` or ``reason``, each delete notes who and why in the
        same transaction (:mod:`.released`), for the holder's loss reason.  The
        semaphore as read, with the freed holds as its ``holders`` (None: nothing
        freed)."""
        freed = []
        for child, data, stat in holding:
            if fence is not None and fence != int(stat.czxid):
                continue
            if conditions:
                fields = {**data.info, "owner": data.owner,
                          "pid": "" if data.pid is None else str(data.pid)}
                if any(fields.get(k) != v for k, v in conditions.items()):
                    continue
            if by is not None or reason is not None:
                if not self._delete_noted(prefix, name, child, stat.version,
                                          data.owner, int(stat.czxid), by, reason):
                    continue  # released, or changed, meanwhile
                freed.append((child, data, stat))
                continue
            try:
                self._call("release", _deleter(child, stat.version))
            except (NoNodeError, BadVersionError):
                continue  # released, or changed, meanwhile
            freed.append((child, data, stat))
        return _info_of(name, freed, max(data.limit for _, data, _ in holding))

    def _delete_noted(self, prefix: str, name: str, child: str, version: int,
                      owner: str, fence: int, by: str | None,
                      reason: str | None) -> bool:
        """Delete ``child`` at ``version`` and note who freed it and why, in one
        transaction; False when the child is gone or changed (nothing noted)."""
        session = self._reader
        client = session.start("release", name)
        try:
            session.wait("release", client.create_async(notes_path(prefix), b"",
                                                        makepath=True), name)
        except NodeExistsError:
            pass
        path = released_path(prefix, name)
        for _ in range(RACES):
            try:
                raw, stat = session.wait("release", client.get_async(path), name)
            except NoNodeError:
                raw, stat = None, None
            note = add_note(raw, path, owner, fence, by, reason)
            tx = client.transaction()
            tx.delete(child, version)
            if stat is None:
                tx.create(path, note)
            else:
                tx.set_data(path, note, stat.version)
            results = session.wait("release", tx.commit_async(), name)
            if not any(isinstance(r, Exception) for r in results):
                return True
            if isinstance(results[0], (NoNodeError, BadVersionError)):
                return False  # the hold went, or changed, meanwhile
            if isinstance(results[1], (NodeExistsError, BadVersionError, NoNodeError)):
                continue  # another force release noted meanwhile: read again
            raise DLockError(f"ZooKeeper refused a force release of {name!r}: "
                             f"{results[1]!r}", lock_name=name)
        raise DLockError(f"too many concurrent force releases of {name!r}",
                         lock_name=name)

    def __repr__(self) -> str:
        return f"<ZooKeeperBackend {self.spec!r}>"


def backend_from_url(url: str, **options: Any) -> ZooKeeperBackend:
    """The backend of a ``zookeeper://host:port[,host:port...][/chroot]`` URL (no
    server call); ``connect_timeout=`` seconds may also be given here."""
    return ZooKeeperBackend(parse_url(url, **options))
