"""What a duplicate enqueue gets: :class:`AlreadyQueued` (``on_duplicate="raise"``)
and :class:`DroppedResult` (``on_duplicate="drop"``)."""

from __future__ import annotations

from typing import Any

from celery.result import AsyncResult

from ..core.errors import DLockError

__all__ = ["DROPPED", "AlreadyQueued", "DroppedResult"]

#: The state of a call dropped as a duplicate: it was never sent and never runs.
DROPPED = "DROPPED"


class AlreadyQueued(DLockError):
    """A call of this lock name is already queued (or running, in ``until_finished``
    mode, or ran within the ``throttle`` window): this one was not sent.

    ``task_id`` is the existing call's task id (None when the holder is not a task);
    ``countdown`` the seconds until its marker (or hold) expires at the latest, as
    celery-once's ``AlreadyQueued`` has it; ``arguments`` the arguments that made a
    hashed lock name (``user_id=29``; None for a readable name), also in the message.
    """

    def __init__(self, message: str = "", *, lock_name: str | None = None,
                 task_id: str | None = None, countdown: float | None = None,
                 arguments: str | None = None) -> None:
        self.task_id = task_id
        self.countdown = countdown
        self.arguments = arguments
        if not message:
            message = "a call of this lock name is already queued"
            if task_id:
                message += f" (task {task_id})"
        if arguments and arguments not in message:
            message += f" (arguments: {arguments})"
        super().__init__(message, lock_name=lock_name)


class DroppedResult(AsyncResult):  # type: ignore[misc]
    """The result of a call dropped as a duplicate: it is ready at once, in state
    :data:`DROPPED`, with no result; ``duplicate_of`` is the queued call's task id.

    Nothing is stored in the result backend: the id is the dropped call's own (never
    sent), so nothing else will ever report on it.
    """

    def __init__(self, task_id: str, duplicate_of: str | None, app: Any = None,
                 lock_name: str | None = None) -> None:
        super().__init__(task_id, app=app)
        self.duplicate_of = duplicate_of
        self.lock_name = lock_name

    dropped = True

    @property
    def state(self) -> str:
        return DROPPED

    status = state

    @property
    def result(self) -> Any:
        return None

    info = result

    def ready(self) -> bool:
        return True

    def successful(self) -> bool:
        return False

    def failed(self) -> bool:
        return False

    def get(self, *args: Any, **kwargs: Any) -> Any:
        """None, at once: a dropped call has no result and nothing to wait for."""
        return None

    wait = get

    def forget(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"<DroppedResult: {self.id} duplicate of {self.duplicate_of}>"
