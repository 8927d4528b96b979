"""``clear_locks(app)``: remove the locks and queue markers whose holders are gone.

celery-singleton's ``clear_locks`` deletes every lock, a running task's too; this one
removes only what nobody will ever release:

* a **lock hold** of a task whose holder is known to be gone: its worker answers and
  runs no process with the hold's pid (a child that died: its worker frees such a
  hold itself, within milliseconds, unless it died too), or its task id has a result
  (SUCCESS or FAILURE: the run ended, its release failed; not REVOKED, which a call
  revoked while it runs may show as it goes on); or whose **renewal has stopped**:
  the server shows it unrenewed for longer than its holder may believe it holds it
  (its ttl less the drift and pause margin, the holder's own deadline:
  :mod:`celery_dlock.core.deadline`), so a live holder has been told it lost it.
  A worker that does not answer is no evidence by itself: a solo pool running a
  task, a gevent loop blocked by a body, a worker cut off from the broker all keep
  running their holds, and their locks are kept.  The hold is freed with conditions
  (that task id, worker and pid), so a newer hold of the name is never touched.
  Holds that are not a task's (a ``RedisLock`` of your code) are left alone;
* a **queue marker** whose call has a ready result (it ran, or was revoked, and its
  marker outlived it).  A queued call's marker (PENDING) stays, and so does a
  ``throttle`` window (it counts accepted calls, whether they ran or not): a marker
  whose name a task with ``lock_mode="throttle"`` may have made is kept.

Both expire by themselves (a hold within its ``lock_ttl``, a marker within its
``lock_queue_ttl``); this is for a hold with a long ttl, or to check a deployment.
"""

from __future__ import annotations

import contextlib
import logging
import re
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import states

from ..core.deadline import margin_of
from ..core.errors import DLockError, NotSupported
from ..core.holds import HoldInfo
from ..task.backend import backend_for, markers_for
from ..task.settings import SETTINGS, conf_value

__all__ = ["Removed", "clear_locks"]

logger = logging.getLogger("celery_dlock.compat")


@dataclass(frozen=True)
class Removed:
    """One lock hold (``kind="lock"``) or queue marker (``kind="marker"``) that
    :func:`clear_locks` removed, and why."""

    kind: str
    prefix: str
    name: str
    task_id: str | None
    reason: str


def _prefixes(app: Any) -> set[str]:
    """The app's key prefix and every locked task's own."""
    found = {str(conf_value(app, "dlock_key_prefix", SETTINGS["lock_prefix"].default))}
    for task in list(app.tasks.values()):
        settings_of = getattr(task, "dlock_settings", None)
        if settings_of is not None:
            try:
                found.add(str(settings_of()["lock_prefix"]))
            except DLockError:
                continue
    return found


def _live_processes(app: Any, workers: set[str],
                    timeout: float) -> dict[str, set[int]] | None:
    """For each of ``workers`` that answers: its pids (main process and pool); None
    when the question could not be sent.  Not answering proves nothing."""
    answers: dict[str, set[int]] = {}
    ask = sorted(workers)
    for _ in range(2):  # a worker that missed the first question is asked by name
        if not ask:
            break
        try:
            replies = app.control.inspect(destination=ask, timeout=timeout).stats()
        except Exception as exc:
            logger.warning("clear_locks: could not ask the workers (%s): no lock is "
                           "removed for a worker that does not answer", exc)
            return None
        for node, stats in (replies or {}).items():
            pids = {stats.get("pid")}
            pool = stats.get("pool") or {}
            pids.update(pool.get("processes") or ())
            answers[node] = {int(p) for p in pids if isinstance(p, int)}
        ask = [w for w in ask if w not in answers]
    return answers


def _ready(app: Any, task_id: str | None,
           ended: frozenset[str] = states.READY_STATES) -> str | None:
    """The task id's state when it is one of ``ended``, else None."""
    if not task_id:
        return None
    try:
        state = app.AsyncResult(task_id).state
    except Exception:
        return None
    return str(state) if state in ended else None


#: The states that say a *run* has ended (its release came before its result was
#: stored).  Not REVOKED: a call revoked without ``terminate`` while it runs goes
#: on running, and may show REVOKED meanwhile.
RAN = frozenset({states.SUCCESS, states.FAILURE})


def _renewal_stopped(app: Any, hold: HoldInfo) -> str | None:
    """Why the hold's renewal has stopped for good, or None: unrenewed past its
    holder's own deadline (its lease less the margin the holder keeps back, with the
    task's ``lock_pause_budget`` when the task is known here)."""
    since, lease = hold.unrenewed_for, hold.lease
    if since is None or lease is None:
        return None  # the backend does not say when it was renewed: never judged
    budget = None
    task = app.tasks.get(hold.task_name) if hold.task_name else None
    settings_of = getattr(task, "dlock_settings", None)
    if settings_of is not None:
        with contextlib.suppress(DLockError):
            budget = settings_of()["lock_pause_budget"]
    deadline = lease - margin_of(round(lease * 1000), budget)
    if since < deadline:
        return None
    return (f"its renewal stopped: not renewed for {since:.1f}s, past its holder's "
            f"deadline ({deadline:.1f}s of its {lease:g}s ttl)")


def _gone(app: Any, hold: HoldInfo,
          alive: Mapping[str, set[int]] | None) -> str | None:
    """Why the hold's holder is gone, or None when it may still run."""
    if not hold.task_id:
        return None
    state = _ready(app, hold.task_id, RAN)
    if state is not None:
        return f"its task {hold.task_id} has ended ({state})"
    stopped = _renewal_stopped(app, hold)
    if stopped is not None:
        return stopped
    if hold.worker is None or alive is None:
        return None
    pids = alive.get(hold.worker)
    if pids is None:
        return None  # silent: busy (a solo pool, a blocked loop), cut off, or dead
    if hold.pid is not None and pids and hold.pid not in pids:
        return f"its worker {hold.worker} has no process {hold.pid}"
    return None


def _name_pattern(task: Any) -> re.Pattern[str] | None:
    """What the lock names of ``task`` look like (None: any name)."""
    key = getattr(type(task), "lock_key", None)
    if key is None:
        return re.compile(re.escape(f"{task.name}:") + ".*", re.S)
    if not isinstance(key, str):
        return None  # a callable: it may make any name
    parts = []
    for literal, field, _spec, _conv in string.Formatter().parse(key):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(".*")
    return re.compile("".join(parts), re.S)


def _throttled(app: Any) -> list[re.Pattern[str] | None]:
    found = []
    for task in list(app.tasks.values()):
        settings_of = getattr(task, "dlock_settings", None)
        if settings_of is None:
            continue
        try:
            if settings_of()["lock_mode"] == "throttle":
                found.append(_name_pattern(task))
        except DLockError:
            continue
    return found


def _may_be_throttle(name: str, patterns: Iterable[re.Pattern[str] | None]) -> bool:
    return any(p is None or p.fullmatch(name) for p in patterns)


def clear_locks(app: Any, *, prefixes: Iterable[str] | None = None,
                timeout: float = 1.0) -> list[Removed]:
    """Remove the lock holds and queue markers of ``app`` whose holders are gone (see
    the module); returns what was removed, each also logged.

    ``prefixes``: the key prefixes to look under (default: ``dlock_key_prefix`` and
    every locked task's ``lock_prefix``); ``timeout``: seconds each question to the
    workers waits for answers (asked twice).
    """
    removed: list[Removed] = []
    backend = backend_for(app)
    chosen = set(prefixes) if prefixes is not None else _prefixes(app)
    for prefix in sorted(chosen):
        holds = [h for h in backend.holds(prefix) if h.task_id]
        # Only a worker that answers can say a process is gone: ask about the holds
        # not already shown to have stopped renewing.
        workers = {h.worker for h in holds
                   if h.worker and _renewal_stopped(app, h) is None}
        alive = _live_processes(app, workers, timeout) if workers else {}
        for hold in holds:
            reason = _gone(app, hold, alive)
            if reason is None:
                continue
            conditions = {"task_id": str(hold.task_id)}
            if hold.worker:
                conditions["worker"] = hold.worker
            if hold.pid is not None:
                conditions["pid"] = str(hold.pid)
            if backend.force_release(prefix, hold.key, conditions=conditions) is None:
                continue  # released meanwhile, or held anew
            removed.append(Removed("lock", prefix, hold.key, hold.task_id, reason))
    try:
        markers = markers_for(app)
    except NotSupported as exc:  # a backend without queue markers
        logger.info("clear_locks: no queue markers to look at: %s", exc)
        markers = None
    throttled = _throttled(app)
    for prefix in sorted(chosen):
        if markers is None:
            break
        for name, task_id, _left in list(markers.queued(prefix)):
            state = _ready(app, task_id)
            if state is None or _may_be_throttle(name, throttled):
                continue
            if markers.clear(prefix, name, task_id):
                removed.append(Removed("marker", prefix, name, task_id,
                                       f"its call {task_id} has ended ({state})"))
    for item in removed:
        logger.warning("clear_locks: removed the %s %r (prefix %r): %s", item.kind,
                       item.name, item.prefix, item.reason)
    if not removed:
        logger.info("clear_locks: nothing to remove under %s",
                    ", ".join(map(repr, sorted(chosen))))
    return removed
