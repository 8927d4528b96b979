"""One lock name's small keyspace as a document: :class:`ExpiringKeys`, a few named
keys (a string, hashes, sorted sets), each with its own expiry on the server's clock,
with the few commands the queue markers' steps use and the meaning Redis gives them
(a key past its expiry is gone; a hash or sorted set left empty is gone; ``PTTL`` is
-2 for a missing key and -1 for one without expiry).

The marker protocol is written once as Redis scripts (the Redis backend runs them
where its data lives) and once over this document (:mod:`.marker_steps`), for the
stores that keep one name's markers as one row or node and write it by
compare-and-set.  Each step runs on the document as read, at the server's time read
with it (``now``, ms), and :attr:`ExpiringKeys.changed` says whether it wrote.

No store is imported here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["ExpiringKeys"]

#: Each key's kind, by its first letter in the stored form.
_STRING, _HASH, _ZSET = "s", "h", "z"


class ExpiringKeys:
    """The keys of one document at ``now`` (ms, the server's clock): those whose
    expiry is past are gone."""

    def __init__(self, stored: str | None, now: int) -> None:
        self.now = now
        self.changed = False
        self._keys: dict[str, tuple[str, Any, int | None]] = {}
        if stored:
            for key, (kind, value, until) in json.loads(stored).items():
                if until is None or until > now:
                    self._keys[key] = (kind, value, until)

    # -- the stored form --------------------------------------------------------------

    def dumps(self) -> str:
        """The document as stored (JSON: key -> [kind, value, expiry ms or null])."""
        return json.dumps({k: list(v) for k, v in sorted(self._keys.items())},
                          separators=(",", ":"))

    def expires(self) -> int | None:
        """When the last key expires (ms); None when one never does, ``now`` when
        there is no key."""
        until = [entry[2] for entry in self._keys.values()]
        if not until:
            return self.now
        if None in until:
            return None
        return max(u for u in until if u is not None)

    # -- keys -------------------------------------------------------------------------

    def _value(self, key: str, kind: str) -> Any:
        entry = self._keys.get(key)
        if entry is None:
            return None
        if entry[0] != kind:  # pragma: no cover - the steps use one kind per key
            raise TypeError(f"{key!r} holds a {entry[0]}, not a {kind}")
        return entry[1]

    def _put(self, key: str, kind: str, value: Any, until: int | None) -> None:
        self._keys[key] = (kind, value, until)
        self.changed = True

    def _keep(self, key: str, kind: str, value: Any) -> None:
        """Write a hash's or sorted set's new value, keeping its expiry (gone when
        empty)."""
        if not value:
            self.delete(key)
            return
        entry = self._keys.get(key)
        self._put(key, kind, value, None if entry is None else entry[2])

    def delete(self, *keys: str) -> int:
        """``DEL``: how many of ``keys`` were there."""
        gone = 0
        for key in keys:
            if self._keys.pop(key, None) is not None:
                gone += 1
                self.changed = True
        return gone

    def pttl(self, key: str) -> int:
        """``PTTL``: ms left; -2 missing, -1 without expiry."""
        entry = self._keys.get(key)
        if entry is None:
            return -2
        return -1 if entry[2] is None else entry[2] - self.now

    def pexpire(self, key: str, ms: int) -> None:
        """``PEXPIRE``: a missing key stays missing."""
        entry = self._keys.get(key)
        if entry is not None:
            self._put(key, entry[0], entry[1], self.now + int(ms))

    # -- a string ---------------------------------------------------------------------

    def get(self, key: str) -> str | None:
        value: str | None = self._value(key, _STRING)
        return value

    def set(self, key: str, value: str, px: int) -> None:
        """``SET key value PX px``."""
        self._put(key, _STRING, value, self.now + int(px))

    # -- a hash -----------------------------------------------------------------------

    def _hash(self, key: str) -> dict[str, str]:
        value: dict[str, str] | None = self._value(key, _HASH)
        return dict(value) if value else {}

    def hget(self, key: str, field: str) -> str | None:
        return self._hash(key).get(field)

    def hmget(self, key: str, *fields: str) -> list[str | None]:
        found = self._hash(key)
        return [found.get(f) for f in fields]

    def hset(self, key: str, fields: Mapping[str, object]) -> None:
        """``HSET``: values kept as text, as Redis keeps them."""
        found = self._hash(key)
        found.update({f: _text(v) for f, v in fields.items()})
        self._keep(key, _HASH, found)

    def hdel(self, key: str, *fields: str) -> int:
        found = self._hash(key)
        gone = [f for f in fields if found.pop(f, None) is not None]
        if gone:
            self._keep(key, _HASH, found)
        return len(gone)

    # -- a sorted set -----------------------------------------------------------------

    def _zset(self, key: str) -> dict[str, int]:
        value: dict[str, int] | None = self._value(key, _ZSET)
        return dict(value) if value else {}

    def zscore(self, key: str, member: str) -> int | None:
        return self._zset(key).get(member)

    def zadd(self, key: str, score: int, member: str) -> None:
        found = self._zset(key)
        found[member] = int(score)
        self._keep(key, _ZSET, found)

    def zrem(self, key: str, member: str) -> int:
        found = self._zset(key)
        if found.pop(member, None) is None:
            return 0
        self._keep(key, _ZSET, found)
        return 1

    def zremrangebyscore_upto(self, key: str, top: int) -> None:
        """``ZREMRANGEBYSCORE key -inf top``."""
        found = self._zset(key)
        kept = {m: s for m, s in found.items() if s > top}
        if len(kept) != len(found):
            self._keep(key, _ZSET, kept)


def _text(value: object) -> str:
    if isinstance(value, bool):  # pragma: no cover - the steps write no booleans
        raise TypeError("a hash field holds text or a number")
    return value if isinstance(value, str) else str(value)
