"""What the scheduler asks of a backend: a target that renews holds on one server.

The scheduler (:mod:`celery_dlock.core.scheduler`) knows nothing of Redis; each backend
supplies one :class:`RenewTarget` per server (for Redis:
:mod:`celery_dlock.backends.redis.renewal`), so that servers are renewed independently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

__all__ = ["LossNote", "RenewTarget"]


class LossNote(NamedTuple):
    """A renew target's answer for a hold found gone when the backend knows why:
    ``code`` as the plain answer (0 gone, -1 taken), and ``reason``, which applies to
    the hold with fencing token ``fence`` only (an older hold of the same owner may
    have left it)."""

    code: int
    fence: int
    reason: str


class RenewTarget(Protocol):
    """Renews holds on one server (supplied by the backend)."""

    def renew(self, items: Sequence[tuple[str, str, int]]
              ) -> Sequence[int | LossNote]:
        """Renew each ``(key, owner, ttl_ms)``; per item 1 renewed, 0 gone, -1 taken,
        or a :class:`LossNote` (gone, and why).

        Raises on a failure of the whole call (the scheduler retries)."""
        ...
