"""Connections to Celery's signals, made once (``dispatch_uid``) when a LockedTask is
bound to an app.

* ``worker_process_init`` (every prefork child, after fork): drop any Redis client and
  heartbeat inherited from the parent (the fork handlers already do; this also logs),
  so each child renews only its own holds from its own thread.
* ``worker_process_shutdown`` and ``worker_shutdown`` (warm shutdown of a child, and of
  the main process for the threads, solo and gevent pools): release every hold the
  process still has, so nothing waits for a ttl to run out.
* The main process frees the lock of a child that died while running a locked task
  (SIGKILL, OOM, ``revoke(terminate=True)``, hard time limit): see
  :class:`celery_dlock.task.LockedRequest`, which calls :func:`free_lock_after_exit`.
  Only the hold of that task id in that pid is freed, and only once the pid is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from celery import signals as celery_signals

from . import events
from .config import get_client, read_setting
from .heartbeat import get_heartbeat
from .lock import LockKeys
from .scripts import FORCE_RELEASE
from .waiters import DOORBELL_TTL_MS

__all__ = ["free_lock_after_exit", "install", "release_process_holds"]

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
        events.install()  # contention history, when an app sets dlock_record_events
        _installed = True


def _on_process_init(**_: Any) -> None:
    hb = get_heartbeat()
    logger.debug("celery-dlock ready in worker process %s (%d holds)", os.getpid(),
                 len(hb))


def _on_shutdown(**_: Any) -> None:
    released = release_process_holds()
    if released:
        logger.warning("released %d lock hold(s) still held at shutdown of pid %s",
                       released, os.getpid())


def release_process_holds() -> int:
    """Release every hold this process's heartbeat renews; returns how many."""
    count = 0
    for lock in get_heartbeat().held_locks():
        count += lock.release_all()
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


def free_lock_after_exit(task: Any, task_id: str, pid: int, hostname: str | None,
                         args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Free ``task``'s lock for this call once process ``pid`` has exited.

    Runs in the background (the worker's main loop must not block); gives up after the
    lock's ttl, by which time the hold has expired anyway.
    """
    key = task.lock_name(args, kwargs)
    keys = LockKeys.for_name(read_setting(task, "lock_prefix"), key)
    client = get_client(task.app)
    ttl = float(read_setting(task, "lock_ttl"))
    conditions = ["task_id", task_id, "pid", str(pid)]
    if hostname:
        conditions += ["worker", hostname]

    def run() -> None:
        deadline = time.monotonic() + ttl
        while not _pid_gone(pid):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        try:
            reply = FORCE_RELEASE(client, (keys.lock, keys.queue, keys.leases),
                                  (keys.doorbell_prefix, DOORBELL_TTL_MS, *conditions))
        except Exception as exc:
            logger.warning("could not free lock %r of dead task %s[%s]: %s", key,
                           task.name, task_id, exc)
            return
        if int(reply[0]) == 1:
            logger.warning("freed lock %r of task %s[%s]: its process %s died", key,
                           task.name, task_id, pid)

    threading.Thread(target=run, name="celery-dlock-free", daemon=True).start()
