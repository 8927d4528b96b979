"""``MySQLLock``: a reentrant, renewed, owner-checked lock kept in a MySQL or MariaDB
lease table (docs/backends.md, MySQL / MariaDB).

One InnoDB row per lock name (:mod:`.schema`), on the server's clock.  Acquire,
re-entry and release are each one short transaction: the row read ``FOR UPDATE``,
the answer decided on it, one write (:mod:`.statements` says why one statement
cannot); extend and renewal are one autocommitted ``UPDATE``.  A call re-sent after a
lost reply (with the same operation id) is answered as the first; fences are a
per-name counter kept in the row past release.  Blocked acquirers stand in a FIFO line
table beside it (:mod:`.schema`), each with a lease it renews by trying again: a
free lock goes to the first live waiter in line (or to anyone when the line is
empty), and a non-blocking acquire never overtakes a waiter.  MySQL cannot wake a
waiter: a blocked acquirer polls, more often the nearer it stands to the front of the
line (only the first in line can take a freed lock): every :data:`POLL_FIRST` times
its place (1 for the first), at most :data:`POLL_MAX` apart, and never past the
holder's remaining ttl.  The process's scheduler renews every hold of a server with
one statement per interval (:mod:`.renewal`).  What the answers mean is
:class:`~..lease.LeaseLock`'s (shared with PostgreSQL); the bookkeeping is
:class:`~celery_dlock.core.hold.Hold`'s.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Mapping
from typing import Any

from ....core.errors import InvalidLockConfig
from ....core.renew_target import RenewTarget
from ..lease import LeaseLock, Status, renew_key
from .renewal import renew_target
from .schema import BLOB_MAX_BYTES, lock_id, owner_id
from .server import MyServer, server_for
from .statements import (
    AHEAD,
    EXTEND,
    HEAD,
    HOLD,
    INSERT,
    JOIN,
    LEAVE,
    LEFT,
    LINE,
    REENTER,
    RELEASE,
    ROW,
    STATUS,
    TAKE,
)

__all__ = ["POLL_FIRST", "POLL_MAX", "QUEUE_LEASE", "MySQLLock"]

#: The sleep of the first waiter in line between two tries (seconds, jittered by
#: +-20 %): about the longest a freed lock waits for it.  The waiter at place ``k``
#: (1 for the first) sleeps ``k`` times as long, at most :data:`POLL_MAX`: the line
#: moves only as fast as its first waiter notices a release, and the others need only
#: keep up with it.
POLL_FIRST = 0.05
POLL_MAX = 0.5
#: How long a waiter keeps its place in line without trying again (seconds): the
#: same as PostgreSQL's and Redis's, ten of its longest polls.
QUEUE_LEASE = 5.0

def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, (bytes, bytearray)) else value


class MySQLLock(LeaseLock[MyServer]):
    """A reentrant distributed lock in a MySQL or MariaDB table.

    :param url: the server's ``mysql://user:password@host:port/database`` (or
        ``mariadb://``) URL (``?dlock_table=`` names another table than
        ``dlock_locks``), or a :class:`~.server.MyServer`.
    Every other parameter, and every error, is :class:`~..lease.LeaseLock`'s.
    """

    wait_slice = POLL_MAX

    server_of = staticmethod(server_for)

    def _prepare(self) -> None:
        self._check_sizes()
        self._key_row(self.prefix, self.name)
        # How many waiters stood before this object's owner at its last refused try
        # (0: it was first).
        self._ahead = 0

    def _key_row(self, prefix: str, name: str) -> None:
        """Address the row of the lock ``(prefix, name)`` (a semaphore's slots
        address several: :mod:`.semaphore`)."""
        self.row_prefix, self.row_name = prefix, name
        self.lock_id = lock_id(prefix, name)

    def _check_sizes(self) -> None:
        """InvalidLockConfig, naming the limit, for a prefix, name or info longer than
        its column holds (MySQL would refuse each acquire)."""
        info = json.dumps({**self._info, "pid": "9" * 10})  # as an acquire writes it
        for what, text, column in (("prefix", self.prefix, "BLOB"),
                                   ("name", self.name, "BLOB"), ("info", info, "TEXT")):
            size = len(text.encode())
            if size > BLOB_MAX_BYTES:
                raise InvalidLockConfig(
                    f"the lock's {what} takes {size:,} bytes (info as JSON): MySQL's "
                    f"{column} column holds at most {BLOB_MAX_BYTES:,} "
                    f"(docs/backends.md, MySQL / MariaDB)", lock_name=self.name)

    # -- talking to MySQL -------------------------------------------------------------

    def _params(self, owner: str, **more: Any) -> dict[str, Any]:
        return {"id": self.lock_id, "owner": owner, **more}

    def _sql(self, statement: str) -> str:
        return statement.format(t=self.server.table, w=self.server.line_table)

    def _one(self, statement: str, params: Mapping[str, Any],
             what: str) -> tuple[Any, ...] | None:
        def work(cur: Any) -> tuple[Any, ...] | None:
            cur.execute(self._sql(statement), params)
            row = cur.fetchone()
            return None if row is None else tuple(row)
        return self.server.run(work, what, self.name)

    def _locked_row(self, cur: Any, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """The lease row, locked until the transaction ends (:data:`ROW`'s columns,
        the owner as text)."""
        cur.execute(self._sql(ROW), params)
        row = cur.fetchone()
        return None if row is None else (_text(row[0]), *row[1:])

    def _try_acquire(self, owner: str, op: str, ttl_ms: int, queue: bool
                     ) -> tuple[int, int] | None:
        info = json.dumps({**self._info, "pid": str(os.getpid())})
        params = self._params(owner, op=op, ttl=ttl_ms, ttl_us=ttl_ms * 1000, info=info,
                              prefix=self.row_prefix, name=self.row_name,
                              owner_id=owner_id(owner),
                              lease_us=int(QUEUE_LEASE * 1_000_000),
                              fstep=self.fence_step, fslot=self.fence_slot)

        def refused(cur: Any) -> None:
            if queue:  # join the line, or keep one's place and renew its lease
                cur.execute(self._sql(JOIN), params)
                cur.execute(self._sql(AHEAD), params)
                self._ahead = int(cur.fetchone()[0])

        def work(cur: Any) -> tuple[int, int] | None:
            row = self._locked_row(cur, params)
            if row is not None:
                holder, count, fence, live, applied, _ = row
                if holder == owner and live:  # the owner's own hold: a re-entry
                    add = 0 if applied else 1
                    cur.execute(self._sql(REENTER), {**params, "add": add})
                    return int(fence), int(count) + add
                if holder is not None and live:  # another owner's live hold
                    refused(cur)
                    return None
            # Free (or expired, or never held): the first live waiter's turn.
            cur.execute(self._sql(HEAD), params)
            head = cur.fetchone()
            if head is not None and _text(head[0]) != owner:
                refused(cur)
                return None
            if row is None:
                cur.execute(self._sql(INSERT), params)
                cur.execute(self._sql("SELECT fence FROM {t} WHERE lock_id = %(id)s"),
                            params)
                fence = int(cur.fetchone()[0])
            else:
                fence = max(int(row[2]) + self.fence_step,
                            int(row[5]) * self.fence_step + self.fence_slot)
                cur.execute(self._sql(TAKE), {**params, "fence": fence})
            cur.execute(self._sql(LEFT), params)
            return fence, 1

        return self.server.run(work, "acquire", self.name, transaction=True)

    def _head(self, owner: str) -> tuple[str | None, float] | None:
        head = self._one(HEAD, self._params(owner), "a read")
        return None if head is None else (_text(head[0]), float(head[1]))

    def _try_leave(self, owner: str) -> None:
        params = self._params(owner, owner_id=owner_id(owner))

        def work(cur: Any) -> None:
            cur.execute(self._sql(LEAVE), params)

        self.server.run(work, "leaving the line", self.name)

    def _line(self) -> list[str]:
        def work(cur: Any) -> list[str]:
            cur.execute(self._sql(LINE), self._params(""))
            return [_text(row[0]) or "" for row in cur.fetchall()]

        return self.server.run(work, "a read", self.name)

    def _try_reenter(self, owner: str, op: str, ttl_ms: int,
                     fence: int | None) -> int | None:
        params = self._params(owner, op=op, ttl=ttl_ms, ttl_us=ttl_ms * 1000)

        def work(cur: Any) -> int | None:
            row = self._locked_row(cur, params)
            if row is None:
                return None
            holder, _, found, live, applied, _ = row
            if holder != owner or not live or \
                    (fence is not None and int(found) != fence):
                return None
            cur.execute(self._sql(REENTER), {**params, "add": 0 if applied else 1})
            return int(found)

        return self.server.run(work, "acquire", self.name, transaction=True)

    def _try_release(self, owner: str, op: str) -> int | None:
        params = self._params(owner, op=op)

        def work(cur: Any) -> int | None:
            row = self._locked_row(cur, params)
            if row is None:
                return None
            holder, count, _, live, applied, _ = row
            if holder != owner or not live or applied:
                return None
            left = max(0, int(count) - 1)
            cur.execute(self._sql(RELEASE), {**params, "count": left})
            return left

        return self.server.run(work, "release", self.name, transaction=True)

    def _try_extend(self, owner: str, ttl_ms: int) -> bool:
        params = self._params(owner, ttl=ttl_ms, ttl_us=ttl_ms * 1000)

        def work(cur: Any) -> bool:
            return bool(cur.execute(self._sql(EXTEND), params))

        return self.server.run(work, "extend", self.name)

    def _status_of(self, owner: str, op: str) -> Status | None:
        row = self._one(STATUS, self._params(owner, op=op), "a read")
        if row is None:
            return None
        holder, live, applied, forced = row
        return Status(_text(holder), bool(live), bool(applied), forced)

    def _hold_row(self) -> tuple[Any, ...] | None:
        return self._one(HOLD, self._params(""), "a read")

    def _sleep_turn(self, seconds: float) -> None:
        """Poll: MySQL cannot wake a waiter.  :data:`POLL_FIRST` times the waiter's
        place in line, at most :data:`POLL_MAX` (jittered, so waiters spread out)."""
        poll = min(POLL_MAX, POLL_FIRST * (self._ahead + 1))
        time.sleep(min(seconds, poll * random.uniform(0.8, 1.2)))

    def _stop_waiting(self) -> None:
        self._ahead = 0

    def _renew_key(self) -> str:
        return renew_key(self.row_prefix, self.row_name)

    def _renew_target(self) -> RenewTarget | None:
        target: RenewTarget = renew_target(self.server)
        return target
