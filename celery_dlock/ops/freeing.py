"""Freeing one lock by hand, the one way ``celery dlock release`` and the web page
(:mod:`celery_dlock.ops.web`) both do it: through the backend's ``force_release`` (only
the hold with the fence shown, when one was), then recorded by
:func:`~celery_dlock.ops.audit.record_release` (the audit log line and the ``released``
event ``top`` shows)."""

from __future__ import annotations

from ..core.holds import HoldInfo
from .audit import record_release
from .target import Target

__all__ = ["free_hold"]


def free_hold(target: Target, key: str, *, fence: int | None, by: str,
              reason: str | None, who: str | None = None) -> HoldInfo | None:
    """Free ``key``'s hold (the one with ``fence``, when given: another hold raises
    :class:`~celery_dlock.core.holds.HoldChanged` and nothing is freed); the hold
    freed, or None when nothing was held.  The holder's loss reason names ``by`` and
    ``reason``; the release is logged on ``celery_dlock.audit`` and, where the backend
    keeps a history, written to it, as released by ``who`` (default: ``user@host``)."""
    freed = target.backend().force_release(target.prefix, key, fence=fence, by=by,
                                           reason=reason)
    if freed is not None:
        record_release(target.client(), target.prefix, key, freed, reason, who)
    return freed
