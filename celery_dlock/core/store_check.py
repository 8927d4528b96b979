"""Whether a lock store can do its work, before the first task finds out.

``celery dlock check`` and a worker's start ask a backend's ``check(prefix)``: one
:class:`Problem` per thing found (an empty list: the store is usable),
:class:`BackendUnavailable` when it cannot be reached at all.  Each backend checks
what only it knows (a Redis server's version and eviction policy); every one of them
then takes and releases a
*probe lock*, :data:`PROBE_NAME` under the prefix, which is what a task will do: a
table it cannot create or write, a missing grant, a command an ACL refuses, a znode it
may not create all show there, in the backend's own words.  The probe always uses the
one name, so checking leaves at most one name's records behind, and a probe another
check holds at that moment is a store that works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import BackendUnavailable, DLockError
from .lock_options import LockOptions

__all__ = ["PROBE_NAME", "PROBE_TTL", "Problem", "probe"]


@dataclass(frozen=True)
class Problem:
    """One thing that keeps a store from working as documented.  ``lasting``: a
    matter of configuration (a version, a policy, a grant) that a worker should not
    start with; otherwise a state that may pass (one Redlock node down), which a
    worker starts with and logs."""

    text: str
    lasting: bool = True

    def __str__(self) -> str:
        return self.text

#: The lock name a check takes and releases.
PROBE_NAME = "celery-dlock-check"
#: Its ttl (seconds): a check that dies holding it leaves it this long.
PROBE_TTL = 5.0


def probe(backend: Any, prefix: str) -> list[Problem]:
    """Take and release the probe lock on ``backend``; the problems found (one line
    each).  :class:`BackendUnavailable` when the store does not answer."""
    lock = backend.lock(LockOptions(PROBE_NAME, PROBE_TTL, prefix=prefix,
                                    auto_renew=False,
                                    info={"purpose": "celery dlock check"}))
    try:
        taken = lock.acquire(blocking=False)
    except BackendUnavailable:
        raise
    except DLockError as exc:
        return [Problem(f"a lock cannot be taken: {exc}")]
    if not taken:  # another check holds it this moment: the store works
        return []
    try:
        lock.release()
    except BackendUnavailable:
        raise
    except DLockError as exc:
        return [Problem(f"a lock cannot be released: {exc}")]
    return []
