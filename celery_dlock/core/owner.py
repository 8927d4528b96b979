"""Who holds a lock: owner tokens.

An *owner* is an opaque string stored in the lock hash.  Two acquisitions with the same
owner re-enter (the hold count goes up); any other owner contends.  The owner of an
acquisition is, in order:

1. the ``owner=`` a :class:`~celery_dlock.RedisLock` was given (any string;
   processes that share it share the hold);
2. the owner of the current *context*, set with :func:`owner_context`.  ``LockedTask``
   sets a fresh token for every execution attempt, so everything that runs inside one
   attempt (direct calls, ``.apply()``, a ``RedisLock`` in the body) re-enters, while a
   redelivery of the same message (same task id) is a different attempt and contends;
3. otherwise a token unique to the calling thread of this process, like
   :class:`threading.RLock`: nested blocks in one thread re-enter, other threads contend.

Timeline of a fork, with ``P`` the parent and ``C`` the child::

    t0  P acquires "x"            owner = host:pidP:ab12..:t1, count 1
    t1  P forks C                 C gets a new process token; its registry is empty
    t2  C: RedisLock(r, "x")      owner = host:pidC:cd34..:t1  -> contends with P
    t3  C exits                   nothing is released or renewed on P's behalf
    t4  P releases "x"            count 0, key deleted

Tokens carry host and pid for the operator reading ``celery dlock ls``, and a random
part so that a recycled pid never inherits an old hold.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextvars import ContextVar

from .process import after_fork

__all__ = [
    "current_owner",
    "new_owner_token",
    "owner_context",
    "process_token",
]

_hostname = socket.gethostname()
_process_token = ""
# Bumped in every forked child, so that context owners inherited from the parent are
# ignored there (after fork() the child is a different owner).
_generation = 0
_thread_ids = itertools.count(1)
_local = threading.local()
_context_owner: ContextVar[tuple[int, str] | None] = ContextVar(
    "celery_dlock_owner", default=None
)


def _new_process_token() -> None:
    global _process_token
    _process_token = f"{_hostname}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1
    _new_process_token()


_new_process_token()
after_fork(_after_fork_in_child)


def generation() -> int:
    """A number that changes in every forked child (for fork-aware caches)."""
    return _generation


def process_token() -> str:
    """``host:pid:random``: unique to this process, renewed in a forked child."""
    return _process_token


def new_owner_token() -> str:
    """A fresh random owner token (``host:pid:`` and 128 random bits in hex), for one
    execution attempt."""
    return f"{_hostname}:{os.getpid()}:{os.urandom(16).hex()}"


def _thread_owner() -> str:
    try:
        n = _local.n
    except AttributeError:
        n = _local.n = next(_thread_ids)
    return f"{_process_token}:t{n}"


def current_owner() -> str:
    """The owner of acquisitions made here, when no explicit owner is given."""
    ctx = _context_owner.get()
    if ctx is not None and ctx[0] == _generation:
        return ctx[1]
    return _thread_owner()


@contextlib.contextmanager
def owner_context(token: str | None = None) -> Iterator[str]:
    """Make ``token`` (or a fresh one) the owner of every acquisition in this context.

    Used by ``LockedTask`` around each execution attempt.  Contexts nest; the previous
    owner is restored on exit.
    """
    if token is None:
        token = new_owner_token()
    reset = _context_owner.set((_generation, token))
    try:
        yield token
    finally:
        _context_owner.reset(reset)
