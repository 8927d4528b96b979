"""What a backend shows of a hold: :class:`HoldInfo`, for ``celery dlock`` and
metrics, whatever the backend."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import DLockError

__all__ = ["SUMMARY_FIELDS", "HoldChanged", "HoldInfo"]

#: The fields of ``celery dlock ls`` (table columns and ``--json`` keys), in order.
SUMMARY_FIELDS = ("key", "task_name", "task_id", "worker", "pid", "owner", "count",
                  "fence", "ttl", "held_for")

@dataclass(frozen=True)
class HoldInfo:
    """One held lock, as its backend shows it at the moment it was read.

    ``ttl`` is the seconds left before the hold expires unless renewed (None if the key
    has no expiry, which the scripts never leave); ``held_for`` the seconds since this
    hold was taken (re-entries and renewals do not reset it), by the server's clock.
    ``task_name``, ``task_id`` and ``worker`` are set for holds taken by a
    :class:`~celery_dlock.LockedTask`; ``host`` and ``pid`` for every hold.  ``extra``
    holds any other metadata stored with the hold (``RedisLock(info=...)``).
    """

    key: str
    task_name: str | None
    task_id: str | None
    worker: str | None
    pid: int | None
    owner: str
    count: int
    fence: int | None
    ttl: float | None
    held_for: float | None
    host: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict, hash=False)
    #: A semaphore's slots (None: a lock); its other fields are then those of the
    #: holder whose slot frees first, and ``holders`` has every live holder.
    limit: int | None = None
    holders: tuple[HoldInfo, ...] = field(default=(), hash=False)
    #: The seconds each renewal gives the hold (its ttl as asked; None: the backend
    #: does not say).  With ``ttl``: how long ago it was last renewed
    #: (:attr:`unrenewed_for`).
    lease: float | None = None

    @property
    def unrenewed_for(self) -> float | None:
        """Seconds since the hold's expiry was last set (its acquire, renewal or
        extend), by the server's clock; None when the backend does not say."""
        if self.lease is None or self.ttl is None:
            return None
        return max(0.0, self.lease - self.ttl)

    @property
    def slots(self) -> str | None:
        """``used/limit`` for a semaphore (None for a lock)."""
        return None if self.limit is None else f"{len(self.holders)}/{self.limit}"

    @classmethod
    def matched(cls, name: str, conditions: Mapping[str, str]) -> HoldInfo:
        """The little known of a hold freed because it matched ``conditions`` (a force
        release on behalf of a dead process, which reads nothing first)."""
        pid = conditions.get("pid")
        return cls(key=name, task_name=None, task_id=conditions.get("task_id"),
                   worker=conditions.get("worker"),
                   pid=int(pid) if pid and pid.isdigit() else None, owner="", count=0,
                   fence=None, ttl=None, held_for=None)

    def as_dict(self) -> dict[str, Any]:
        """Every field by name (``extra`` as a plain dict), ready for JSON."""
        return {
            "key": self.key,
            "task_name": self.task_name,
            "task_id": self.task_id,
            "worker": self.worker,
            "pid": self.pid,
            "owner": self.owner,
            "count": self.count,
            "fence": self.fence,
            "ttl": self.ttl,
            "held_for": self.held_for,
            "host": self.host,
            "extra": dict(self.extra),
            **({} if self.limit is None else {
                "limit": self.limit,
                "slots": self.slots,
                "holders": [h.as_dict() for h in self.holders],
            }),
        }

    def summary(self) -> dict[str, Any]:
        """The :data:`SUMMARY_FIELDS` only (one row of ``celery dlock ls``)."""
        full = self.as_dict()
        out = {name: full[name] for name in SUMMARY_FIELDS}
        if self.limit is not None:
            out["slots"] = self.slots
        if self.extra.get("args"):  # the arguments that made a hashed name
            out["args"] = self.extra["args"]
        return out

    def describe(self) -> str:
        """A short human phrase: which task (or owner) holds it, where."""
        if self.task_name or self.task_id:
            who = f"task {self.task_name or '?'}[{self.task_id or '?'}]"
        else:
            who = f"owner {self.owner}"
        where = self.worker or self.host
        if where:
            who += f" on {where}"
            if self.pid is not None:
                who += f" pid {self.pid}"
        return who


class HoldChanged(DLockError):
    """A force release was told which hold to free (its fence), and the lock is
    now held by another hold; nothing was freed.  ``current`` is the hold found."""

    def __init__(self, message: str, *, lock_name: str | None = None,
                 current: HoldInfo | None = None) -> None:
        self.current = current
        super().__init__(message, lock_name=lock_name)
