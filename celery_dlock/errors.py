"""The error family of celery-dlock.

Every error carries the name of the lock it is about (``lock_name``) so that a log
line or a task failure says *which* lock, not just *that* a lock misbehaved.
Contention errors also carry what is known of the current holder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BackendUnavailable",
    "DLockError",
    "Holder",
    "InvalidLockConfig",
    "LockKeyConflict",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "UnkeyableArgument",
]


@dataclass(frozen=True)
class Holder:
    """What the lock hash says about whoever holds a lock right now.

    ``age`` and ``ttl`` are seconds (``None`` when unknown); ``info`` holds every
    other metadata field that was stored with the hold (for a Celery task: task id,
    task name, worker host name, pid).
    """

    owner: str | None = None
    count: int = 0
    fence: int | None = None
    age: float | None = None
    ttl: float | None = None
    info: dict[str, str] = field(default_factory=dict)

    @property
    def task_id(self) -> str | None:
        return self.info.get("task_id")

    @property
    def task_name(self) -> str | None:
        return self.info.get("task_name")

    @property
    def worker(self) -> str | None:
        return self.info.get("worker")

    @property
    def pid(self) -> int | None:
        pid = self.info.get("pid")
        return int(pid) if pid and pid.isdigit() else None

    def describe(self) -> str:
        """A short human sentence about the holder, for log lines and errors."""
        parts: list[str] = []
        if self.task_name or self.task_id:
            parts.append(f"task {self.task_name or '?'}[{self.task_id or '?'}]")
        elif self.owner:
            parts.append(f"owner {self.owner}")
        if self.worker:
            where = self.worker
            if self.pid is not None:
                where += f" pid {self.pid}"
            parts.append(f"on {where}")
        if self.age is not None:
            parts.append(f"for {self.age:.1f}s")
        if self.ttl is not None:
            parts.append(f"ttl left {self.ttl:.1f}s")
        return ", ".join(parts) if parts else "unknown holder"

    def as_dict(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "count": self.count,
            "fence": self.fence,
            "age": self.age,
            "ttl": self.ttl,
            **self.info,
        }


class DLockError(Exception):
    """Base of every celery-dlock error; ``lock_name`` says which lock."""

    def __init__(self, message: str = "", *, lock_name: str | None = None) -> None:
        self.lock_name = lock_name
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        if self.lock_name is not None and self.lock_name not in self.message:
            return f"{self.message} (lock {self.lock_name!r})"
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors travel through Celery's result backend: keep them picklable with
        # their keyword-only context.
        return (_rebuild, (type(self), self.message, self.__dict__.copy()))


def _rebuild(cls: type[DLockError], message: str, state: dict[str, Any]) -> DLockError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class InvalidLockConfig(DLockError, ValueError):
    """A lock or task was declared with settings that cannot work (ttl <= 0, ...)."""


class UnkeyableArgument(DLockError, ValueError):
    """A call argument cannot be turned into a stable lock key."""


class LockNotAcquired(DLockError):
    """The lock is held by another owner (contention), or a wait timed out.

    ``holder`` describes the current holder when it is known.
    """

    def __init__(
        self,
        message: str = "",
        *,
        lock_name: str | None = None,
        holder: Holder | None = None,
    ) -> None:
        self.holder = holder
        if not message:
            message = "lock is held elsewhere"
            if holder is not None:
                message += f" by {holder.describe()}"
        super().__init__(message, lock_name=lock_name)


class LockNotOwned(DLockError):
    """Release or extend by someone who does not hold the lock.

    Nothing is deleted: the lock of another owner is left alone.
    """


class LockLost(DLockError):
    """The lock expired or passed to another owner while we believed we held it."""


class LockKeyConflict(DLockError):
    """A key of the lock holds data that celery-dlock did not write (another
    application uses the same key): nothing was changed; choose another prefix or name.
    """


class BackendUnavailable(DLockError):
    """Redis could not be reached or did not answer in time."""
