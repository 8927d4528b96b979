"""``LockedTask``: a Celery task whose every execution attempt holds a Redis lock.

Consumer side (the worker)::

    from celery_dlock import LockedTask

    @app.task(base=LockedTask, bind=True, lock_key="stock:{product_id}", lock_ttl=30,
              on_contention="retry")
    def reduce_stock(self, product_id, qty=1):
        row = db.get(product_id)
        db.write(product_id, row.stock - qty, fence=self.lock.fence)

Producer side: nothing changes (``reduce_stock.delay(42)``, ``send_task``, beat, chains).
The lock is taken on the worker when an attempt starts, so every route a message can
take is covered, and released when the attempt ends, however it ends.

What "the same owner" means, on a timeline with one message M (task id T)::

    t0  worker A, attempt 1 of T   owner = A:pid:uuid-1 takes stock:42
    t1  A's body calls reduce_stock(42) directly -> same attempt: re-enters (count 2)
    t2  the broker redelivers M (visibility timeout) to worker B
    t3  worker B, attempt 2 of T   owner = B:pid:uuid-2: contention, NOT re-entry,
                                   although the task id is the same -> policy decides
    t4  A's attempt ends           count 0: released; B's retry finds it free
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, ClassVar

from billiard.exceptions import Terminated, WorkerLostError
from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.worker.request import Request

from . import signals
from .config import (
    SETTINGS,
    apply_annotations,
    call_overrides,
    check_task_options,
    get_client,
    read_setting,
)
from .contention import (
    ACQUIRED,
    CONTENTION_HEADER,
    Contention,
    get_policy,
    policy_name,
)
from .errors import (
    BackendUnavailable,
    DLockError,
    InvalidLockConfig,
    LockLost,
    LockNotAcquired,
    UnkeyableArgument,
)
from .hooks import free_lock_after_exit, install, unwatch_child, watch_child
from .keys import KeyFunction, task_key_function
from .lock import RedisLock
from .owner import owner_context
from .startup import install as install_startup_check

__all__ = ["LockLostInterrupt", "LockedRequest", "LockedTask"]

logger = logging.getLogger("celery_dlock.task")


class LockLostInterrupt(LockLost):
    """Raised inside a running task whose lock was lost.

    Only with ``lock_lost_action="interrupt"``.
    """

    def __init__(self, message: str = "the task's lock was lost while it ran",
                 *, lock_name: str | None = None) -> None:
        super().__init__(message, lock_name=lock_name)


def _interrupt_thread(thread_id: int) -> bool:
    """Raise :class:`LockLostInterrupt` in another thread at its next instruction."""
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(LockLostInterrupt))
    return bool(done == 1)


class _Attempt:
    """The lock of one running attempt, as the task body sees it (``self.lock``)."""

    __slots__ = ("fence", "key", "lock", "running", "started", "task_id", "thread_id")

    def __init__(self, lock: RedisLock, thread_id: int, task_id: str | None) -> None:
        self.task_id = task_id
        self.lock = lock
        self.key = lock.name
        self.fence = lock.fence
        self.started = time.monotonic()
        self.thread_id = thread_id
        self.running = True


#: The runs in progress in this context, by task name.
_NO_ATTEMPTS: Mapping[str, _Attempt] = MappingProxyType({})
_attempts: ContextVar[Mapping[str, _Attempt]] = ContextVar("celery_dlock_attempts",
                                                          default=_NO_ATTEMPTS)


class LockedTask(Task):  # type: ignore[misc]
    """A task that holds a reentrant Redis lock while its body runs.

    Every option below may also be set app-wide as ``app.conf.dlock_*`` (see
    :data:`celery_dlock.config.SETTINGS`).  Precedence, as for Celery's own options:
    per call (message headers) > ``task_annotations`` > task class (most derived
    first) > ``app.conf.dlock_*`` > default; see :mod:`celery_dlock.config`.
    """

    abstract = True

    #: The lock's name: a template over the call's arguments ("stock:{product_id}"),
    #: a callable(*args, **kwargs) -> str, or None (task name + arguments, hashed).
    lock_key: ClassVar[str | Callable[..., str] | None] = None
    #: With lock_key=None: key on these arguments only.
    lock_args: ClassVar[tuple[str, ...] | None] = None
    #: Seconds a hold lives after its last renewal (app: dlock_ttl, default 30).
    lock_ttl: ClassVar[float | None] = None
    #: Key prefix (app: dlock_key_prefix, default "dlock").
    lock_prefix: ClassVar[str | None] = None
    #: "retry" | "wait" | "skip" | "raise" | callable (app: dlock_on_contention).
    on_contention: ClassVar[Any] = None
    #: The wait policy blocks this long (app: dlock_wait, default 10).
    lock_wait: ClassVar[float | None] = None
    #: Contention retry backoff base, cap and bound (app: dlock_retry_*).
    lock_retry_backoff: ClassVar[float | None] = None
    lock_retry_backoff_max: ClassVar[float | None] = None
    lock_retry_max: ClassVar[int | None] = None
    #: Run unlocked, with a warning, when Redis is unreachable (app: dlock_fail_open).
    lock_fail_open: ClassVar[bool | None] = None
    #: "warn" or "interrupt" (app: dlock_lock_lost_action).
    lock_lost_action: ClassVar[str | None] = None

    #: The worker-side request: frees a dead child's locks from the main process.
    Request = "celery_dlock.task:LockedRequest"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._dlock_check_options()

    @classmethod
    def _dlock_check_options(cls) -> None:
        """Refuse bad or unknown options (and a key that cannot fit ``run``) when the
        class is declared, and again when it is bound: annotations land then."""
        name = cls.__dict__.get("name") or cls.name or \
            f"{cls.__module__}.{cls.__qualname__}"
        check_task_options(cls, f"task {name!r}", LockedTask)
        task_key_function(cls, name)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        install()
        install_startup_check()
        apply_annotations(cls, app)
        cls._dlock_check_options()

    # -- the lock of a call ---------------------------------------------------------

    def lock_name(self, args: tuple[Any, ...] = (),
                  kwargs: Mapping[str, Any] | None = None) -> str:
        """The lock name (without prefix) a call with these arguments takes."""
        key_fn: KeyFunction | None = self.__dict__.get("_dlock_key_fn")
        if key_fn is None:
            # From this task's class as bound (annotations applied), most derived first.
            key_fn = task_key_function(type(self), self.name)
            if key_fn is None:
                raise InvalidLockConfig(f"task {self.name!r} has no run() to key")
            self.__dict__["_dlock_key_fn"] = key_fn
        return key_fn(tuple(args), kwargs or {})

    def dlock_settings(self, request: Any = None) -> Mapping[str, Any]:
        """This task's resolved settings, read once per task instance and process;
        with ``request``, that call's per-call options (its headers) on top.

        ``app.conf.dlock_*`` changes made after a task first ran are not seen by it.
        """
        cached: Mapping[str, Any] | None = self.__dict__.get("_dlock_settings")
        if cached is None:
            cached = MappingProxyType({option: read_setting(self, option)
                                       for option in SETTINGS})
            self._dlock_settings = cached
        if request is not None:
            overrides = call_overrides(getattr(request, "headers", None))
            if overrides:
                return MappingProxyType({**cached, **overrides})
        return cached

    def apply_async(self, *args: Any, **options: Any) -> Any:
        """``Task.apply_async``; per-call lock options (``headers={"lock_ttl": 5}``)
        are checked here, so a bad one is refused where the call is made."""
        call_overrides(options.get("headers"))
        return super().apply_async(*args, **options)

    @property
    def lock(self) -> RedisLock | None:
        """The lock held by the current run of this task (None outside one, or when it
        runs unlocked under fail-open)."""
        attempt = _attempts.get().get(self.name)
        return attempt.lock if attempt is not None else None

    def _new_lock(self, key: str, settings: Mapping[str, Any],
                  request: Any) -> RedisLock:
        info = {
            "task_id": request.id,
            "task_name": self.name,
            "worker": request.hostname,
        }
        return RedisLock(
            get_client(self.app), key, settings["lock_ttl"],
            prefix=settings["lock_prefix"], info=info,
        )

    # -- running ----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        worker_attempt = (not request.called_directly and not request.is_eager
                          and self.name not in _attempts.get())
        if worker_attempt:
            # A fresh owner for every attempt: a redelivery (same task id) contends.
            with owner_context():
                return self._run_locked(request, args, kwargs, requeue=True)
        return self._run_locked(request, args, kwargs, requeue=False)

    def _run_locked(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    requeue: bool) -> Any:
        settings = self.dlock_settings(request)
        key = self.lock_name(args, kwargs)
        lock = self._new_lock(key, settings, request)
        started = time.monotonic()
        try:
            acquired = lock.acquire(blocking=False)
            error: DLockError | None = None
            if not acquired:
                error = LockNotAcquired(lock_name=key, holder=lock.last_holder)
        except BackendUnavailable as exc:
            if settings["lock_fail_open"]:
                logger.warning("Task %s[%s] runs WITHOUT its lock %r: %s (fail-open)",
                               self.name, request.id, key, exc)
                return super().__call__(*args, **kwargs)
            acquired, error = False, exc
        if not acquired:
            assert error is not None
            outcome = self._contended(lock, error, args, kwargs, settings, requeue)
            if outcome is not ACQUIRED:
                return outcome
        return self._run_body(request, lock, args, kwargs, started)

    def _contended(self, lock: RedisLock, error: DLockError, args: tuple[Any, ...],
                   kwargs: dict[str, Any], settings: Mapping[str, Any],
                   requeue: bool) -> Any:
        policy = settings["on_contention"]
        request = self.request
        retries = 0
        if requeue:
            raw = getattr(request, CONTENTION_HEADER, None)
            if raw is None:
                raw = (request.headers or {}).get(CONTENTION_HEADER, 0)
            retries = int(raw or 0)
        contention = Contention(task=self, lock=lock, error=error, args=args,
                                kwargs=kwargs, retries=retries, can_requeue=requeue,
                                settings=settings)
        signals.lock_contended.send(sender=self, key=lock.name,
                                    policy=policy_name(policy),
                                    holder=contention.holder, task_id=request.id,
                                    error=error)
        return get_policy(policy)(contention)

    def _run_body(self, request: Any, lock: RedisLock, args: tuple[Any, ...],
                  kwargs: dict[str, Any], started: float) -> Any:
        attempt = _Attempt(lock, threading.get_ident(), request.id)
        lock.on_lost = functools.partial(self._on_lock_lost, attempt, request.id)
        reset = _attempts.set({**_attempts.get(), self.name: attempt})
        signals.lock_acquired.send(sender=self, key=lock.name, fence=lock.fence,
                                   task_id=request.id, wait=time.monotonic() - started)
        state = "FAILURE"
        try:
            result = super().__call__(*args, **kwargs)
            state = "SUCCESS"
            return result
        except Retry:
            state = "RETRY"
            raise
        except Ignore:
            state = "IGNORED"
            raise
        except Reject:
            state = "REJECTED"
            raise
        finally:
            attempt.running = False
            _attempts.reset(reset)
            self._release_attempt(attempt, state)

    def _release_attempt(self, attempt: _Attempt, state: str) -> None:
        lock = attempt.lock
        if lock.depth == 0:
            return  # already released (retry() releases before re-queueing)
        try:
            lock.release()
        except DLockError as exc:
            logger.warning("Task %s[%s]: releasing lock %r: %s", self.name,
                           attempt.task_id, attempt.key, exc)
        signals.lock_released.send(sender=self, key=attempt.key, fence=attempt.fence,
                                   task_id=attempt.task_id,
                                   held_for=time.monotonic() - attempt.started,
                                   state=state)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """``Task.retry``, releasing this attempt's lock before the retry is queued.

        So a retry with a short countdown never finds its own previous attempt still
        holding the lock.
        """
        attempt = _attempts.get().get(self.name)
        if attempt is not None and kwargs.get("throw", True) and \
                not self.request.called_directly:
            self._release_attempt(attempt, "RETRY")
        return super().retry(*args, **kwargs)

    # -- lock lost ----------------------------------------------------------------------

    def _on_lock_lost(self, attempt: _Attempt, task_id: str | None,
                      lock: RedisLock) -> None:
        reason = lock._lost_reason or "lost"
        logger.warning("Task %s[%s]: lock %r lost while running: %s", self.name,
                       task_id, lock.name, reason)
        signals.lock_lost.send(sender=self, key=lock.name, fence=attempt.fence,
                               task_id=task_id, reason=reason)
        if attempt.running and \
                self.dlock_settings()["lock_lost_action"] == "interrupt":
            _interrupt_thread(attempt.thread_id)


class LockedRequest(Request):  # type: ignore[misc]
    """Worker-side request of a :class:`LockedTask`, living in the main process.

    When the child process running this request dies (SIGKILL, OOM,
    ``revoke(terminate=True)``) or is killed for a hard time limit, it frees the
    child's lock at once instead of letting it expire after ``lock_ttl``: only the
    hold of that task id in that pid is freed, after the pid is gone.  It watches the
    child from the moment it accepts the request, since the pool may report a SIGKILL
    only seconds later.
    """

    def on_accepted(self, pid: int, time_accepted: float) -> Any:
        result = super().on_accepted(pid, time_accepted)
        if pid:
            try:
                watch_child(self, int(pid))
            except Exception as exc:  # never break the worker's main loop
                logger.warning("cannot watch the process of task %s[%s]: %s",
                               self.task.name, self.id, exc)
        return result

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        unwatch_child(self)
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)
        if isinstance(exc, (WorkerLostError, Terminated)):
            self._free_dead_child_lock()
        return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                  return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if not soft:
            self._free_dead_child_lock()
        return super().on_timeout(soft, timeout)

    def _free_dead_child_lock(self) -> None:
        pid = self.worker_pid
        if not pid:
            return
        try:
            free_lock_after_exit(self.task, self.id, int(pid), self.hostname,
                                 tuple(self.args), dict(self.kwargs))
        except (DLockError, InvalidLockConfig, UnkeyableArgument) as exc:
            logger.warning("could not free the lock of dead task %s[%s]: %s",
                           self.task.name, self.id, exc)
