"""Where a lock lives in ZooKeeper's tree, and what its nodes say.

One lock is one *lock node*, ``/<prefix>/<name>``, persistent, whose data marks it as
celery-dlock's (:data:`DIR_MARK`).  Its children are the line: one ephemeral
sequential node per owner that holds or waits, named ``<guid>-lock-<sequence>``.  The
child with the lowest sequence holds the lock; each other child waits for the one
before it.  A semaphore (``limit`` above 1) keeps the same line: its ``limit`` lowest
children hold a slot each, the others wait.  The guid lets a creator whose reply was
lost find its node again (the "protected" create of the recipe).

A child's data is JSON: the owner, how many acquires it holds (``count``), the ttl the
server keeps it for a dead holder (its session timeout, ms), the holder's ``pid``,
``acquired_at`` (the holder's wall clock) and every ``info`` field, plus the id of the
last operation that changed it (``op``), so that a re-sent call changes nothing twice.
A semaphore's children also say its ``limit`` (a lock's, whose limit is 1, do not: they
are byte for byte what they were before semaphores).

Anything else at those paths (another application's data, a child of another shape)
is a :class:`~celery_dlock.LockKeyConflict`: nothing is changed.

Per-name rates (``lock_rate``, :mod:`.rates`) live beside the lock nodes in a subtree
of their own, ``/<prefix>/.rates``: one node per rated name, ``/<prefix>/.rates/<name>``
(the name encoded as a lock node's is), and the clock node ``/<prefix>/.rates/.clock``
(:mod:`.clock`).  Queue markers (a ``lock_mode``, :mod:`.markers`) likewise, under
``/<prefix>/.markers``: ``/<prefix>/.markers/<name>`` and ``/<prefix>/.markers/.clock``.
Who freed a semaphore's holds by force, and why, under ``/<prefix>/.released``
(:mod:`.released`).  No lock name's segment contains a dot (it is encoded), so no
subtree nor clock can be a lock node nor a name's node.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from ...core.errors import Holder, LockKeyConflict

__all__ = ["DIR_MARK", "MARKERS_DIR", "RATES_DIR", "NodeData", "child_prefix",
           "clock_path", "decode_dir", "decode_node", "is_name_segment", "lock_path",
           "marker_path", "markers_path", "prefix_path", "rate_path", "rates_path",
           "sequence_of"]

#: The last segment of the rates subtree under a prefix node.
RATES_DIR = ".rates"
#: The last segment of the queue markers' subtree under a prefix node.
MARKERS_DIR = ".markers"
_CLOCK = ".clock"
#: The data of every lock node.
DIR_MARK = b'{"celery-dlock": "lock"}'
_CHILD = re.compile(r"^(?P<guid>[0-9a-f]{16})-lock-(?P<seq>[0-9]{10})$")


def _segment(text: str) -> str:
    # Percent-encode everything but letters, digits and "-_~"; a dot too, so that no
    # name spells "." or "..".
    return quote(text, safe="-_~").replace(".", "%2E")


def prefix_path(prefix: str) -> str:
    return "/" + _segment(prefix)


def lock_path(prefix: str, name: str) -> str:
    """The lock node of ``name`` under ``prefix``."""
    return f"{prefix_path(prefix)}/{_segment(name)}"


def rates_path(prefix: str) -> str:
    """The rates subtree under ``prefix``."""
    return f"{prefix_path(prefix)}/{RATES_DIR}"


def rate_path(prefix: str, name: str) -> str:
    """The rate node of ``name`` under ``prefix``."""
    return f"{rates_path(prefix)}/{_segment(name)}"


def markers_path(prefix: str) -> str:
    """The queue markers' subtree under ``prefix``."""
    return f"{prefix_path(prefix)}/{MARKERS_DIR}"


def marker_path(prefix: str, name: str) -> str:
    """The queue markers' node of ``name`` under ``prefix``."""
    return f"{markers_path(prefix)}/{_segment(name)}"


def clock_path(subtree: str) -> str:
    """The node whose writes read the ensemble's clock for the nodes of ``subtree``
    (:func:`rates_path` or :func:`markers_path`)."""
    return f"{subtree}/{_CLOCK}"


def is_name_segment(segment: str) -> bool:
    """Whether ``segment`` can be an encoded name (not a subtree, nor a clock: a
    name's segment has no dot)."""
    return "." not in segment


def decode_dir(segment: str) -> str:
    """The lock name of a lock node's last segment."""
    return unquote(segment)


def child_prefix(guid: str) -> str:
    """What a child's path starts with after the lock node (the server appends the
    sequence)."""
    return f"{guid}-lock-"


def sequence_of(child: str, where: str) -> tuple[int, str]:
    """``(sequence, guid)`` of a child's name; LockKeyConflict for another shape."""
    found = _CHILD.match(child)
    if found is None:
        raise LockKeyConflict(f"ZooKeeper node {where + '/' + child!r} under {where!r} "
                              f"was not written by "
                              f"celery-dlock (another application uses this path?): "
                              f"nothing was changed; choose another prefix or name")
    return int(found["seq"]), found["guid"]


@dataclass
class NodeData:
    """What a child says (see the module text)."""

    owner: str
    count: int
    ttl_ms: int
    op: str = ""
    acquired_at: float | None = None
    pid: int | None = None
    info: dict[str, str] = field(default_factory=dict)
    #: How many hold at once (above 1: a semaphore's slot, or a place in its line).
    limit: int = 1

    def encode(self) -> bytes:
        fields: dict[str, Any] = {"dlock": 1, "owner": self.owner, "count": self.count,
                                  "ttl": self.ttl_ms, "op": self.op,
                                  "acquired_at": self.acquired_at, "pid": self.pid,
                                  "info": self.info}
        if self.limit > 1:  # a lock's children stay as they always were
            fields["limit"] = self.limit
        return json.dumps(fields, separators=(",", ":")).encode()

    def holder(self, fence: int, now: float) -> Holder:
        age = None if self.acquired_at is None else max(0.0, now - self.acquired_at)
        info = dict(self.info)
        if self.pid is not None:
            info["pid"] = str(self.pid)
        return Holder(owner=self.owner, count=self.count, fence=fence, age=age,
                      ttl=self.ttl_ms / 1000.0, info=info)


def decode_node(raw: bytes, where: str) -> NodeData:
    """A child's data; LockKeyConflict when it is not celery-dlock's."""
    try:
        data: Any = json.loads(raw.decode())
        if not isinstance(data, dict) or data.get("dlock") != 1:
            raise ValueError
        info = data.get("info") or {}
        pid = data.get("pid")
        at = data.get("acquired_at")
        limit = int(data.get("limit") or 1)
        if limit < 1:
            raise ValueError
        return NodeData(owner=str(data["owner"]), count=int(data["count"]),
                        ttl_ms=int(data["ttl"]), op=str(data.get("op") or ""),
                        acquired_at=float(at) if at is not None else None,
                        pid=int(pid) if pid is not None else None,
                        info={str(k): str(v) for k, v in info.items()},
                        limit=limit)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError):
        raise LockKeyConflict(f"ZooKeeper node {where!r} holds data celery-dlock did "
                              f"not write (another application uses this path?): "
                              f"nothing was changed; choose another prefix or name"
                              ) from None
