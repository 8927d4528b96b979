"""What the ``dlock_hold`` fixture gives: hold a lock name from the test, as another
worker would, so that a task of that name meets contention.

The hold is taken on the app's own backend (:func:`celery_dlock.task.backend.
backend_for`, so the same Redis and the same key layout as its tasks) under the
task's key prefix, by an owner of its own: it contends with every call the test
makes, eager runs, direct calls and workers alike, and is renewed while held.  It
takes what the task's own run would take: one slot of a task with ``lock_limit=N``
(hold it ``N`` times to fill them all), else the lock.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from ..core.errors import DLockError, LockLost, LockNotAcquired
from ..core.lock_args import DEFAULT_PREFIX
from ..core.lock_options import LockOptions
from ..core.protocol import Lock
from ..task.backend import backend_for
from ..task.settings import SETTINGS, conf_value

__all__ = ["HeldLock", "Holds"]

logger = logging.getLogger("celery_dlock.testing")

#: The ttl of a test's hold: renewed while held, so only a crashed test run leaves
#: one behind, for this long.
HOLD_TTL = 30.0


def _is_task(target: Any) -> bool:
    return callable(getattr(target, "dlock_settings", None))


class HeldLock:
    """A lock name held by the test.  Use it as a context manager, or call
    :meth:`release`; whatever is still held is released when the test ends."""

    def __init__(self, lock: Lock, prefix: str) -> None:
        self.lock = lock
        self.prefix = prefix

    @property
    def name(self) -> str:
        return self.lock.name

    @property
    def held(self) -> bool:
        """Whether the test still holds it (released, or found lost: False)."""
        return self.lock.depth > 0 and not self.lock.lost

    @property
    def fence(self) -> int | None:
        """The hold's fencing token (None once released)."""
        return self.lock.fence if self.lock.fences and self.held else None

    def release(self) -> None:
        """Release the hold; nothing happens when it is no longer held.  Raises
        :class:`~celery_dlock.BackendUnavailable` when Redis did not confirm."""
        while self.lock.depth > 0:
            try:
                self.lock.release()
            except LockLost:  # expired or released by force: nothing left to free
                return

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"<HeldLock {self.prefix}:{self.name} {state}>"


class Holds:
    """The factory behind ``dlock_hold``: ``holds(app_or_task, name)`` takes the lock
    and returns a :class:`HeldLock`; :meth:`release_all` frees every one still held.

    :param test: what the holds' metadata name as their holder (the test's id), so
        that a skip result or a ``LockNotAcquired`` says who held the lock.
    """

    def __init__(self, test: str = "") -> None:
        self.test = test
        self._holds: list[HeldLock] = []

    def __call__(self, target: Any, name: str | None = None, *,
                 args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None,
                 prefix: str | None = None, ttl: float = HOLD_TTL,
                 timeout: float = 0.0, limit: int | None = None) -> HeldLock:
        """Hold the lock ``name`` of ``target``'s app (a Celery app, or a locked task).

        For a task the name may be left out: the name its call with ``args`` and
        ``kwargs`` takes (``hold(reduce_stock, args=(42,))``).  The key prefix is
        ``prefix`` when given, else the task's (``lock_prefix``), else the app's
        ``dlock_key_prefix`` (default ``"dlock"``).  ``timeout``: seconds to wait when
        someone else holds it (default: do not wait), then
        :class:`~celery_dlock.LockNotAcquired` saying who does.  ``limit``: the
        slots of the name (default: the task's ``lock_limit``, else the app's
        ``dlock_lock_limit``, else 1); the hold takes one of them.
        """
        task = target if _is_task(target) else None
        app = task.app if task is not None else target
        if name is None:
            if task is None:
                raise TypeError("dlock_hold: give the lock name, or a locked task and "
                                "its call's args/kwargs")
            name = str(task.lock_name(tuple(args), dict(kwargs or {})))
        if prefix is None:
            prefix = self._prefix_of(task, app)
        info = {"held_by": "dlock_hold", "test": self.test}
        owner = f"dlock_hold:{uuid.uuid4().hex}"
        if limit is None:
            limit = self._limit_of(task, app)
        lock = backend_for(app).lock(LockOptions(name, ttl, prefix=prefix, info=info,
                                                 owner=owner, limit=limit))
        if timeout > 0:
            acquired = lock.acquire(blocking=True, timeout=timeout)
        else:
            acquired = lock.acquire(blocking=False)
        if not acquired:
            holder = lock.last_holder
            who = holder.describe() if holder is not None else "another owner"
            raise LockNotAcquired(f"dlock_hold: {name!r} (prefix {prefix!r}) is held by "
                                  f"{who}", lock_name=name, holder=holder)
        held = HeldLock(lock, prefix)
        self._holds.append(held)
        return held

    @staticmethod
    def _prefix_of(task: Any, app: Any) -> str:
        if task is not None:
            return str(task.dlock_settings()["lock_prefix"])
        value = conf_value(app, "dlock_key_prefix", DEFAULT_PREFIX)
        return str(SETTINGS["lock_prefix"].check("app.conf.dlock_key_prefix", value))

    @staticmethod
    def _limit_of(task: Any, app: Any) -> int:
        if task is not None:
            return int(task.dlock_settings()["lock_limit"])
        setting = SETTINGS["lock_limit"]
        value = conf_value(app, setting.conf, setting.default)
        return int(setting.check(f"app.conf.{setting.conf}", value))

    @property
    def held(self) -> list[HeldLock]:
        """The holds taken so far and still held."""
        return [h for h in self._holds if h.held]

    def release_all(self) -> list[str]:
        """Release every hold still held; returns the errors (one line each) of those
        that could not be released (they expire within their ttl)."""
        errors: list[str] = []
        holds, self._holds = self._holds, []
        for held in holds:
            try:
                held.release()
            except DLockError as exc:
                errors.append(f"{held.prefix}:{held.name}: {exc}")
            except Exception as exc:  # never let one hold keep the others
                errors.append(f"{held.prefix}:{held.name}: {exc!r}")
            if held.lock.depth > 0:
                held.lock.release_all()  # whatever is left: logged, never raised
        for error in errors:
            logger.warning("dlock_hold could not release %s", error)
        return errors
