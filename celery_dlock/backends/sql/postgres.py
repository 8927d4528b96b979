"""``PostgresLock``: a reentrant, renewed, owner-checked lock kept in a PostgreSQL
lease table (docs/backends.md, PostgreSQL).

One row per lock name (:mod:`.schema`); every operation is one autocommitted statement
on the server's clock (:mod:`.statements`), so a hold's ttl is counted by the server,
the connection may be pooled, and a call re-sent after a lost reply (with the same
operation id) is answered as the first.  Fences are a per-name counter kept in the row
past release.  Waiters ``LISTEN`` and are ``NOTIFY``-ed by the release
(:mod:`.waiting`); the process's scheduler renews every hold of a server with one
statement per interval (:mod:`.renewal`) and tells the holder at its local deadline,
before the server lets anyone else in.  The bookkeeping is
:class:`~celery_dlock.core.hold.Hold`, the one every lock kind shares.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from ...core.errors import Holder
from ...core.hold import (
    DEFAULT_PREFIX,
    Grant,
    Hold,
    Refused,
    check_lock_options,
    new_op_id,
)
from ...core.protocol import GONE, OK, STILL_HELD, TAKEN
from ...core.renew_target import RenewTarget
from ...core.scheduler import RenewalScheduler
from .pg_server import PgServer, server_for
from .released import forced_reason
from .renewal import renew_key, renew_target
from .statements import ACQUIRE, EXTEND, HOLD, REENTER, RELEASE, STATUS
from .waiting import WAIT_SLICE, Listener, channel_of

__all__ = ["PostgresLock", "holder_of"]

logger = logging.getLogger("celery_dlock.lock")


def holder_of(row: tuple[Any, ...]) -> Holder:
    """The :class:`Holder` of a :data:`~.statements.HOLD` row."""
    _, owner, count, fence, age, ttl, info = row
    return Holder(owner=owner, count=int(count), fence=int(fence),
                  age=None if age is None else max(0.0, float(age)),
                  ttl=None if ttl is None else max(0.0, float(ttl)),
                  info={str(k): str(v) for k, v in (info or {}).items()})


class PostgresLock(Hold):
    """A reentrant distributed lock in a PostgreSQL table.

    :param url: the server's ``postgresql://`` URL (``?dlock_table=`` names another
        table than ``dlock_locks``), or a :class:`~.pg_server.PgServer`.
    Every other parameter is :class:`~celery_dlock.RedisLock`'s.

    A server that cannot be reached is :class:`BackendUnavailable`; a table of
    another application at the lease table's name :class:`LockKeyConflict`; a user
    who may not create the table (or write it) :class:`InvalidLockConfig` naming the
    GRANTs it needs.
    """

    def __init__(
        self,
        url: str | PgServer,
        name: str,
        ttl: float = 30.0,
        *,
        auto_renew: bool = True,
        owner: str | None = None,
        on_lost: Callable[[PostgresLock], object] | None = None,
        prefix: str = DEFAULT_PREFIX,
        info: Mapping[str, object] | None = None,
        blocking_timeout: float | None = None,
        scheduler: RenewalScheduler | None = None,
        pause_budget: float | None = None,
        max_hold: float | None = None,
    ) -> None:
        info_args = check_lock_options(name, prefix, owner, blocking_timeout, info,
                                       pause_budget)
        super().__init__(name, ttl, owner=owner, on_lost=on_lost, scheduler=scheduler,
                         auto_renew=auto_renew, blocking_timeout=blocking_timeout,
                         pause_budget=pause_budget, max_hold=max_hold)
        self.server = url if isinstance(url, PgServer) else server_for(url)
        self.prefix = prefix
        self.channel = channel_of(prefix, name)
        self._info = dict(zip(info_args[::2], info_args[1::2], strict=True))
        self._listener: Listener | None = None

    # -- talking to PostgreSQL --------------------------------------------------------

    def _params(self, owner: str, **more: Any) -> dict[str, Any]:
        return {"prefix": self.prefix, "name": self.name, "owner": owner, **more}

    def _run(self, statement: Any, params: Mapping[str, Any],
             what: str) -> list[tuple[Any, ...]]:
        return self.server.run(statement.format(t=self.server.table), params, what,
                               self.name)

    def _status(self, owner: str, op: str = "") -> tuple[int, bool, Any]:
        """``OK``/``GONE``/``TAKEN`` for ``owner``, whether ``op`` was applied, and
        the last force release's note."""
        rows = self._run(STATUS, self._params(owner, op=op), "a read")
        if not rows:
            return GONE, False, None
        holder, live, _, applied, _, forced = rows[0]
        if holder is None or not live:
            return GONE, bool(applied), forced
        return (OK if holder == owner else TAKEN), bool(applied), forced

    def _send_acquire(self, owner: str, op: str, *, queue: bool,
                      reentry: bool) -> Grant | Refused | int:
        ttl = self._acquire_ttl_ms(reentry)  # never past a max_hold bound
        if reentry:
            rows = self._run(REENTER, self._params(owner, op=op, ttl=ttl,
                                                   fence=self._fence), "acquire")
            if not rows:
                return TAKEN if self._status(owner)[0] == TAKEN else GONE
            return Grant(int(rows[0][0]), True)
        info = json.dumps({**self._info, "pid": str(os.getpid())})
        rows = self._run(ACQUIRE, self._params(owner, op=op, ttl=ttl, info=info),
                         "acquire")
        if rows:
            self._stop_listening()
            return Grant(int(rows[0][0]), int(rows[0][1]) > 1)
        held = self._run(HOLD, self._params(owner), "a read")
        if not held:  # freed between the two statements: try again at once
            self.last_holder = None
            return Refused(0.0)
        self.last_holder = holder_of(held[0])
        ttl_left = self.last_holder.ttl
        return Refused(None if ttl_left is None else ttl_left + 0.001)

    def _wait_turn(self, owner: str, refused: Refused, left: float | None) -> None:
        slice_ = WAIT_SLICE if left is None else min(WAIT_SLICE, left)
        if refused.retry_in is not None:
            slice_ = min(slice_, refused.retry_in)
        if slice_ <= 0:
            return
        if self._listener is None:
            self._listener = Listener(self.server, self.channel)
        self._listener.wait(slice_)

    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def _leave_line(self, owner: str) -> None:
        self._stop_listening()

    def _give_back(self, owner: str) -> None:
        try:
            self._send_release(owner, new_op_id())
        except Exception as exc:  # it expires by itself
            logger.debug("could not give back %r: %s", self.name, exc)

    def _send_release(self, owner: str, op: str) -> int:
        rows = self._run(RELEASE, self._params(owner, op=op, channel=self.channel),
                         "release")
        if rows:
            return OK if int(rows[0][0]) == 0 else STILL_HELD
        code, applied, _ = self._status(owner, op)
        if applied:  # a re-sent release the server already applied
            return STILL_HELD if code == OK else OK
        return code

    def _send_extend(self, owner: str, ttl_ms: int, op: str) -> int:
        # EXTEND only ever moves the expiry later: a second execution changes nothing.
        if self._run(EXTEND, self._params(owner, ttl=ttl_ms), "extend"):
            return OK
        return self._status(owner)[0]

    def _read_status(self, owner: str) -> int:
        return self._status(owner)[0]

    def _renew_target(self) -> RenewTarget | None:
        target: RenewTarget = renew_target(self.server)
        return target

    def _renew_key(self) -> str:
        return renew_key(self.prefix, self.name)

    def _explain_loss(self, default: str, owner: str, fence: int | None) -> str:
        """``default``, or who released this hold by force and why."""
        try:
            forced = self._status(owner)[2]
        except Exception:
            return default
        note = forced_reason(forced, owner, fence)
        return default if note is None else note[1]

    # -- reading ----------------------------------------------------------------------

    def locked(self) -> bool:
        """Whether anyone holds the lock."""
        return bool(self._run(HOLD, self._params(""), "a read"))

    def holder(self) -> Holder | None:
        """Who holds the lock now (None when free)."""
        rows = self._run(HOLD, self._params(""), "a read")
        return holder_of(rows[0]) if rows else None

    def __repr__(self) -> str:
        return (f"<PostgresLock {self.name!r} ttl={self.ttl:g}s depth={self._depth} "
                f"fence={self._fence}>")
