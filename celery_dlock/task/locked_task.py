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
    t3  worker B, attempt of T     owner = B:pid:uuid-2: contention, NOT re-entry;
                                   the holder is T itself: a duplicate, ignored
                                   (no body, no state, no result)
    t4  A's attempt ends           count 0: released; T's result is A's
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore, Retry

from ..core.errors import (
    BackendUnavailable,
    DLockError,
    InvalidLockConfig,
    LockNotAcquired,
)
from ..core.lock_options import LockOptions
from ..core.owner import owner_context
from ..core.protocol import Lock
from . import enqueue, signals
from .attempt import (
    DUPLICATE,
    DUPLICATE_GRACE,
    DUPLICATE_HEADER,
    LockLostInterrupt,
    attempts,
    first_run_ended,
    header,
    hold_info,
    relation,
    requeue_duplicate,
)
from .backend import backend_for, check_limit_supported
from .body import run_body
from .config import (
    SETTINGS,
    apply_annotations,
    call_overrides,
    check_task_options,
    read_setting,
    take_call_options,
)
from .contention import (
    ACQUIRED,
    CONTENTION_HEADER,
    Contention,
    get_policy,
    policy_name,
)
from .follow import follow, follows
from .handover import end_started, free_marker, hand_over
from .hooks import install
from .keys import KeyFunction, arguments_text, task_key_function
from .rate import SLOT_HEADER, within_rate
from .request import LockedRequest
from .settings import (
    check_combination,
    check_fence_ttl_setting,
    check_limit_mode,
    conf_value,
    enabled,
)
from .startup import install as install_startup_check

__all__ = ["LockLostInterrupt", "LockedRequest", "LockedTask"]

logger = logging.getLogger("celery_dlock.task")

#: How long an attempt waits in one go for its own predecessor's release before it
#: looks again at who holds the lock.
PREDECESSOR_WAIT_SLICE = 1.0


class LockedTask(Task):  # type: ignore[misc]
    """A task that holds a reentrant Redis lock while its body runs.

    Every option below may also be set app-wide as ``app.conf.dlock_*`` (see
    :data:`celery_dlock.task.config.SETTINGS`).  Precedence, as for Celery's own options:
    per call (message headers) > ``task_annotations`` > task class (most derived
    first) > ``app.conf.dlock_*`` > default; see :mod:`celery_dlock.task.config`.
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
    #: "fail" (default), "interrupt" or "warn" (app: dlock_lock_lost_action).
    lock_lost_action: ClassVar[str | None] = None
    #: Seconds the holder may be frozen at its deadline and still be told first
    #: (app: dlock_pause_budget; default a tenth of lock_ttl, at most 2 s).
    lock_pause_budget: ClassVar[float | None] = None
    #: Seconds after which a hold is no longer renewed and is lost ("max hold");
    #: lock_lost_action applies (app: dlock_lock_max_hold; default None: unbounded).
    lock_max_hold: ClassVar[float | None] = None
    #: Per lock name, cluster-wide: "5/s", "100/m", "2/h"; a call over it is parked
    #: (re-queued for its slot; app: dlock_rate) ...
    lock_rate: ClassVar[str | None] = None
    #: ... with this many at once after a quiet spell (app: dlock_rate_burst, 1).
    lock_rate_burst: ClassVar[int | None] = None
    #: Uniqueness at enqueue: "while_running" (default), "until_started",
    #: "until_finished", "queued_and_running" or "throttle" (app: dlock_mode).
    lock_mode: ClassVar[str | None] = None
    #: What a duplicate enqueue gets: "return_existing" (default), "raise", "drop" or
    #: "replace" (app: dlock_on_duplicate).
    on_duplicate: ClassVar[str | None] = None
    #: Seconds a queue marker outlives its enqueue, plus any countdown or eta
    #: (app: dlock_queue_ttl, default 3600).
    lock_queue_ttl: ClassVar[float | None] = None
    #: How many calls of one key may run at once: 1 (default) a lock, N > 1 a
    #: semaphore of N leased slots (app: dlock_lock_limit).
    lock_limit: ClassVar[int | None] = None
    #: Seconds the name's fence counter is kept after its last grant or release, at
    #: least lock_ttl (app: dlock_fence_ttl; default a day, or lock_ttl when longer;
    #: docs/fencing.md).
    lock_fence_ttl: ClassVar[float | None] = None

    #: Names a subclass reads as options of its own (a peer library's spelling, such
    #: as ``lock_expiry``), which the unknown-option check lets through.
    _dlock_own_options: ClassVar[frozenset[str]] = frozenset()

    #: The worker-side request: frees a dead child's locks from the main process.
    Request = "celery_dlock.task.request:LockedRequest"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._dlock_check_options()

    @classmethod
    def _dlock_check_options(cls) -> None:
        """Refuse bad or unknown options (and a key that cannot fit ``run``) when the
        class is declared, and again when it is bound: annotations land then."""
        name = cls.__dict__.get("name") or cls.name or \
            f"{cls.__module__}.{cls.__qualname__}"
        check_task_options(cls, f"task {name!r}", LockedTask, cls._dlock_own_options)
        task_key_function(cls, name)
        check_combination(f"task {name!r}", getattr(cls, "lock_mode", None),
                          getattr(cls, "on_duplicate", None))
        check_limit_mode(f"task {name!r}", getattr(cls, "lock_mode", None),
                         getattr(cls, "lock_limit", None))
        check_fence_ttl_setting(f"task {name!r}", getattr(cls, "lock_ttl", None),
                                getattr(cls, "lock_fence_ttl", None))

    @classmethod
    def on_bound(cls, app: Any) -> None:
        install()
        install_startup_check()
        enqueue.install(app)
        apply_annotations(cls, app)
        cls._dlock_check_options()
        if getattr(app, "configured", False):  # never read a pending configuration
            limit = getattr(cls, "lock_limit", None) or \
                conf_value(app, "dlock_lock_limit")
            check_limit_supported(app, limit, f"task {cls.name!r} option lock_limit")
            check_limit_mode(f"task {cls.name!r}", getattr(cls, "lock_mode", None) or
                             conf_value(app, "dlock_mode"), limit)
            check_fence_ttl_setting(
                f"task {cls.name!r}",
                getattr(cls, "lock_ttl", None) or conf_value(app, "dlock_ttl", 30.0),
                getattr(cls, "lock_fence_ttl", None) or
                conf_value(app, "dlock_fence_ttl"))

    # -- the lock of a call ---------------------------------------------------------

    def lock_name(self, args: tuple[Any, ...] = (),
                  kwargs: Mapping[str, Any] | None = None) -> str:
        """The lock name (without prefix) a call with these arguments takes."""
        return self._key_function()(tuple(args), kwargs or {})

    def _key_function(self) -> KeyFunction:
        key_fn: KeyFunction | None = self.__dict__.get("_dlock_key_fn")
        if key_fn is None:
            # From this task's class as bound (annotations applied), most derived first.
            key_fn = task_key_function(type(self), self.name)
            if key_fn is None:
                raise InvalidLockConfig(f"task {self.name!r} has no run() to key")
            self.__dict__["_dlock_key_fn"] = key_fn
        return key_fn

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
        """``Task.apply_async``; per-call lock options, as keywords
        (``lock_mode="until_finished"``, ``lock_ttl=5``) or in the headers
        (``headers={"lock_ttl": 5}``), are checked here, so a bad one is refused where
        the call is made, and travel in the message's headers."""
        take_call_options(options)
        return super().apply_async(*args, **options)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """``Task.retry``, whose publish a lost lock never interrupts
        (``lock_lost_action="interrupt"``): Celery would reject the message of a
        retry interrupted there, and the call would never run again.  The attempt
        ends with the retry; a loss found meanwhile is reported as usual."""
        attempt = attempts.get().get(self.name)
        if attempt is None:
            return super().retry(*args, **kwargs)
        with attempt.uninterrupted():
            return super().retry(*args, **kwargs)

    @property
    def lock(self) -> Lock | None:
        """The lock held by the current run of this task (None outside one, or when it
        runs unlocked under fail-open)."""
        attempt = attempts.get().get(self.name)
        return attempt.lock if attempt is not None else None

    def lock_arguments(self, args: tuple[Any, ...] = (),
                       kwargs: Mapping[str, Any] | None = None) -> str | None:
        """The arguments that made a call's hashed lock name, as a person reads them
        (``user_id=29``); None when the name is readable itself (a template)."""
        return arguments_text(self._key_function(), tuple(args), kwargs or {})

    def _new_lock(self, key: str, settings: Mapping[str, Any],
                  request: Any, args: tuple[Any, ...],
                  kwargs: Mapping[str, Any]) -> Lock:
        info = hold_info(self.name, request)
        readable = self.lock_arguments(args, kwargs)
        if readable is not None:
            info["args"] = readable
        return backend_for(self.app).lock(LockOptions(
            key, settings["lock_ttl"], prefix=settings["lock_prefix"], info=info,
            pause_budget=settings["lock_pause_budget"],
            max_hold=settings["lock_max_hold"], limit=settings["lock_limit"],
            fence_ttl=settings["lock_fence_ttl"]))

    # -- running ----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not enabled(self.app):  # dlock_enabled = False: no lock, no marker
            return super().__call__(*args, **kwargs)
        request = self.request
        running = attempts.get()
        if request.called_directly or self.name in running or \
                (request.is_eager and running):
            # A direct call, or an eager one inside a running attempt: the caller's
            # owner (that attempt's, else the calling thread's) re-enters.
            return self._run_locked(request, args, kwargs, requeue=False)
        # A fresh owner for every attempt: a redelivery (same task id) contends, and
        # an eager run contends with its caller's own locks.
        def attempt() -> Any:
            with owner_context():
                return self._run_locked(request, args, kwargs,
                                        requeue=not request.is_eager)

        following = None if request.is_eager else follows(request)
        if following is not None:  # a duplicate in a canvas (task/follow.py)
            return follow(self, request, args, kwargs, following, attempt)
        return attempt()

    def _settle(self, request: Any, requeue: bool, decide: Callable[[], Any]) -> Any:
        """What ``decide()`` (the contention policy, the rate) says the call does
        instead of running now; its queue marker is freed unless the call goes on
        (``ACQUIRED``) or was re-queued with its task id (``Retry``: parked, or a
        contention retry), which keeps it."""
        try:
            outcome = decide()
        except Retry:
            raise
        except BaseException:
            free_marker(self, request, requeue)
            raise
        if outcome is not ACQUIRED:
            free_marker(self, request, requeue)
        return outcome

    def _run_locked(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    requeue: bool) -> Any:
        settings = self.dlock_settings(request)
        key = self.lock_name(args, kwargs)
        duplicate = requeue and header(request, DUPLICATE_HEADER) > 0
        if duplicate and first_run_ended(self, request.id):
            raise Ignore(f"duplicate delivery of {request.id}: it has ended")
        started = time.monotonic()
        error: DLockError | None = None
        lock: Lock | None = None
        try:
            lock = self._new_lock(key, settings, request, args, kwargs)
            acquired = lock.acquire(blocking=False)
            if not acquired and requeue:
                acquired = self._same_task_holder(lock, request, args, kwargs,
                                                  settings)
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
            outcome = self._settle(request, requeue, functools.partial(
                self._contended, key, lock, error, args, kwargs, settings, requeue))
            if outcome is not ACQUIRED:
                return outcome
        assert lock is not None  # acquired: the lock was made
        if duplicate and first_run_ended(self, request.id, DUPLICATE_GRACE):
            lock.release()  # the first run released, and its result came just after
            raise Ignore(f"duplicate delivery of {request.id}: it has ended")
        if requeue and settings["lock_rate"] is not None:
            outcome = self._settle(request, requeue, functools.partial(
                within_rate, self, request, lock, args, kwargs, key, settings,
                functools.partial(self._contended, key, lock)))
            if outcome is not ACQUIRED:
                return outcome
        if not requeue:
            return self._run_body(request, lock, args, kwargs, started, settings)
        hand_over(self, request, lock, float(settings["lock_queue_ttl"]))
        try:
            result = self._run_body(request, lock, args, kwargs, started, settings)
        except BaseException as exc:
            end_started(self, request, exc)
            raise
        end_started(self, request)
        return result


    def _same_task_holder(self, lock: Lock, request: Any, args: tuple[Any, ...],
                          kwargs: dict[str, Any], settings: Mapping[str, Any]) -> bool:
        """When the holder is an attempt of this very task id: wait for an earlier
        generation (a retry's or replacement's predecessor) to unwind, whatever the
        policy; re-queue a duplicate delivery silently.  False: the holder is another
        task.
        """
        while True:
            kind = relation(lock.last_holder, request)
            if kind is None:
                return False
            if kind == DUPLICATE:
                signals.send(signals.lock_contended, self, lock.name, policy="duplicate",
                             holder=lock.last_holder, task_id=request.id,
                             error=LockNotAcquired(lock_name=lock.name,
                                                   holder=lock.last_holder))
                requeue_duplicate(self, lock, request, args, kwargs, settings)
            # An earlier generation of this task id, still unwinding: wait for it.
            logger.debug("Task %s[%s] waits for its predecessor to release %r",
                         self.name, request.id, lock.name)
            if lock.acquire(blocking=True, timeout=PREDECESSOR_WAIT_SLICE):
                return True

    def _contended(self, key: str, lock: Lock | None, error: DLockError,
                   args: tuple[Any, ...], kwargs: dict[str, Any],
                   settings: Mapping[str, Any], requeue: bool) -> Any:
        policy = settings["on_contention"]
        request = self.request
        retries = header(request, CONTENTION_HEADER) if requeue else 0
        contention = Contention(task=self, lock=lock, error=error, args=args,
                                kwargs=kwargs, retries=retries, can_requeue=requeue,
                                settings=settings, name=key)
        signals.send(signals.lock_contended, self, key,
                     policy=policy_name(policy),
                     holder=contention.holder, task_id=request.id,
                     error=error)
        return get_policy(policy)(contention)

    def _run_body(self, request: Any, lock: Lock, args: tuple[Any, ...],
                  kwargs: dict[str, Any], started: float,
                  settings: Mapping[str, Any]) -> Any:
        # The worker's (or apply()'s) tracer pushed this call's request and task
        # already: Task.__call__ would push a copy of them.
        call = super().__call__ if request.called_directly else self.run
        return run_body(self, request, lock, call, args, kwargs, started, settings)

    def signature_from_request(self, request: Any = None, args: Any = None,
                               kwargs: Any = None, queue: Any = None,
                               **extra_options: Any) -> Any:
        """Celery's, except that a retry the body asks for (``self.retry()``,
        ``autoretry_for``) starts afresh: the body has run, so the contention-retry
        count (one episode's budget) and a duplicate's mark are not carried over."""
        sig = super().signature_from_request(request, args, kwargs, queue=queue,
                                             **extra_options)
        headers = sig.options.get("headers")
        if "headers" not in extra_options and headers:
            sig.options["headers"] = {k: v for k, v in headers.items()
                                      if k not in (CONTENTION_HEADER, DUPLICATE_HEADER,
                                                   SLOT_HEADER)}
        return sig
