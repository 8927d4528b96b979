"""Prometheus metrics fed by celery-dlock's signals (the ``prometheus`` extra).

::

    pip install 'celery-dlock[prometheus]'

    from celery_dlock import metrics
    metrics.install()            # once per process, e.g. where the app is defined

Every metric is labelled with the task name (never the lock key: keys are unbounded).
With the default namespace ``dlock``:

``dlock_acquire_wait_seconds`` (histogram, ``task``)
    Time from the start of an attempt to holding its lock: the ``wait`` argument of
    ``signals.lock_acquired``.  Near zero unless the ``wait`` policy blocked; a task
    re-queued by the ``retry`` policy starts a new attempt, counted on its own.
``dlock_contention_total`` (counter, ``task``, ``policy``)
    Attempts that found their lock held elsewhere (or Redis unreachable).
``dlock_parked_total`` (counter, ``task``)
    Calls over their ``lock_rate`` that were parked (re-queued for their slot):
    ``signals.lock_parked``.
``dlock_lost_total`` (counter, ``task``)
    Running tasks whose lock expired or was taken.
``dlock_hold_seconds`` (histogram, ``task``)
    How long an attempt held its lock: ``held_for`` of ``signals.lock_released``.
``dlock_held_locks`` (gauge, ``task``)
    Locks held right now by running tasks (up on acquire, down on release).  In
    prometheus_client's multiprocess mode it sums live processes only (``livesum``).
    For a task with ``lock_limit`` > 1 (a semaphore), the slots its runs hold.
``dlock_lock_limit`` (gauge, ``task``)
    The task's ``lock_limit``: how many slots each of its keys has (1: a lock), set
    when a run takes its lock.  ``held_locks / lock_limit`` is the share of slots in
    use when the task has one key; ``celery dlock ls`` shows each key's
    ``used/limit`` and holders.

How to expose them (prefork workers, a scrape config) is in ``docs/metrics.md``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..task import signals

__all__ = ["ACQUIRE_BUCKETS", "HOLD_BUCKETS", "Metrics", "install", "uninstall"]

#: Acquire waits: mostly sub-millisecond to milliseconds; the wait policy, seconds.
ACQUIRE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Hold times: from quick tasks to long jobs.
HOLD_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0, 300.0, 600.0, 1800.0, 3600.0)

_UIDS = {
    "acquired": "celery_dlock.ops.metrics.acquired",
    "contended": "celery_dlock.ops.metrics.contended",
    "duplicate": "celery_dlock.ops.metrics.duplicate",
    "released": "celery_dlock.ops.metrics.released",
    "lost": "celery_dlock.ops.metrics.lost",
    "parked": "celery_dlock.ops.metrics.parked",
}


@dataclass(frozen=True)
class Metrics:
    """The metric objects :func:`install` registered."""

    registry: Any
    namespace: str
    acquire_wait: Any
    contention: Any
    duplicates: Any
    lost: Any
    hold: Any
    held: Any
    parked: Any
    limit: Any = None


_metrics: Metrics | None = None
_lock = threading.Lock()


def _prometheus() -> Any:
    try:
        import prometheus_client  # noqa: PLC0415 (an optional dependency)
    except ImportError as exc:
        raise ImportError(
            "celery_dlock.ops.metrics needs prometheus_client: "
            "pip install 'celery-dlock[prometheus]'") from exc
    return prometheus_client


def _task(sender: Any) -> str:
    return str(getattr(sender, "name", None) or "unknown")


def _on_acquired(sender: Any = None, wait: float | None = None, **_: Any) -> None:
    m = _metrics
    if m is None:
        return
    task = _task(sender)
    if wait is not None:
        m.acquire_wait.labels(task=task).observe(max(0.0, float(wait)))
    m.held.labels(task=task).inc()
    if m.limit is not None:
        m.limit.labels(task=task).set(_limit_of(sender))


def _limit_of(sender: Any) -> int:
    read = getattr(sender, "dlock_settings", None)
    try:
        return int(read()["lock_limit"]) if callable(read) else 1
    except Exception:  # a metric never fails a task
        return 1


def _on_contended(sender: Any = None, policy: str | None = None, **_: Any) -> None:
    m = _metrics
    if m is not None:
        m.contention.labels(task=_task(sender), policy=policy or "unknown").inc()


def _on_duplicate(sender: Any = None, policy: str | None = None, **_: Any) -> None:
    m = _metrics
    if m is not None:
        m.duplicates.labels(task=_task(sender), policy=policy or "unknown").inc()


def _on_parked(sender: Any = None, **_: Any) -> None:
    m = _metrics
    if m is not None:
        m.parked.labels(task=_task(sender)).inc()


def _on_released(sender: Any = None, held_for: float | None = None, **_: Any) -> None:
    m = _metrics
    if m is None:
        return
    task = _task(sender)
    if held_for is not None:
        m.hold.labels(task=task).observe(max(0.0, float(held_for)))
    m.held.labels(task=task).dec()


def _on_lost(sender: Any = None, **_: Any) -> None:
    m = _metrics
    if m is not None:
        m.lost.labels(task=_task(sender)).inc()


def install(registry: Any = None, namespace: str = "dlock") -> Metrics:
    """Create the metrics in ``registry`` (default: prometheus_client's) and connect
    their receivers to :mod:`celery_dlock.signals`, once (``dispatch_uid``).

    Calling it again with the same registry and namespace returns the same
    :class:`Metrics`; with others, raises :class:`ValueError` (call :func:`uninstall`
    first).  Raises :class:`ImportError` when prometheus_client is not installed.
    """
    global _metrics
    prom = _prometheus()
    if registry is None:
        registry = prom.REGISTRY
    with _lock:
        if _metrics is not None:
            if _metrics.registry is registry and _metrics.namespace == namespace:
                return _metrics
            raise ValueError("celery_dlock.ops.metrics is already installed with another "
                             "registry or namespace; call uninstall() first")
        metrics = Metrics(
            registry=registry,
            namespace=namespace,
            acquire_wait=prom.Histogram(
                "acquire_wait_seconds", "Seconds from the start of a locked task's "
                "attempt to holding its lock", ["task"], namespace=namespace,
                registry=registry, buckets=ACQUIRE_BUCKETS),
            contention=prom.Counter(
                "contention", "Attempts of locked tasks that found their lock held "
                "elsewhere (or Redis unreachable), by contention policy",
                ["task", "policy"], namespace=namespace, registry=registry),
            duplicates=prom.Counter(
                "duplicates", "Enqueues found to duplicate a queued (or running, or "
                "throttled) call of the same lock name, by on_duplicate policy",
                ["task", "policy"], namespace=namespace, registry=registry),
            lost=prom.Counter(
                "lost", "Running locked tasks whose lock expired or was taken",
                ["task"], namespace=namespace, registry=registry),
            hold=prom.Histogram(
                "hold_seconds", "Seconds a locked task's attempt held its lock",
                ["task"], namespace=namespace, registry=registry,
                buckets=HOLD_BUCKETS),
            held=prom.Gauge(
                "held_locks", "Locks held now by running locked tasks", ["task"],
                namespace=namespace, registry=registry, multiprocess_mode="livesum"),
            parked=prom.Counter(
                "parked", "Calls over their lock_rate, parked (re-queued for their "
                "slot)", ["task"], namespace=namespace, registry=registry),
            limit=prom.Gauge(
                "lock_limit", "lock_limit of a locked task: slots per key (1: a lock)",
                ["task"], namespace=namespace, registry=registry,
                multiprocess_mode="livemax"),
        )
        signals.lock_acquired.connect(_on_acquired, weak=False,
                                      dispatch_uid=_UIDS["acquired"])
        signals.lock_contended.connect(_on_contended, weak=False,
                                       dispatch_uid=_UIDS["contended"])
        signals.lock_duplicate.connect(_on_duplicate, weak=False,
                                       dispatch_uid=_UIDS["duplicate"])
        signals.lock_released.connect(_on_released, weak=False,
                                      dispatch_uid=_UIDS["released"])
        signals.lock_lost.connect(_on_lost, weak=False, dispatch_uid=_UIDS["lost"])
        signals.lock_parked.connect(_on_parked, weak=False,
                                    dispatch_uid=_UIDS["parked"])
        _metrics = metrics
        return metrics


def uninstall() -> None:
    """Disconnect the receivers and unregister the metrics (tests, reconfiguration)."""
    global _metrics
    with _lock:
        metrics = _metrics
        if metrics is None:
            return
        signals.lock_acquired.disconnect(dispatch_uid=_UIDS["acquired"])
        signals.lock_contended.disconnect(dispatch_uid=_UIDS["contended"])
        signals.lock_duplicate.disconnect(dispatch_uid=_UIDS["duplicate"])
        signals.lock_released.disconnect(dispatch_uid=_UIDS["released"])
        signals.lock_lost.disconnect(dispatch_uid=_UIDS["lost"])
        signals.lock_parked.disconnect(dispatch_uid=_UIDS["parked"])
        _metrics = None
        for collector in (metrics.acquire_wait, metrics.contention,
                          metrics.duplicates, metrics.lost,
                          metrics.hold, metrics.held, metrics.parked,
                          metrics.limit):
            try:
                metrics.registry.unregister(collector)
            except KeyError:
                pass
