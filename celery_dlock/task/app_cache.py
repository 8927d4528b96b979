"""What this process made from an app's lock settings, kept once per app.

An app's settings are resolved when a lock is first asked for: its Redis client (one
client, a tuple of them for Redlock, none when the store is not Redis), the settings
check, and its backend.  Each is kept here, in one entry per app, so that a task run
reads none of its settings again.  One reset drops them all:

* in a child made by ``fork()`` (a prefork pool's process): its parent's clients and
  connections are not its own, so it makes its own at its first lock;
* by :func:`forget`, for tests that change ``app.conf`` between calls.

Backends made from a URL alone (:func:`~celery_dlock.task.backend.lock_from_url`,
and an app whose store is chosen by its URL) are kept here too, one per URL.

An app that takes no weak reference is kept by its ``id()`` for the life of the
process (such apps are test doubles; a Celery app takes weak references).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.process import after_fork

__all__ = ["AppEntry", "by_url", "entry", "forget", "lock", "lookup"]


@dataclass
class AppEntry:
    """What this process made from one app's settings (filled in as it is asked)."""

    #: The Redis client(s) of the app's lock store and the key it was made for (the
    #: resolved URL, ``"factory"`` for ``dlock_client``, or the Redlock URLs).
    client: Any = None
    client_key: str | None = None
    #: The app's backend, and the client it was made with (None: chosen by its URL).
    backend: Any = None
    backend_client: Any = None
    #: The app's settings passed :func:`~celery_dlock.task.config.check_conf`.
    checked: bool = False


_entries: weakref.WeakKeyDictionary[Any, AppEntry] = weakref.WeakKeyDictionary()
_by_id: dict[int, AppEntry] = {}
_by_url: dict[str, Any] = {}
_lock = threading.Lock()


def lookup(app: Any) -> AppEntry | None:
    """``app``'s entry when one was made in this process (no lock: the hot path)."""
    try:
        return _entries.get(app)
    except TypeError:
        return _by_id.get(id(app))


def entry(app: Any) -> AppEntry:
    """``app``'s entry, made empty on first use."""
    found = lookup(app)
    if found is not None:
        return found
    with _lock:
        found = lookup(app)
        if found is None:
            found = AppEntry()
            try:
                _entries[app] = found
            except TypeError:
                _by_id[id(app)] = found
        return found


def lock() -> threading.Lock:
    """The lock that serialises filling in an entry (a client or a backend made once)."""
    return _lock


def by_url(key: str, make: Callable[[], Any]) -> Any:
    """This process's backend for the URL ``key`` (``make()`` on first use)."""
    found = _by_url.get(key)
    if found is not None:
        return found
    with _lock:
        found = _by_url.get(key)
        if found is None:
            found = _by_url[key] = make()
        return found


def forget(app: Any) -> AppEntry | None:
    """Drop ``app``'s entry (the next lock resolves its settings again); returns it,
    so that a caller can close its clients."""
    with _lock:
        try:
            return _entries.pop(app, None)
        except TypeError:
            return _by_id.pop(id(app), None)


def _after_fork_in_child() -> None:
    global _entries, _by_id, _by_url, _lock
    # The parent's clients are not the child's; its lock may have been held at the
    # moment of the fork.
    _entries = weakref.WeakKeyDictionary()
    _by_id = {}
    _by_url = {}
    _lock = threading.Lock()


after_fork(_after_fork_in_child)
