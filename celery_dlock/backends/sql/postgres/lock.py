"""``PostgresLock``: a reentrant, renewed, owner-checked lock kept in a PostgreSQL
lease table (docs/backends.md, PostgreSQL).

One row per lock name (:mod:`.schema`); every operation is one autocommitted statement
on the server's clock (:mod:`.statements`), so a hold's ttl is counted by the server,
the connection may be pooled, and a call re-sent after a lost reply (with the same
operation id) is answered as the first.  Fences are a per-name counter kept in the row
past release.  Blocked acquirers stand in a FIFO line table beside it, each with a
lease it renews by trying again: a free lock goes to the first live waiter in line
(or to anyone when the line is empty), and a non-blocking acquire never overtakes a
waiter.  Waiters ``LISTEN`` and are ``NOTIFY``-ed by the release
(:mod:`.waiting`); the process's scheduler renews every hold of a server with one
statement per interval (:mod:`.renewal`) and tells the holder at its local deadline,
before the server lets anyone else in.  What the row's answers mean is
:class:`~..lease.LeaseLock`'s (shared with MySQL/MariaDB); the bookkeeping is
:class:`~celery_dlock.core.hold.Hold`, the one every lock kind shares.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ....core.renew_target import RenewTarget
from ..lease import NAME_FIELD, LeaseLock, Status, holder_of, renew_key
from .keys import is_raw, row_key, shown_name
from .renewal import renew_target
from .server import PgServer, server_for
from .statements import (
    ACQUIRE,
    EXTEND,
    HEAD,
    HOLD,
    LEAVE,
    LINE,
    REENTER,
    RELEASE,
    STATUS,
)
from .waiting import QUEUE_LEASE_MS, WAIT_SLICE, Listener, channel_of

__all__ = ["PostgresLock", "holder_of"]


class PostgresLock(LeaseLock[PgServer]):
    """A reentrant distributed lock in a PostgreSQL table.

    :param url: the server's ``postgresql://`` URL (``?dlock_table=`` names another
        table than ``dlock_locks``), or a :class:`~.server.PgServer`.
    Every other parameter, and every error, is :class:`~..lease.LeaseLock`'s.
    """

    wait_slice = WAIT_SLICE

    server_of = staticmethod(server_for)

    def _prepare(self) -> None:
        self.channel = channel_of(self.prefix, self.name)
        self._key_row(self.prefix, self.name)
        self._info.pop(NAME_FIELD, None)
        if not is_raw(self.name):
            self._info[NAME_FIELD] = shown_name(self.name)
        self._listener: Listener | None = None

    def _key_row(self, prefix: str, name: str) -> None:
        # The row's key: the prefix and name, or their digests (:mod:`.keys`).
        self.row_prefix, self.row_name = row_key(prefix, name)

    # -- talking to PostgreSQL --------------------------------------------------------

    def _params(self, owner: str, **more: Any) -> dict[str, Any]:
        return {"prefix": self.row_prefix, "name": self.row_name, "owner": owner,
                **more}

    def _run(self, statement: Any, params: Mapping[str, Any],
             what: str) -> list[tuple[Any, ...]]:
        return self.server.run(statement.format(t=self.server.table,
                                                w=self.server.line_table),
                               params, what, self.name)

    def _try_acquire(self, owner: str, op: str, ttl_ms: int, queue: bool
                     ) -> tuple[int, int] | None:
        # jsonb holds no NUL: one in a field (an argument shown in the metadata) is
        # kept as \0 rather than refused.
        info = json.dumps({shown_name(k): shown_name(v)
                           for k, v in {**self._info, "pid": str(os.getpid())}.items()})
        rows = self._run(ACQUIRE, self._params(
            owner, op=op, ttl=ttl_ms, info=info, lease=QUEUE_LEASE_MS if queue else 0,
            fstep=self.fence_step, fslot=self.fence_slot),
            "acquire")
        return (int(rows[0][0]), int(rows[0][1])) if rows else None

    def _head(self, owner: str) -> tuple[str | None, float] | None:
        rows = self._run(HEAD, self._params(owner), "a read")
        return (rows[0][0], float(rows[0][1])) if rows else None

    def _try_leave(self, owner: str) -> None:
        self._run(LEAVE, self._params(owner, channel=self.channel), "leaving the line")

    def _line(self) -> list[str]:
        return [str(row[0]) for row in self._run(LINE, self._params(""), "a read")]

    def _try_reenter(self, owner: str, op: str, ttl_ms: int,
                     fence: int | None) -> int | None:
        rows = self._run(REENTER, self._params(owner, op=op, ttl=ttl_ms, fence=fence),
                         "acquire")
        return int(rows[0][0]) if rows else None

    def _try_release(self, owner: str, op: str) -> int | None:
        rows = self._run(RELEASE, self._params(owner, op=op, channel=self.channel),
                         "release")
        return int(rows[0][0]) if rows else None

    def _try_extend(self, owner: str, ttl_ms: int) -> bool:
        return bool(self._run(EXTEND, self._params(owner, ttl=ttl_ms), "extend"))

    def _status_of(self, owner: str, op: str) -> Status | None:
        rows = self._run(STATUS, self._params(owner, op=op), "a read")
        if not rows:
            return None
        holder, live, _, applied, _, forced = rows[0]
        return Status(holder, bool(live), bool(applied), forced)

    def _hold_row(self) -> tuple[Any, ...] | None:
        rows = self._run(HOLD, self._params(""), "a read")
        return rows[0] if rows else None

    def _sleep_turn(self, seconds: float) -> None:
        if self._listener is None:
            self._listener = Listener(self.server, self.channel)
        self._listener.wait(seconds)

    def _stop_waiting(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def _renew_key(self) -> str:
        return renew_key(self.row_prefix, self.row_name)

    def _renew_target(self) -> RenewTarget | None:
        target: RenewTarget = renew_target(self.server)
        return target
