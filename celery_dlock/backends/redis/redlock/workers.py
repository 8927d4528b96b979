"""The threads that call a Redlock's nodes: a few per server, of its own.

A node that hangs (SIGSTOP, a partition) keeps each call sent to it for up to its
socket timeout.  Were the calls of every node served by one shared pool, enough of
them would fill it, and the calls to the healthy nodes (renewals included) would wait
behind them until too late: one dead node would starve the others.  So each server
has its own workers (at most :data:`NODE_WORKERS` threads, which exit when idle), and
a call that could not start before its deadline is not sent at all (:class:`NotSent`):
it would only reach the node after its caller stopped waiting.  A server with more
than :data:`NODE_BACKLOG` calls waiting or running refuses more at once
(:class:`NodeBusy`); either way the node counts as not answering for that operation.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from ....core.process import after_fork
from .report import address

__all__ = ["IDLE_EXIT", "NODE_BACKLOG", "NODE_WORKERS", "NodeBusy", "NotSent",
           "calls_in_flight", "submit_to", "worker_threads"]

#: The most threads calling one server at once.
NODE_WORKERS = 8
#: The most calls to one server waiting or running; more are refused at once.
NODE_BACKLOG = 512
#: A worker thread with nothing to do for this long exits (seconds).
IDLE_EXIT = 5.0


class NotSent(RedisError):
    """A call not sent: no worker of its node was free before its deadline."""


class NodeBusy(RedisError):
    """A call not sent: its node already has :data:`NODE_BACKLOG` calls waiting or
    running (it does not answer, or not fast enough)."""


_Task = tuple[cf.Future[Any], Callable[..., Any], tuple[Any, ...], float | None]


class NodeWorkers:
    """The worker threads of one server."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Task] = deque()
        self._threads = 0
        self._running = 0

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...],
               deadline: float | None) -> cf.Future[Any]:
        future: cf.Future[Any] = cf.Future()
        with self._cond:
            if len(self._queue) + self._running >= NODE_BACKLOG:
                future.set_exception(NodeBusy(
                    f"{len(self._queue) + self._running} calls to this node are still "
                    f"waiting or running"))
                return future
            self._queue.append((future, fn, args, deadline))
            idle = self._threads - self._running
            if len(self._queue) > idle and self._threads < NODE_WORKERS:
                self._threads += 1
                threading.Thread(target=self._work, daemon=True,
                                 name=f"celery-dlock-redlock-{self.label}").start()
            self._cond.notify()
        return future

    def _next(self) -> _Task | None:
        with self._cond:
            while not self._queue:
                if not self._cond.wait(IDLE_EXIT) and not self._queue:
                    self._threads -= 1
                    return None
            self._running += 1
            return self._queue.popleft()

    def _work(self) -> None:
        while True:
            task = self._next()
            if task is None:
                return
            future, fn, args, deadline = task
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                if deadline is not None and time.monotonic() >= deadline:
                    future.set_exception(NotSent(
                        "no worker of this node was free before the call's deadline"))
                    continue
                try:
                    result = fn(*args)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            finally:
                with self._cond:
                    self._running -= 1

    def threads(self) -> int:
        with self._cond:
            return self._threads

    def calls(self) -> int:
        with self._cond:
            return len(self._queue) + self._running


_workers: dict[tuple[Any, ...], NodeWorkers] = {}
_workers_lock = threading.Lock()


def _workers_of(node: Any) -> NodeWorkers:
    where = address(node)
    # One set of workers per server (its databases share it); an unknown kind of
    # client gets one of its own.
    key = where[:-1] if where is not None else ("client", id(node))
    with _workers_lock:
        found = _workers.get(key)
        if found is None:
            label = ":".join(str(k) for k in key[1:])
            found = _workers[key] = NodeWorkers(label)
        return found


def submit_to(node: Any, fn: Callable[..., Any], *args: Any,
              deadline: float | None = None) -> cf.Future[Any]:
    """Run ``fn(*args)`` on the workers of ``node``'s server, without waiting; not
    at all when it cannot start before ``deadline`` (``time.monotonic()``)."""
    return _workers_of(node).submit(fn, args, deadline)


def worker_threads() -> int:
    """How many worker threads exist now, over every server (for tests)."""
    with _workers_lock:
        found = list(_workers.values())
    return sum(w.threads() for w in found)


def calls_in_flight() -> int:
    """How many calls wait or run now, over every server (for tests: a Redlock
    operation returns at its quorum, its other calls land a moment later)."""
    with _workers_lock:
        found = list(_workers.values())
    return sum(w.calls() for w in found)


def _after_fork_in_child() -> None:
    global _workers, _workers_lock
    # The parent's threads do not exist here.
    _workers = {}
    _workers_lock = threading.Lock()


after_fork(_after_fork_in_child)
