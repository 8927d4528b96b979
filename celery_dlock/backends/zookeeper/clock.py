"""The ensemble's clock, for the nodes kept by compare-and-set on it (rates,
:mod:`.rates`; queue markers, :mod:`.markers`), and the session they are read and
written on.

ZooKeeper has no call that reads the time, but every write's ``stat.mtime`` is the
leader's clock (ms) when it ran the write.  A step first sets a clock node (no data,
no version check: ``/<prefix>/.rates/.clock``, ``/<prefix>/.markers/.clock``) and
takes ``now`` from the stat it answers: the same clock for every worker, never a
worker's own.  That costs one more quorum write per step; the clock's write and the
read of the step's node go out together (:func:`read_at`: one round trip, and the
server answers a session's calls in the order sent, so the node is read as it was at
that clock or later).  Its assumption: the ensemble's servers' clocks agree (NTP) to
well within the times kept, as a new leader's clock is the one read after a leader
change.  The clock counts whole milliseconds.

Reading (``celery dlock show``, ``ls``) creates nothing: :func:`tick` with
``create=False`` sets the clock node only where it is already there (a step made it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kazoo.exceptions import NodeExistsError, NoNodeError

from ...core.errors import BackendUnavailable
from .session import ZkSession, session_for
from .url import ZkSpec

__all__ = ["SESSION_MS", "call", "mtime_ms", "read_at", "session", "tick"]

#: The session the nodes are read and written on (ms): the backend's reader's.
SESSION_MS = 10_000
#: How many times the clock node may disappear under a step before it gives up.
_TRIES = 100


def session(spec: ZkSpec) -> ZkSession:
    """This process's session for the nodes (looked up on every use: after a fork,
    the child's own)."""
    return session_for(spec, SESSION_MS)


def call(spec: ZkSpec, what: str, name: str | None, where: str,
         fn: Callable[[Any], Any]) -> Any:
    """``fn(client)``'s async result, waited for (kazoo's answers about a node
    raised as they are, the rest as :mod:`.answers` maps them)."""
    found = session(spec)
    client = found.start(what, name)
    return found.wait(what, fn(client), name, where)


def mtime_ms(stat: Any) -> int:
    """When the write that left ``stat`` ran, on the leader's clock (ms)."""
    return int(stat.mtime)


def _gone(clock: str, name: str | None) -> BackendUnavailable:
    return BackendUnavailable(f"ZooKeeper: the clock node {clock!r} kept "
                              f"disappearing", lock_name=name)


def tick(spec: ZkSpec, clock: str, what: str, name: str | None, *,
         create: bool) -> int | None:
    """The ensemble's clock now (ms), from a write of the node ``clock``; None when
    there is no such node and not ``create``."""
    for _ in range(_TRIES):
        try:
            stat = call(spec, what, name, clock, lambda c: c.set_async(clock, b""))
        except NoNodeError:
            if not create:
                return None
            try:
                call(spec, what, name, clock,
                     lambda c: c.create_async(clock, b"", makepath=True))
            except NodeExistsError:
                pass
            continue
        return mtime_ms(stat)
    raise _gone(clock, name)


def read_at(spec: ZkSpec, clock: str, path: str, what: str, name: str
            ) -> tuple[int, bytes | None, Any]:
    """The clock (ms), and the node ``path`` read with it: its data and stat, or
    None twice when there is none (the clock node is made when missing)."""
    for _ in range(_TRIES):
        found = session(spec)
        client = found.start(what, name)
        tick_sent = client.set_async(clock, b"")
        got = client.get_async(path)
        try:
            stat = found.wait(what, tick_sent, name, clock)
        except NoNodeError:  # the first step under this subtree
            tick(spec, clock, what, name, create=True)
            continue
        try:
            raw, node = found.wait(what, got, name, path)
        except NoNodeError:
            return mtime_ms(stat), None, None
        return mtime_ms(stat), raw, node
    raise _gone(clock, name)
