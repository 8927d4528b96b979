"""The error family of celery-dlock.

Every error carries the name of the lock it is about (``lock_name``) so that a log
line or a task failure says *which* lock, not just *that* a lock misbehaved.
Contention errors also carry what is known of the current holder.

Errors travel through Celery's result backend.  The pickle serializer pickles them
(:meth:`DLockError.__reduce__`); json, yaml and msgpack store ``exc.args`` and rebuild
the error on the client with ``cls(*args)``.  So ``args`` is plain data that carries
everything: ``(message, {"__dlock_error__": 1, "lock_name": ..., "holder": {...}})``,
and ``cls(message, state)`` with such a state rebuilds the error as it was, for every
class of the family (see :class:`_ErrorType`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "BackendUnavailable",
    "DLockError",
    "FencingUnavailable",
    "Holder",
    "InvalidLockConfig",
    "LockKeyConflict",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "NotSupported",
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

    def to_data(self) -> dict[str, Any]:
        """Every field as plain data (``info`` nested); :meth:`from_data` reverses it."""
        return {f.name: (dict(self.info) if f.name == "info" else getattr(self, f.name))
                for f in fields(self)}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Holder:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["info"] = {str(k): str(v) for k, v in (values.get("info") or {}).items()}
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The holder as plain data: its fields, then its metadata (``pid`` a
        number)."""
        return {
            "owner": self.owner,
            "count": self.count,
            "fence": self.fence,
            "age": self.age,
            "ttl": self.ttl,
            **self.info,
            **({"pid": self.pid} if self.pid is not None else {}),
        }


#: Marks the second item of ``DLockError.args``: the error's state, as plain data.
_WIRE = "__dlock_error__"


def _to_wire(value: Any) -> Any:
    """``value`` as JSON-able data (None when it has no plain form)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Holder):
        return {"__holder__": value.to_data()}
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _to_wire(v) for k, v in value.items()}
    return None


def _from_wire(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__holder__"} and isinstance(value["__holder__"], dict):
            return Holder.from_data(value["__holder__"])
        return {k: _from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_wire(v) for v in value]
    return value


class _ErrorType(type):
    """Rebuilds an error from its ``args`` when a result backend calls ``cls(*args)``.

    Every class of the family, whatever its own ``__init__`` signature, accepts
    ``cls(message, state)`` where ``state`` is the mapping that ``args`` carries.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 2 and not kwargs and isinstance(args[1], dict) and \
                args[1].get(_WIRE) == 1:
            message, state = args
            restored = {k: _from_wire(v) for k, v in state.items() if k != _WIRE}
            return _rebuild(cls, str(message), restored)  # type: ignore[arg-type]
        return super().__call__(*args, **kwargs)


class DLockError(Exception, metaclass=_ErrorType):
    """Base of every celery-dlock error; ``lock_name`` says which lock."""

    def __init__(self, message: str = "", *, lock_name: str | None = None) -> None:
        self.lock_name = lock_name
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        if self.lock_name is not None and self.lock_name not in self.message:
            return f"{self.message} (lock {self.lock_name!r})"
        return self.message

    @property
    def args(self) -> tuple[Any, ...]:
        """``(message, state)``: plain data from which ``cls(*args)`` rebuilds the
        error (every attribute, holder included), for Celery's json, yaml and msgpack
        result serializers."""
        state = {k: _to_wire(v) for k, v in self.__dict__.items() if k != "message"}
        return (self.message, {_WIRE: 1, **state})

    @args.setter
    def args(self, value: tuple[Any, ...]) -> None:
        BaseException.args.__set__(self, value)  # type: ignore[attr-defined]

    def __reduce__(self) -> tuple[Any, ...]:
        # The pickle serializer: keep the keyword-only context as it is.
        return (_rebuild, (type(self), self.message, self.__dict__.copy()))


def _rebuild(cls: type[DLockError], message: str, state: dict[str, Any]) -> DLockError:
    err = Exception.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    err.__dict__.setdefault("message", message)
    err.__dict__.setdefault("lock_name", None)
    return err


class InvalidLockConfig(DLockError, ValueError):
    """A lock or task was declared with settings that cannot work (ttl <= 0, ...)."""


class NotSupported(InvalidLockConfig):
    """The configured backend cannot do this (yet): for example listing the locks of a
    Redlock, whose holds live on several servers."""


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


class FencingUnavailable(DLockError):
    """This kind of lock cannot give a fencing token that is safe to rely on (Redlock:
    a node that restarts empty starts its counter again, so tokens could go backwards);
    use a monotonic token source of your own (a database sequence)."""
