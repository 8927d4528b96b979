"""Contention policies: what a locked task does when its lock is held elsewhere.

A policy is a name or any callable taking a :class:`Contention` and either

* returning :data:`ACQUIRED` after taking the lock (``contention.wait(...)`` did), so
  the body runs;
* returning any other value, which becomes the task's result without running the body;
* or raising (``contention.retry()`` raises ``celery.exceptions.Retry``).

The four built-ins are tiny compositions of the :class:`Contention` helpers::

    retry  ->  contention.retry()
    wait   ->  ACQUIRED if contention.wait() else contention.retry()
    skip   ->  contention.skip()
    raise  ->  raise contention.error

so a custom policy reads the same way, for example "wait 2 s, then skip"::

    def wait_then_skip(contention):
        return ACQUIRED if contention.wait(2.0) else contention.skip()

When Redis is unreachable the same policy decides (``contention.error`` is then a
:class:`BackendUnavailable` and :meth:`Contention.wait` does not block).
"""

from __future__ import annotations

import abc
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery import signature
from celery.exceptions import Ignore, Retry

from ..core.errors import BackendUnavailable, DLockError, Holder, LockNotAcquired
from ..core.protocol import Lock
from .handover import free_marker
from .settings import defaults

__all__ = [
    "ACQUIRED",
    "CONTENTION_HEADER",
    "Contention",
    "ContentionPolicy",
    "Raise",
    "RetryLater",
    "Skip",
    "Wait",
    "backoff_delay",
    "get_policy",
    "is_skipped",
    "skipped_result",
]

logger = logging.getLogger("celery_dlock.contention")

#: Message header counting the contention retries of one task (separate from the
#: task's own ``retries``, so they do not consume ``max_retries``).
CONTENTION_HEADER = "dlock_contention_retries"


class _Acquired:
    def __repr__(self) -> str:
        return "ACQUIRED"


#: Returned by a policy that took the lock: run the body.
ACQUIRED: Any = _Acquired()


def backoff_delay(retries: int, base: float, cap: float,
                  rand: Callable[[], float] = random.random) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2**n)]."""
    ceiling = min(cap, base * (2.0 ** min(retries, 62)))
    return float(rand()) * ceiling


def skipped_result(key: str, holder: Holder | None, reason: str) -> dict[str, Any]:
    """The result of a skipped task: plain data, so any result serializer keeps it."""
    return {
        "dlock_skipped": True,
        "lock": key,
        "reason": reason,
        "holder": holder.as_dict() if holder is not None else None,
    }


def is_skipped(result: Any) -> bool:
    """Whether a task result says the task was skipped on contention."""
    return isinstance(result, Mapping) and result.get("dlock_skipped") is True


@dataclass
class Contention:
    """Everything a policy needs to decide, and the means to act.

    ``retries`` counts the contention retries this task has had so far;
    ``can_requeue`` is False for direct calls and eager runs (``apply()``,
    ``task_always_eager``), which cannot be re-queued.
    """

    task: Any
    lock: Lock | None  # None: Redis could not be reached to make one
    error: DLockError
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    retries: int = 0
    can_requeue: bool = True
    #: The task's resolved settings (every option; the defaults when not given).
    settings: Mapping[str, Any] = field(default_factory=defaults)
    name: str = ""

    @property
    def key(self) -> str:
        return self.lock.name if self.lock is not None else self.name

    @property
    def holder(self) -> Holder | None:
        return getattr(self.error, "holder", None)

    @property
    def backend_down(self) -> bool:
        return isinstance(self.error, BackendUnavailable)

    def wait(self, seconds: float | None = None) -> bool:
        """Block up to ``seconds`` (default ``lock_wait``) for the lock; True if taken.

        Woken by the holder's release, not by polling.  Never blocks when Redis is
        unreachable.
        """
        if self.backend_down or self.lock is None:
            return False
        if seconds is None:
            seconds = float(self.settings["lock_wait"])
        try:
            acquired = self.lock.acquire(blocking=True, timeout=seconds)
        except BackendUnavailable as exc:
            self.error = exc
            return False
        if not acquired and self.lock.last_holder is not None:
            self.error = LockNotAcquired(lock_name=self.key, holder=self.lock.last_holder)
        return acquired

    def retry(self, countdown: float | None = None) -> Any:
        """Re-queue the task for later (never returns).

        The delay is exponential with full jitter; after ``lock_retry_max`` contention
        retries the task fails with :class:`LockNotAcquired` instead.  A direct call or
        an eager run cannot be re-queued: it raises the contention error.
        """
        if not self.can_requeue:
            raise self.error
        limit = int(self.settings["lock_retry_max"])
        if self.retries >= limit:
            raise LockNotAcquired(
                f"gave up after {self.retries} contention retries: "
                f"{self.error}", lock_name=self.key, holder=self.holder)
        if countdown is None:
            countdown = backoff_delay(self.retries,
                                      float(self.settings["lock_retry_backoff"]),
                                      float(self.settings["lock_retry_backoff_max"]))
        task = self.task
        request = task.request
        headers = dict(request.headers or {})
        headers[CONTENTION_HEADER] = self.retries + 1
        sig = task.signature_from_request(request, self.args, self.kwargs,
                                          countdown=countdown, retries=request.retries,
                                          headers=headers)
        sig.apply_async()
        # Celery logs the retry ("retry: Retry in 1.23s: LockNotAcquired(...)"): one
        # line per contention retry is enough at INFO.
        logger.debug("Task %s[%s] re-queued in %.2fs: %s", task.name, request.id,
                     countdown, self.error)
        raise Retry(exc=self.error, when=countdown, sig=sig)

    def skip(self) -> Any:
        """End the task without running the body; the result says who held the lock.

        A worker run stores that result (so ``AsyncResult.get()`` returns it) and stops
        there: link callbacks and the rest of a chain do not run, and every later link
        of the chain gets the same result, so the chain's ``get()`` returns it at once.
        A direct or eager call returns it.
        """
        task = self.task
        request = task.request
        reason = ("lock store unavailable" if self.backend_down
                  else "lock held elsewhere")
        result = skipped_result(self.key, self.holder, reason)
        if self.backend_down:
            logger.info("Task %s[%s] skipped: the store of lock %r is unavailable: %s",
                        task.name, request.id, self.key, self.error)
        else:
            who = self.holder.describe() if self.holder is not None else "unknown holder"
            logger.info("Task %s[%s] skipped: lock %r is held by %s", task.name,
                        request.id, self.key, who)
        if not self.can_requeue:
            return result
        # Its name is free before its result shows: a caller that sees the result
        # and sends again is not a duplicate of this ended call.
        free_marker(task, request)
        if not request.ignore_result and not task.ignore_result:
            task.backend.mark_as_done(request.id, result, request=request)
        _end_chain(task, request, result)
        raise Ignore(f"skipped: lock {self.key!r} {reason}")


def _end_chain(task: Any, request: Any, result: Any) -> None:
    """Give the links of ``request``'s chain that will not run the skip result."""
    for link in request.chain or ():
        try:
            link_id = signature(link, app=task.app).id
        except Exception:  # something that is not a signature: nothing to resolve
            continue
        if link_id:
            task.backend.mark_as_done(link_id, result)


class ContentionPolicy(abc.ABC):
    """Base of the built-in policies; any callable taking a Contention will do."""

    name = "custom"

    @abc.abstractmethod
    def __call__(self, contention: Contention) -> Any: ...

    def __repr__(self) -> str:
        return self.name


class RetryLater(ContentionPolicy):
    name = "retry"

    def __call__(self, contention: Contention) -> Any:
        return contention.retry()


class Wait(ContentionPolicy):
    name = "wait"

    def __call__(self, contention: Contention) -> Any:
        return ACQUIRED if contention.wait() else contention.retry()


class Skip(ContentionPolicy):
    name = "skip"

    def __call__(self, contention: Contention) -> Any:
        return contention.skip()


class Raise(ContentionPolicy):
    name = "raise"

    def __call__(self, contention: Contention) -> Any:
        raise contention.error


_BUILTIN: dict[str, ContentionPolicy] = {
    p.name: p for p in (RetryLater(), Wait(), Skip(), Raise())
}


def get_policy(policy: str | Callable[[Contention], Any]) -> Callable[[Contention], Any]:
    if isinstance(policy, str):
        return _BUILTIN[policy]
    return policy


def policy_name(policy: str | Callable[[Contention], Any]) -> str:
    if isinstance(policy, str):
        return policy
    return str(getattr(policy, "name", None) or getattr(policy, "__name__", None)
               or repr(policy))
