"""Connections to Celery's signals, made once (``dispatch_uid``) when a LockedTask is
bound to an app.

* ``worker_process_init`` (every prefork child, after fork): drop any Redis client and
  scheduler inherited from the parent (the fork handlers already do; this also logs),
  so each child renews only its own holds from its own thread.
* ``worker_process_shutdown`` and ``worker_shutdown`` (warm shutdown of a child, and of
  the main process for the threads, solo and gevent pools): release every hold the
  process still has, so nothing waits for a ttl to run out.
* The main process frees the lock of a child that died while running a locked task
  (SIGKILL, OOM, ``revoke(terminate=True)``, hard time limit): see
  :class:`celery_dlock.task.request.LockedRequest`, which calls
  :func:`free_lock_after_exit` when Celery reports the death, and :func:`watch_child`
  when a child accepts a locked request.  Celery's prefork pool may notice a SIGKILLed
  child only at its next pool maintenance (every 5 s), so the watch checks those
  children itself, every
  :data:`CHILD_WATCH_INTERVAL`.  Only the hold of that task id in that pid is freed,
  and only once the pid is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import signals as celery_signals
from celery.worker import state as worker_state

from ..core import process
from ..core.errors import DLockError
from ..core.process import after_fork
from ..core.scheduler import get_scheduler
from . import events
from .backend import backend_for
from .config import read_setting
from .handover import free_marker_of, wait_for_redelivery

__all__ = [
    "CHILD_WATCH_INTERVAL",
    "free_lock_after_exit",
    "install",
    "release_process_holds",
    "unwatch_child",
    "watch_child",
]

logger = logging.getLogger("celery_dlock.hooks")

_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Connect the receivers (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        celery_signals.worker_process_init.connect(
            _on_process_init, weak=False, dispatch_uid="celery_dlock.process_init")
        celery_signals.worker_process_shutdown.connect(
            _on_shutdown, weak=False, dispatch_uid="celery_dlock.process_shutdown")
        celery_signals.worker_shutdown.connect(
            _on_shutdown, weak=False, dispatch_uid="celery_dlock.worker_shutdown")
        for signal, receiver in ((celery_signals.task_revoked, _on_revoked),
                                 (celery_signals.task_rejected, _on_message_dropped),
                                 (celery_signals.task_unknown, _on_message_dropped)):
            signal.connect(receiver, weak=False,
                           dispatch_uid=f"celery_dlock.markers.{signal.name}")
        events.install()  # contention history, when an app sets dlock_record_events
        _installed = True


def _on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A revoked (or expired) message is discarded: its queue marker goes."""
    app = getattr(sender, "app", None)
    if app is not None and request is not None:
        free_marker_of(app, request, f"revoked task {getattr(request, 'id', '?')}")


def _on_message_dropped(sender: Any = None, message: Any = None, **_: Any) -> None:
    """A message the worker rejects (unknown task, bad message): its marker goes."""
    app = getattr(sender, "app", None)
    headers = getattr(message, "headers", None)
    if app is not None and isinstance(headers, dict):
        free_marker_of(app, headers, f"rejected message {headers.get('id', '?')}")


def _on_process_init(**_: Any) -> None:
    hb = get_scheduler()
    logger.debug("celery-dlock ready in worker process %s (%d holds)", os.getpid(),
                 len(hb))


def _on_shutdown(**_: Any) -> None:
    """A warm shutdown (of a worker, or of a pool child): what this process
    registered to close when it stops (:func:`celery_dlock.core.process.shutdown`),
    its holds released first."""
    process.shutdown()


@process.at_shutdown
def release_process_holds() -> int:
    """Release every hold this process's scheduler renews; returns how many."""
    count = 0
    for lock in get_scheduler().held_locks():
        count += lock.release_all()
    if count:
        logger.warning("released %d lock hold(s) still held at shutdown of pid %s",
                       count, os.getpid())
    return count


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[0]
        return state in (b"Z", b"X")  # a zombie runs no code
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _dead_child_release(task: Any, task_id: str, pid: int, hostname: str | None,
                        args: tuple[Any, ...], kwargs: dict[str, Any],
                        request: Any = None) -> Callable[[], None]:
    """A function freeing ``task``'s lock for this call if that task id in that pid
    still holds it (to be called once ``pid`` is gone).  ``request``: the worker's
    request of a child that died (not one terminated): a marked call's task id is
    kept waiting for its redelivery first."""
    key = task.lock_name(args, kwargs)
    prefix = read_setting(task, "lock_prefix")
    # The conditions name the hold: that task id in that dead pid, which no newer hold
    # can match, so a re-sent call changes nothing.  No reason is left: the holder is
    # dead, nobody would read it.
    conditions = {"task_id": task_id, "pid": str(pid)}
    if hostname:
        conditions["worker"] = hostname

    def release() -> None:
        if request is not None:
            wait_for_redelivery(task, request)
        try:
            freed = backend_for(task.app).force_release(prefix, key,
                                                        conditions=conditions)
        except DLockError as exc:  # Redis down, a cluster no node answers: the ttl
            logger.warning("could not free lock %r of dead task %s[%s]: %s", key,
                           task.name, task_id, exc)
            return
        if freed is not None:
            logger.warning("freed lock %r of task %s[%s]: its process %s died", key,
                           task.name, task_id, pid)

    return release


def free_lock_after_exit(task: Any, task_id: str, pid: int, hostname: str | None,
                         args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Free ``task``'s lock for this call once process ``pid`` has exited.

    Runs in the background (the worker's main loop must not block); gives up after the
    lock's ttl, by which time the hold has expired anyway.
    """
    release = _dead_child_release(task, task_id, pid, hostname, args, kwargs)
    ttl = float(read_setting(task, "lock_ttl"))

    def run() -> None:
        deadline = time.monotonic() + ttl
        while not _pid_gone(pid):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        release()

    threading.Thread(target=run, name="celery-dlock-free", daemon=True).start()


# -- watching the children that run locked tasks (worker main process) ----------------

#: How often (seconds) the main process checks the children running locked tasks.
CHILD_WATCH_INTERVAL = 0.05


def _still_running(request: Any) -> bool:
    """Whether the pool has not yet reported ``request`` done (or its child lost).

    Not the same as being in ``active_requests``: ``revoke(terminate=True)`` takes a
    request out of those before its child is even dead.
    """
    ref = getattr(request, "_apply_result", None)  # the pool's job (prefork)
    job = ref() if callable(ref) else None
    if job is not None and callable(getattr(job, "ready", None)):
        return not job.ready()
    return request in worker_state.active_requests


class _ChildWatch:
    """One thread checking every :data:`CHILD_WATCH_INTERVAL` whether a child process
    that runs a locked request has died; the thread ends when no child is left.

    It keeps one entry per child (a prefork child runs one task at a time): the last
    locked request accepted by it.  A check costs one ``kill(pid, 0)`` per child,
    whatever the number of tasks: a finished request is simply replaced by the
    child's next one, and a dead child's request is released only if it was still
    running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, Any] = {}
        self._thread: threading.Thread | None = None

    def watch(self, request: Any, pid: int) -> None:
        with self._lock:
            self._entries[pid] = request
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="celery-dlock-childwatch")
                self._thread.start()

    def unwatch(self, request: Any) -> None:
        with self._lock:
            for pid, found in list(self._entries.items()):
                if found is request:
                    del self._entries[pid]

    def _run(self) -> None:
        while True:
            time.sleep(CHILD_WATCH_INTERVAL)
            with self._lock:
                if not self._entries:
                    self._thread = None
                    return
                entries = list(self._entries.items())
            for pid, request in entries:
                if not _pid_gone(pid):
                    continue
                with self._lock:  # the child is gone: forget it
                    mine = self._entries.get(pid) is request
                    if mine:
                        del self._entries[pid]
                if mine and _still_running(request):  # else it had ended
                    _release_dead(request, pid)


def _release_dead(request: Any, pid: int) -> None:
    """Free the lock of ``request``, whose child ``pid`` died while running it."""
    try:
        _dead_child_release(request.task, request.id, pid, request.hostname,
                            tuple(request.args), dict(request.kwargs), request)()
    except Exception as exc:
        logger.warning("could not free the lock of dead process %s: %s", pid, exc)


_child_watch = _ChildWatch()


def _new_child_watch() -> None:
    global _child_watch
    _child_watch = _ChildWatch()


after_fork(_new_child_watch)


def watch_child(request: Any, pid: int) -> None:
    """From the worker's main process: free the lock of ``request`` (a Celery worker
    ``Request`` of a locked task) as soon as child ``pid`` dies while the request still
    runs in it (as :func:`free_lock_after_exit` does once Celery reports the death).
    Costs a dict entry per task: the lock name is only derived if the child dies.
    """
    if pid == os.getpid():  # solo and threads pools: no child to outlive
        return
    _child_watch.watch(request, pid)


def unwatch_child(request: Any) -> None:
    """Stop watching ``request``'s child (the request finished)."""
    _child_watch.unwatch(request)
