"""Who released a semaphore's holds by force, and why (ZooKeeper).

A holder whose child is gone cannot read why from the child.  So a force release of a
semaphore's holds (``by``/``reason`` given) notes each hold it frees in a node of its
own beside the lock nodes, in the same ZooKeeper transaction as the child's delete
(both happen, or neither)::

    /dlock/.released                      the notes' subtree (a dot: no lock name's node)
        thumbs                            one node per name, encoded as lock nodes are

Its data is JSON: ``{"dlock_released": 1, "holds": [{"owner", "fence", "by",
"reason", "at"}, ...]}``, the last :data:`KEEP` holds freed by force, newest last.  The
holder finds its own note (its owner and fence) when it asks why its node is gone:
``lost_reason`` then says ``released by <by>: <reason>``, as on Redis and SQL.
Nodes are never deleted (one small node stays per name ever released by force with a
reason).  A lock's (``limit`` 1) force release notes nothing (docs/backends.md).
"""

from __future__ import annotations

import json
import time
from typing import Any

from ...core.errors import LockKeyConflict
from ...core.text import clean_text
from .nodes import is_name_segment, lock_path, prefix_path

__all__ = ["KEEP", "RELEASED_DIR", "add_note", "note_for", "notes_path",
           "released_path", "released_path_of"]

#: The last segment of the notes' subtree under a prefix node.
RELEASED_DIR = ".released"
#: How many notes a name's node keeps (the newest).
KEEP = 16


def notes_path(prefix: str) -> str:
    """The notes' subtree under ``prefix``."""
    return f"{prefix_path(prefix)}/{RELEASED_DIR}"


def released_path(prefix: str, name: str) -> str:
    """The notes' node of ``name`` under ``prefix``."""
    return f"{notes_path(prefix)}/{lock_path(prefix, name).rsplit('/', 1)[1]}"


def released_path_of(child: str) -> str | None:
    """The notes' node of the lock a hold's child (``/<prefix>/<name>/<child>``)
    belongs to; None for another shape of path."""
    parts = child.split("/")
    if len(parts) != 4 or parts[0] or not is_name_segment(parts[2]):
        return None
    return f"/{parts[1]}/{RELEASED_DIR}/{parts[2]}"


def _decode(raw: bytes | None, where: str) -> list[dict[str, Any]]:
    if not raw:
        return []
    try:
        data = json.loads(raw.decode())
        if not isinstance(data, dict) or data.get("dlock_released") != 1:
            raise ValueError
        holds = data.get("holds") or []
        if not isinstance(holds, list):
            raise ValueError
        return [h for h in holds if isinstance(h, dict)]
    except (ValueError, UnicodeDecodeError):
        raise LockKeyConflict(f"ZooKeeper node {where!r} holds data celery-dlock did "
                              f"not write (another application uses this path?): "
                              f"nothing was changed; choose another prefix or name"
                              ) from None


def add_note(raw: bytes | None, where: str, owner: str, fence: int, by: str | None,
             reason: str | None) -> bytes:
    """The notes' node data ``raw`` with one more note (the oldest beyond
    :data:`KEEP` dropped); LockKeyConflict when ``raw`` is not celery-dlock's."""
    holds = _decode(raw, where)
    holds.append({"owner": owner, "fence": fence, "by": clean_text(by),
                  "reason": clean_text(reason), "at": time.time()})
    return json.dumps({"dlock_released": 1, "holds": holds[-KEEP:]},
                      separators=(",", ":")).encode()


def note_for(raw: bytes | None, owner: str, fence: int | None) -> tuple[int, str] | None:
    """``(fence, "released by ...")`` of the newest note naming ``owner``'s hold (and
    ``fence``, when given); None when there is none, or the data is not ours."""
    try:
        holds = _decode(raw, "")
    except LockKeyConflict:
        return None
    for note in reversed(holds):
        if note.get("owner") != owner:
            continue
        try:
            freed = int(note.get("fence"))
        except (TypeError, ValueError):
            continue
        if fence is not None and freed != fence:
            continue
        by = clean_text(note.get("by")) or "someone"
        why = clean_text(note.get("reason"))
        return freed, (f"released by {by}: {why}" if why else f"released by {by}")
    return None
