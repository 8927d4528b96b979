"""The PostgreSQL lease row's key of a lock: its prefix and name as the ``prefix``
and ``name`` columns hold them.

A lock's name may be anything the other stores take: 5,000 characters, a NUL, any
Unicode.  A ``text`` column cannot hold a NUL, and a primary key's index entry must
fit in about 2,700 bytes, so a component PostgreSQL cannot key as it is is keyed by
its digest instead (:func:`row_key`): :data:`DIGEST_MARK` and the SHA-256 of its
UTF-8 bytes.  Every other component is kept as it is, as the releases before this one
kept it, so a rolling deploy finds the same rows.  A name that itself begins with
:data:`DIGEST_MARK` is digested too: no name can pass for another's digest.

The digested name itself is kept beside the key, in the row's ``info``
(:data:`~..lease.NAME_FIELD`), for ``celery dlock ls`` (a NUL there is shown as
``\\0``: ``jsonb`` cannot hold one either).

No driver is imported here.
"""

from __future__ import annotations

import hashlib

__all__ = ["DIGEST_MARK", "RAW_MAX_BYTES", "is_raw", "row_key", "row_part", "shown_name"]

#: The most UTF-8 bytes of a prefix or a name kept as they are: two such, and the
#: index entry's own bytes, stay under the primary key's limit (2,704 bytes).
RAW_MAX_BYTES = 1000
#: What a digested component begins with (U+0001: no name a person types does).
DIGEST_MARK = "\x01sha256:"


def is_raw(part: str) -> bool:
    """Whether the column holds ``part`` as it is."""
    return ("\x00" not in part and not part.startswith(DIGEST_MARK)
            and len(part.encode("utf-8")) <= RAW_MAX_BYTES)


def row_part(part: str) -> str:
    """``part`` (a prefix or a name) as its column holds it."""
    if is_raw(part):
        return part
    return DIGEST_MARK + hashlib.sha256(part.encode("utf-8")).hexdigest()


def row_key(prefix: str, name: str) -> tuple[str, str]:
    """The lease row's ``(prefix, name)`` of a lock."""
    return row_part(prefix), row_part(name)


def shown_name(name: str) -> str:
    """``name`` as ``jsonb`` can keep it, to be shown (a NUL as ``\\0``)."""
    return name.replace("\x00", "\\0")
