"""``LockedRequest``: the worker-side request of a :class:`~celery_dlock.LockedTask`.

It lives in the worker's main process and frees the lock of a child process that died
while running the task (see :mod:`celery_dlock.task.hooks`).
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.exceptions import Terminated, WorkerLostError
from celery.worker.request import Request

from ..core.errors import DLockError, InvalidLockConfig, UnkeyableArgument
from .handover import TIMED_OUT, wait_for_redelivery
from .hooks import free_lock_after_exit, unwatch_child, watch_child
from .settings import enabled

__all__ = ["LockedRequest"]

logger = logging.getLogger("celery_dlock.task")


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
        if pid and enabled(self.task.app):  # dlock_enabled=False: no lock to free
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
            if isinstance(exc, WorkerLostError) and enabled(self.task.app):
                # before Celery re-queues the message (below), unless the watch of
                # the child did it when it saw the death
                try:
                    wait_for_redelivery(self.task, self)
                except Exception as error:  # never break the worker's main loop
                    logger.warning("task %s[%s]: %s", self.task.name, self.id, error)
            self._free_dead_child_lock()
        return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                  return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if not soft:
            # (told before the pool kills the child: its death is no loss then)
            self.__dict__[TIMED_OUT] = True
            self._free_dead_child_lock()
        return super().on_timeout(soft, timeout)

    def _free_dead_child_lock(self) -> None:
        pid = self.worker_pid
        if not pid or not enabled(self.task.app):
            return
        try:
            free_lock_after_exit(self.task, self.id, int(pid), self.hostname,
                                 tuple(self.args), dict(self.kwargs))
        except (DLockError, InvalidLockConfig, UnkeyableArgument) as exc:
            logger.warning("could not free the lock of dead task %s[%s]: %s",
                           self.task.name, self.id, exc)
