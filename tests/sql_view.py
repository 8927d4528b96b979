"""What the SQL kinds' views share (``PgView`` in tests/lock_kinds.py, ``MyView`` in
tests/my_kind.py): the Redis reads the tests make, answered from the lease and line
tables.  A live hold's row is the lock's hash (``owner``, ``count``, ``fence`` and its
info fields), its ``expires_at`` its pttl; the lock's rows in the line table are its
``queue`` (the live ones, by arrival) and ``leases`` (their expiry, in ms), which
exist while any row is left, as Redis's keys do until purged; doorbells never exist.

A dialect's view says how a lock's row is keyed (:meth:`SqlView._row`) and reads the
hold (``_hold``) and the line (``_line``, ``_line_rows``).
"""

from __future__ import annotations

import json
from typing import Any


class SqlView:
    """The Redis reads of the tests on a SQL kind's tables (a dialect subclasses it)."""

    LINE = "dlock_locks_waiters"

    @staticmethod
    def _row(prefix: str, name: str) -> Any:
        """The key of the lock's row in the dialect's tables."""
        raise NotImplementedError

    @classmethod
    def _parse(cls, key: str) -> tuple[Any, str] | None:
        """``(the row's key, part)``: part is ``lock``, ``queue``, ``leases`` or
        ``doorbell``."""
        end = key.rfind("]") + 1
        rest = key[end:]
        part = rest.split(":")[1] if rest.startswith(":") else "lock"
        try:
            prefix, name = json.loads(key[:end])
        except ValueError:
            return None
        return cls._row(str(prefix), str(name)), part

    @classmethod
    def _row_key(cls, key: str) -> Any:
        """The row's key of a lock key (None for another key)."""
        found = cls._parse(key)
        return found[0] if found is not None and found[1] == "lock" else None

    def _line_key(self, key: str) -> Any:
        """The row's key of a ``queue``/``leases`` key (None for another key)."""
        found = self._parse(key)
        return found[0] if found is not None and found[1] in ("queue", "leases") \
            else None

    def _hold(self, key: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def _line(self, key: str) -> list[tuple[str, int, int]] | None:
        """The live waiters of a ``queue``/``leases`` key: owner, arrival (µs) and
        lease expiry (ms) on the server's clock; None for another key."""
        raise NotImplementedError

    def _line_rows(self, key: str) -> int:
        """How many rows (live or not) the lock of a ``queue``/``leases`` key has in
        the line table."""
        raise NotImplementedError

    def exists(self, *keys: str) -> int:
        return sum(self._hold(k) is not None or self._line_rows(k) > 0 for k in keys)

    def hget(self, key: str, field: str) -> bytes | None:
        hold = self._hold(key)
        if hold is None or field not in hold or field == "pttl":
            return None
        return str(hold[field]).encode()

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        hold = self._hold(key) or {}
        return {k.encode(): str(v).encode() for k, v in hold.items() if k != "pttl"}

    def pttl(self, key: str) -> int:
        hold = self._hold(key)
        return -2 if hold is None else int(hold["pttl"])

    def zrange(self, key: str, start: int, end: int) -> list[bytes]:
        line = self._line(key) or []
        if key.endswith(":leases"):
            line.sort(key=lambda w: (w[2], w[0]))
        stop = len(line) if end == -1 else end + 1
        return [owner.encode() for owner, _, _ in line[start:stop]]

    def zscore(self, key: str, member: str) -> float | None:
        for owner, arrived, expires in self._line(key) or []:
            if owner == member:
                return float(expires if key.endswith(":leases") else arrived)
        return None
