"""``lock_rate``: a per-name rate, cluster-wide, before the lock is taken.

A worker run of a :class:`~celery_dlock.LockedTask` with ``lock_rate="5/s"`` asks the
backend (:class:`~celery_dlock.core.protocol.RateStore`) whether a call of its lock
name may start now (GCRA on the server's clock: :mod:`celery_dlock.core.rates`).  One
that may not is **parked**: its message is published again, with the same task id,
arguments, headers and ``retries``, a countdown to the slot reserved for it, and the
slot in a header (:data:`SLOT_HEADER`); the attempt ends in state RETRY, holding
nothing (no lock was taken).  So a parked call

* never consumes ``max_retries`` (its ``retries`` is unchanged) nor the contention
  retries (``lock_retry_max``);
* is never dropped: when it comes back at its slot it starts without asking again;
  one that comes back more than one interval late asks afresh;
* keeps its queue marker (``lock_mode``), as a contention retry does.

The rate is asked with the lock held, right before the body would start (after a
wait for the lock, after contention retries): it bounds the *starts* of bodies, at
most ``R + B`` in any window of one period.  A call over it releases the lock before
it is parked.

Direct calls and eager runs (``apply()``) are not counted: they cannot be parked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery.exceptions import Retry

from ..core.errors import BackendUnavailable, DLockError, NotSupported
from ..core.protocol import Lock, RateStore
from ..core.rates import Rate, RateDecision
from ..core.registry import RATES, entry_named
from . import signals
from .backend import backend_for
from .connection import configured_entry
from .contention import ACQUIRED
from .settings import conf_of

__all__ = ["SLOT_HEADER", "check_rates_supported", "park_if_over", "rates_for",
           "within_rate"]

logger = logging.getLogger("celery_dlock.rate")

#: Message header with the slot (server microseconds) reserved for a parked call.
SLOT_HEADER = "dlock_rate_slot"


def _unsupported(kind: str) -> NotSupported:
    return NotSupported(entry_named(kind).missing(RATES, "lock_rate"))


def rates_for(app: Any) -> RateStore:
    """The rates of ``app``'s backend; :class:`NotSupported` when it keeps none."""
    backend = backend_for(app)
    rates = getattr(backend, "rates", None)
    if RATES not in backend.capabilities or rates is None:
        raise _unsupported(backend.kind)
    store: RateStore = rates()
    return store


def check_rates_supported(app: Any, where: str) -> None:
    """At worker start, from the configuration alone (no client is made): refuse
    ``lock_rate`` when the backend the app's settings name keeps no rates (its
    capabilities).  (A ``dlock_client`` returning several clients is found out at the
    first call, which fails with the same error.)"""
    entry = configured_entry(conf_of(app))
    if entry is not None and not entry.can(RATES):
        raise NotSupported(f"{where}: {_unsupported(entry.kind)}")


def _slot_of(request: Any) -> int | None:
    raw = (getattr(request, "headers", None) or {}).get(SLOT_HEADER)
    if raw is None:
        raw = getattr(request, SLOT_HEADER, None)
    try:
        return None if raw is None else int(raw)
    except (TypeError, ValueError):
        return None


def park_if_over(task: Any, request: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any], name: str,
                 settings: Mapping[str, Any],
                 release: Callable[[], object] | None = None) -> None:
    """Return when this call may start now under the task's ``lock_rate``; otherwise
    call ``release`` (the call's lock), re-publish the call for its slot and raise
    :class:`celery.exceptions.Retry`.  Raises
    :class:`~celery_dlock.BackendUnavailable` when the server cannot be asked."""
    rate: Rate = settings["lock_rate"]
    if settings["lock_rate_burst"] != rate.burst:
        rate = rate._replace(burst=int(settings["lock_rate_burst"]))
    decision: RateDecision = rates_for(task.app).take(
        settings["lock_prefix"], name, rate, _slot_of(request))
    if decision.run:
        return
    if release is not None:
        try:
            release()  # the call does not start: its lock goes first
        except DLockError as exc:  # lost meanwhile: nothing of it is left to free
            logger.info("Task %s[%s]: releasing %r before parking: %s", task.name,
                        request.id, name, exc)
    headers = {**(request.headers or {}), SLOT_HEADER: decision.slot}
    sig = task.signature_from_request(request, args, kwargs, countdown=decision.delay,
                                      retries=request.retries, headers=headers)
    sig.apply_async()
    signals.send(signals.lock_parked, task, name, task_id=request.id,
                 delay=decision.delay, rate=str(rate))
    logger.info("Task %s[%s] parked for %.3fs: lock_rate %s of %r", task.name,
                request.id, decision.delay, rate, name)
    raise Retry(f"parked for {decision.delay:.3f}s by lock_rate {rate} of {name!r}",
                when=decision.delay, sig=sig)


def within_rate(task: Any, request: Any, lock: Lock, args: tuple[Any, ...],
                kwargs: dict[str, Any], name: str, settings: Mapping[str, Any],
                contended: Callable[..., Any]) -> Any:
    """Ask ``lock_rate`` with ``lock`` held, just before the body would start.

    :data:`ACQUIRED`: start now.  Over the rate: the lock is released and the call
    parked (:class:`Retry`).  The rate cannot be asked: fail-open starts the body
    (locked); otherwise the lock is released and ``contended(error, args, kwargs,
    settings, requeue)`` (the contention policy) answers, as for an unavailable
    lock; a lock the policy then takes again is asked about once more, and a second
    failure is raised.
    """
    for last in (False, True):
        try:
            park_if_over(task, request, args, kwargs, name, settings,
                         release=lock.release)
            return ACQUIRED
        except BackendUnavailable as exc:
            if settings["lock_fail_open"]:
                logger.warning("Task %s[%s] starts without asking its lock_rate of %r: "
                               "%s (fail-open)", task.name, request.id, name, exc)
                return ACQUIRED
            _release_quietly(lock)
            if last:
                raise
            outcome = contended(exc, args, kwargs, settings, True)
            if outcome is not ACQUIRED:
                return outcome
        except BaseException:  # parked, or refused (LockKeyConflict): nothing held
            _release_quietly(lock)
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _release_quietly(lock: Lock) -> None:
    """Release what the call still holds of ``lock`` (a parked call released it
    already); a hold lost meanwhile has nothing left to free."""
    while lock.depth > 0:
        try:
            lock.release()
        except DLockError:
            return
