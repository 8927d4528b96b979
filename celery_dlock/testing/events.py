"""What the ``dlock_events`` fixture records: every celery-dlock signal sent in the
test's process, in order, with helpers to ask what was locked, skipped, contended or
dropped.

Signals are sent where the lock is taken or the call is sent: an eager run, a direct
call, an in-process worker (``celery.contrib.testing.worker.start_worker``) and the
producer of an enqueue-time duplicate all send them in the test's process; a
``celery worker`` subprocess sends its own, which a test cannot see here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any

from celery.utils.dispatch import Signal

from ..task import signals

__all__ = ["KINDS", "Event", "EventLog"]

#: Every kind of event, by the signal that sends it.
_SIGNALS: dict[str, Signal] = {
    "acquired": signals.lock_acquired,
    "contended": signals.lock_contended,
    "released": signals.lock_released,
    "lost": signals.lock_lost,
    "duplicate": signals.lock_duplicate,
}
KINDS: tuple[str, ...] = tuple(_SIGNALS)


@dataclass(frozen=True)
class Event:
    """One signal: its kind, the lock's name, the task that sent it, and the rest of
    what the signal passed (``details``: fence, holder, error, state, reason,
    existing, mode, wait, held_for, as each signal has them)."""

    kind: str
    name: str
    task: str | None
    task_id: str | None
    #: The contention policy (``contended``: retry, wait, skip, raise, duplicate or a
    #: callable's name) or the duplicate policy (``duplicate``: return_existing,
    #: raise, drop or replace); None for the other kinds.
    policy: str | None = None
    #: How the attempt ended (``released``: SUCCESS, FAILURE, RETRY, ...).
    state: str | None = None
    details: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def holder(self) -> Any:
        """Who held the lock (``contended``: a :class:`~celery_dlock.Holder` or
        None)."""
        return self.details.get("holder")

    def __str__(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("policy", self.policy),
                                                  ("state", self.state)) if v)
        return f"{self.kind} {self.name!r}{extra} ({self.task or '?'}[{self.task_id}])"


class EventLog:
    """Records every celery-dlock signal while connected (:meth:`connect`, or as a
    context manager); thread-safe (``lost`` comes from the renewal thread, an
    in-process worker sends from its own threads).

    Each query takes an optional lock name and returns the matching events in order,
    so ``assert dlock_events.skipped("stock:42")`` reads as it says; the log's
    ``repr`` lists everything recorded, which pytest shows when such an assert fails.
    """

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._changed = threading.Condition()
        self._receivers: list[tuple[Signal, Any]] = []

    # -- connecting -------------------------------------------------------------------

    def connect(self) -> EventLog:
        """Start recording (idempotent)."""
        if self._receivers:
            return self
        for kind, signal in _SIGNALS.items():
            def receiver(sender: Any = None, kind: str = kind, **kwargs: Any) -> None:
                self._record(kind, sender, kwargs)

            signal.connect(receiver, weak=False)
            self._receivers.append((signal, receiver))
        return self

    def disconnect(self) -> None:
        """Stop recording (what was recorded stays)."""
        receivers, self._receivers = self._receivers, []
        for signal, receiver in receivers:
            signal.disconnect(receiver)

    def __enter__(self) -> EventLog:
        return self.connect()

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.disconnect()

    def _record(self, kind: str, sender: Any, kwargs: dict[str, Any]) -> None:
        kwargs.pop("signal", None)
        kwargs.pop("key", None)  # the deprecated spelling of name
        policy = kwargs.get("policy") if kind in ("contended", "duplicate") else None
        event = Event(kind=kind, name=str(kwargs.pop("name", "")),
                      task=getattr(sender, "name", None),
                      task_id=kwargs.pop("task_id", None),
                      policy=None if policy is None else str(policy),
                      state=kwargs.get("state") if kind == "released" else None,
                      details=MappingProxyType(dict(kwargs)))
        with self._changed:
            self._events.append(event)
            self._changed.notify_all()

    # -- reading ----------------------------------------------------------------------

    @property
    def events(self) -> list[Event]:
        """Everything recorded so far, in order (a copy)."""
        with self._changed:
            return list(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __len__(self) -> int:
        with self._changed:
            return len(self._events)

    def __repr__(self) -> str:
        events = self.events
        if not events:
            return "<dlock events: none>"
        lines = "".join(f"\n  {event}" for event in events)
        return f"<dlock events:{lines}>"

    def clear(self) -> None:
        """Forget what was recorded so far."""
        with self._changed:
            self._events.clear()

    def of(self, kind: str, name: str | None = None, *, task: str | None = None,
           policy: str | None = None, state: str | None = None) -> list[Event]:
        """The events of ``kind`` (one of :data:`KINDS`), of lock ``name`` and the
        task named ``task``, with that ``policy`` and ``state``, when given."""
        if kind not in _SIGNALS:
            raise ValueError(f"unknown event kind {kind!r}: one of {', '.join(KINDS)}")
        return [e for e in self.events if e.kind == kind and
                (name is None or e.name == name) and
                (task is None or e.task == task) and
                (policy is None or e.policy == policy) and
                (state is None or e.state == state)]

    def acquired(self, name: str | None = None, *, task: str | None = None
                 ) -> list[Event]:
        """Locks taken by a task (its body ran holding them)."""
        return self.of("acquired", name, task=task)

    def released(self, name: str | None = None, *, task: str | None = None,
                 state: str | None = None) -> list[Event]:
        """Locks released when an attempt ended (``state``: how it ended)."""
        return self.of("released", name, task=task, state=state)

    def contended(self, name: str | None = None, *, task: str | None = None,
                  policy: str | None = None) -> list[Event]:
        """Attempts that found the lock held (or Redis unreachable), with the policy
        that then applied."""
        return self.of("contended", name, task=task, policy=policy)

    def skipped(self, name: str | None = None, *, task: str | None = None
                ) -> list[Event]:
        """Attempts skipped on contention (``on_contention="skip"``)."""
        return self.of("contended", name, task=task, policy="skip")

    def lost(self, name: str | None = None, *, task: str | None = None) -> list[Event]:
        """Holds found lost while their task ran."""
        return self.of("lost", name, task=task)

    def duplicates(self, name: str | None = None, *, task: str | None = None,
                   policy: str | None = None) -> list[Event]:
        """Enqueues found to be duplicates (or that replaced the queued call), with
        what the new call got: return_existing, raise, drop or replace."""
        return self.of("duplicate", name, task=task, policy=policy)

    def dropped(self, name: str | None = None, *, task: str | None = None
                ) -> list[Event]:
        """Duplicate enqueues that were dropped (``on_duplicate="drop"``)."""
        return self.of("duplicate", name, task=task, policy="drop")

    def names(self, kind: str = "acquired") -> list[str]:
        """The lock names of the events of ``kind``, in order, each once."""
        return list(dict.fromkeys(e.name for e in self.of(kind)))

    def wait_for(self, kind: str, name: str | None = None, *, timeout: float = 10.0,
                 task: str | None = None, policy: str | None = None,
                 state: str | None = None) -> Event:
        """The first matching event, waiting up to ``timeout`` seconds for it (an
        in-process worker, or the renewal thread, sends from another thread); raises
        ``AssertionError`` listing what was recorded when none comes."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = self.of(kind, name, task=task, policy=policy, state=state)
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
        what = " ".join(filter(None, (kind, repr(name) if name else None)))
        raise AssertionError(f"no {what} event within {timeout}s; recorded: {self!r}")
