"""Queue markers (a ``lock_mode`` other than ``while_running``) on ZooKeeper: one node
per marked name, written by compare-and-set around the protocol's steps
(:class:`celery_dlock.core.marker_store.DocumentMarkers`, over
:mod:`celery_dlock.core.marker_steps`: the same rules and replies as the Redis
scripts).

**The node.**  ``/<prefix>/.markers/<name>`` (:mod:`.nodes`), persistent; its data is
the name's markers (its queued call, the claim record, the replaced calls, the
retries waiting, each with its expiry: an :class:`~celery_dlock.core.expiring.
ExpiringKeys` document) in JSON marked as celery-dlock's (:func:`encode`).  Other
data there (another application's) is :class:`~celery_dlock.LockKeyConflict`, and is
never overwritten.  Keys past their expiry count as gone; nothing is ever deleted
(one small node per name ever marked stays, and the name's next step overwrites it).

**A step** sets the clock node ``/<prefix>/.markers/.clock`` and reads the name's
node with it (:mod:`.clock`: the ensemble's clock, one round trip), a claim then reads
the name's live hold (the lock's holder and its ``task_id``, as ``celery dlock show``
reads it; the other steps do not use it), runs, and, when it changed the document,
writes ``set(path, data,
version)`` (someone wrote it meanwhile: ``BadVersionError``) or, when there was none,
``create(path, data)`` (someone made it meanwhile: ``NodeExistsError``): then it
reads and runs again.  A write whose reply was lost (the connection dropped
mid-call) is answered by reading again, once: the steps, run again on what the first
write left, answer as the first did.  The node is read before the hold, so a marked
call that starts after the read writes the node (its hand-over) and the step's
compare-and-set fails; a call holding the lock with no marker of its own, taken just
after the read, is the order "claim, then acquire", which the protocol allows.  No
other condition is needed.  (A lagging server answers a session's reads in order
from a prefix of the ensemble's writes: a read of the node that misses a hand-over
misses the holder's acquire before it too, and the leader refuses the write.)

**Cost.**  A step is a clock write and a read together (one round trip), for a
claim the hold's read (one round trip, two when the lock has a line), and, when it
changes anything, the node's write: one quorum write more than the step's own.

**Reading** (``read``, ``queued``: ``celery dlock show``, ``ls``) creates nothing: it
sets the clock node only where it is already there (a step made it), else takes the
node's own last write as now.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from ...core.errors import LockKeyConflict
from ...core.holds import HoldInfo
from ...core.marker_steps import Holder
from ...core.marker_store import DocumentMarkers, MarkerRow
from . import clock, versioned
from .nodes import clock_path, marker_path, markers_path
from .url import ZkSpec

__all__ = ["ZkMarkers", "decode", "encode"]

_MARK = "dlock_markers"
_STEP = "a queue marker step"
_READ = "a queue marker read"


def encode(doc: str) -> bytes:
    """A marker node's data: the document (:meth:`ExpiringKeys.dumps`), marked."""
    return f'{{"{_MARK}":1,"keys":{doc}}}'.encode()


def decode(raw: bytes | None, where: str, name: str | None) -> str:
    """:func:`encode` read back (the document); LockKeyConflict when it is not
    celery-dlock's."""
    try:
        data: Any = json.loads((raw or b"").decode())
        if not isinstance(data, dict) or data.get(_MARK) != 1 or \
                not isinstance(data.get("keys"), dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise LockKeyConflict(f"ZooKeeper node {where!r} holds data celery-dlock did "
                              f"not write (another application uses this path?): "
                              f"nothing was changed; choose another prefix or name",
                              lock_name=name) from None
    return json.dumps(data["keys"], separators=(",", ":"))


def holder_of(hold: HoldInfo | None) -> Holder | None:
    """The live hold of a lock as the steps see it: its task id and ms left (the
    hold's ttl: on ZooKeeper, the session timeout a dead holder is kept for)."""
    if hold is None:
        return None
    left = hold.ttl if hold.ttl is not None else hold.lease
    return Holder(hold.task_id, 0 if left is None else max(0, round(left * 1000)))


class ZkMarkers(DocumentMarkers):
    """The :class:`~celery_dlock.task.markers.MarkerStore` of one ZooKeeper ensemble
    (see the module text); ``hold`` reads a name's live hold (the backend's
    ``read``)."""

    label = "ZooKeeper"
    resends = 1

    def __init__(self, spec: ZkSpec,
                 hold: Callable[[str, str], HoldInfo | None]) -> None:
        self.spec = spec
        self._hold = hold

    def _node(self, prefix: str, name: str) -> tuple[str, Any] | None:
        """``name``'s document and its node's stat (no clock written); None: no
        node."""
        path = marker_path(prefix, name)
        found = versioned.get(self.spec, path, _READ, name)
        return None if found is None else (decode(found[0], path, name), found[1])

    def _tick(self, prefix: str, name: str | None) -> int | None:
        """The clock for a read; None where there is no clock node (none is
        made)."""
        return clock.tick(self.spec, clock_path(markers_path(prefix)), _READ, name,
                          create=False)

    # -- the hooks of the loop ----------------------------------------------------------

    def _read(self, prefix: str, name: str, *, create: bool = True,
              holder: bool = True) -> MarkerRow | None:
        if not create:
            found = self._node(prefix, name)
            if found is None:
                return None  # and no clock written
            now = self._tick(prefix, name)
            return MarkerRow(clock.mtime_ms(found[1]) if now is None else now,
                             int(found[1].version), found[0], None, -1)
        path = marker_path(prefix, name)
        now, raw, stat = clock.read_at(self.spec, clock_path(markers_path(prefix)),
                                       path, _STEP, name)
        doc = None if stat is None else decode(raw, path, name)
        return MarkerRow(now, None if stat is None else int(stat.version), doc,
                         holder_of(self._hold(prefix, name)) if holder else None, -1)

    def _write(self, prefix: str, name: str, version: int | None, doc: str,
               expires: int | None, lease: int | None) -> bool:
        return versioned.write(self.spec, marker_path(prefix, name), encode(doc),
                               version, _STEP, name)

    def _rows(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        names = versioned.names(self.spec, markers_path(prefix), _READ)
        if not names:
            return
        now = self._tick(prefix, None)
        for name in names:
            try:
                found = self._node(prefix, name)
            except LockKeyConflict:
                continue  # not ours: not listed
            if found is not None:
                doc, stat = found
                yield name, clock.mtime_ms(stat) if now is None else now, doc
