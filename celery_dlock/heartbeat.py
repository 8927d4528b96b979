"""The per-process renewal thread ("heartbeat") and its registry of holds.

One daemon thread per process renews every auto-renewed hold of that process.  It wakes
when the earliest hold is due (every ``ttl/3``) and renews, in **one script call per
Redis client** (per slot on a cluster), every hold that is due within the next half of
its interval, so holds taken at different moments fall into step and the number of
Redis calls per interval does not grow with the number of holds.

Rules that keep renewal from ever outliving its holder:

* the registry keeps a *weak* reference to each lock object: a lock that was dropped
  without release stops being renewed and expires by itself;
* a hold is registered inside ``acquire`` and unregistered *before* the release script
  runs, so no renewal can race a release;
* renewal never re-creates a key: a lock found gone or held by another owner is reported
  lost (``on_lost``) and dropped from the registry;
* transient Redis errors are retried quickly until the hold's own deadline (last
  successful renewal + ttl); past it the hold is lost, because the key has expired;
* after ``fork()`` the child starts with an empty registry and no thread (see
  :func:`get_heartbeat`), so a child never renews its parent's locks.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.exceptions import RedisError

from .scripts import RENEW_MANY

__all__ = ["Heartbeat", "RenewableHold", "get_heartbeat"]

logger = logging.getLogger("celery_dlock.heartbeat")

#: After a failed renewal, try again this often (seconds) until the hold's deadline.
ERROR_RETRY_INTERVAL = 0.25
#: With nothing to renew the thread still looks again this often (seconds), so that a
#: short hold (a typical task) registers and unregisters without waking it at all.
IDLE_WAIT = 1.0


class RenewableHold(Protocol):
    """What the heartbeat needs from a lock object."""

    @property
    def name(self) -> str: ...

    def _mark_lost(self, reason: str) -> bool: ...


@dataclass(eq=False)
class _Entry:
    ref: weakref.ReferenceType[Any]
    lock_id: int
    client: Any
    key: str
    owner: str
    ttl_ms: int
    next_due: float = 0.0
    deadline: float = 0.0
    group: tuple[int, int] = field(default=(0, 0))

    @property
    def interval(self) -> float:
        return self.ttl_ms / 3000.0


def _slot_of(client: Any, key: str) -> int:
    keyslot = getattr(client, "keyslot", None)
    return int(keyslot(key)) if callable(keyslot) else 0


class Heartbeat:
    """Registry of held locks plus the thread that renews them.

    ``clock`` is injectable for tests; :meth:`renew_due` runs one renewal pass without
    the thread, at a given time.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        start_thread: bool = True,
    ) -> None:
        self._clock = clock
        self._start_thread = start_thread
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[int, _Entry] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        # When the thread next looks at the registry by itself (clock time); a
        # registration due before that must wake it.
        self._wake_at = math.inf
        self.renewal_calls = 0  # script calls made, for tests and benchmarks

    # -- registry -----------------------------------------------------------------

    def register(self, lock: RenewableHold, client: Any, key: str, owner: str,
                 ttl_ms: int) -> None:
        now = self._clock()
        entry = _Entry(
            ref=weakref.ref(lock),
            lock_id=id(lock),
            client=client,
            key=key,
            owner=owner,
            ttl_ms=ttl_ms,
            group=(id(client), _slot_of(client, key)),
        )
        entry.next_due = now + entry.interval
        entry.deadline = now + ttl_ms / 1000.0
        with self._cond:
            self._entries[id(lock)] = entry
            if self._start_thread and self._thread is None:
                self._start()
            elif entry.next_due < self._wake_at:
                self._cond.notify()

    def unregister(self, lock: object) -> None:
        with self._cond:
            self._entries.pop(id(lock), None)

    def update_ttl(self, lock: object, ttl_ms: int) -> None:
        """The hold was extended to ``ttl_ms``: renew with that ttl from now on."""
        now = self._clock()
        with self._cond:
            entry = self._entries.get(id(lock))
            if entry is not None:
                entry.ttl_ms = ttl_ms
                entry.deadline = now + ttl_ms / 1000.0
                entry.next_due = now + entry.interval
                if entry.next_due < self._wake_at:
                    self._cond.notify()

    def held_locks(self) -> list[Any]:
        """The live lock objects whose holds are registered."""
        with self._cond:
            refs = [e.ref() for e in self._entries.values()]
        return [lock for lock in refs if lock is not None]

    def is_registered(self, lock: object) -> bool:
        with self._cond:
            return id(lock) in self._entries

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    # -- renewal ------------------------------------------------------------------

    def renew_due(self, now: float | None = None) -> float | None:
        """Renew every hold due by ``now`` (plus half its interval).

        Returns when the next hold falls due, or ``None`` when nothing is registered.
        """
        if now is None:
            now = self._clock()
        with self._cond:
            self._drop_dead()
            due = [e for e in self._entries.values()
                   if e.next_due <= now + e.interval / 2]
        groups: dict[tuple[int, int], list[_Entry]] = {}
        for entry in due:
            groups.setdefault(entry.group, []).append(entry)
        for entries in groups.values():
            self._renew_group(entries, now)
        with self._cond:
            if not self._entries:
                return None
            return min(e.next_due for e in self._entries.values())

    def _renew_group(self, entries: list[_Entry], now: float) -> None:
        # One call for the whole group; one key per (key, owner) even when several
        # lock objects of one owner re-entered the same lock.
        unique: dict[tuple[str, str], int] = {}
        for e in entries:
            pair = (e.key, e.owner)
            unique[pair] = max(unique.get(pair, 0), e.ttl_ms)
        keys = [k for k, _ in unique]
        args: list[Any] = []
        for (_, owner), ttl_ms in unique.items():
            args += (owner, ttl_ms)
        try:
            self.renewal_calls += 1
            replies = RENEW_MANY(entries[0].client, keys, args)
        except RedisError as exc:
            self._renewal_failed(entries, now, exc)
            return
        status = {pair: int(r) for pair, r in zip(unique, replies, strict=True)}
        lost: list[tuple[_Entry, str]] = []
        with self._cond:
            for e in entries:
                code = status[(e.key, e.owner)]
                if code == 1:
                    e.deadline = now + e.ttl_ms / 1000.0
                    e.next_due = now + e.interval
                elif self._entries.get(e.lock_id) is e:
                    # Only a hold still registered is lost; one unregistered while
                    # this call was in flight was simply released.
                    reason = ("expired before it was renewed" if code == 0
                              else "taken by another owner")
                    del self._entries[e.lock_id]
                    lost.append((e, reason))
        self._report_lost(lost)

    def _renewal_failed(self, entries: Iterable[_Entry], now: float,
                        exc: Exception) -> None:
        lost: list[tuple[_Entry, str]] = []
        with self._cond:
            for e in entries:
                if self._entries.get(e.lock_id) is not e:
                    continue
                if now >= e.deadline:
                    del self._entries[e.lock_id]
                    lost.append((e, f"renewals failed until the ttl ran out ({exc})"))
                else:
                    e.next_due = now + min(ERROR_RETRY_INTERVAL, e.interval)
        if entries:
            logger.warning("lock renewal failed (%s); retrying until each hold's ttl "
                           "runs out", exc)
        self._report_lost(lost)

    def _report_lost(self, lost: list[tuple[_Entry, str]]) -> None:
        for entry, reason in lost:
            lock = entry.ref()
            if lock is None:
                continue
            logger.warning("lock %r lost: %s", entry.key, reason)
            try:
                lock._mark_lost(reason)
            except Exception:  # a callback must never kill the heartbeat
                logger.exception("on_lost callback for %r failed", entry.key)

    # -- thread -------------------------------------------------------------------

    def _start(self) -> None:
        self._stopping = False
        thread = threading.Thread(
            target=self._run, name="celery-dlock-heartbeat", daemon=True
        )
        self._thread = thread
        thread.start()

    def _run(self) -> None:
        logger.debug("heartbeat thread started in pid %s", os.getpid())
        while True:
            with self._cond:
                if self._stopping:
                    return
                self._drop_dead()
                now = self._clock()
                if not self._entries:
                    self._wake_at = now + IDLE_WAIT
                    self._cond.wait(IDLE_WAIT)
                    continue
                due = min(e.next_due for e in self._entries.values())
                if due > now:
                    self._wake_at = due
                    self._cond.wait(due - now)
                    continue
                self._wake_at = now  # renewing: it looks again before sleeping
            try:
                self.renew_due()
            except Exception:  # never let the thread die
                logger.exception("heartbeat pass failed")
                time.sleep(ERROR_RETRY_INTERVAL)

    def _drop_dead(self) -> None:
        dead = [k for k, e in self._entries.items() if e.ref() is None]
        for k in dead:
            del self._entries[k]

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread (registrations are kept; a later register restarts it)."""
        with self._cond:
            self._stopping = True
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


_process_heartbeat: Heartbeat | None = None
_process_heartbeat_lock = threading.Lock()


def get_heartbeat() -> Heartbeat:
    """This process's heartbeat, created on first use (and anew after a fork)."""
    global _process_heartbeat
    hb = _process_heartbeat
    if hb is None:
        with _process_heartbeat_lock:
            hb = _process_heartbeat
            if hb is None:
                hb = _process_heartbeat = Heartbeat()
    return hb


def _after_fork_in_child() -> None:
    global _process_heartbeat, _process_heartbeat_lock
    # The parent's thread does not exist here and its lock may have been held at the
    # moment of the fork: start from nothing.
    _process_heartbeat = None
    _process_heartbeat_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
