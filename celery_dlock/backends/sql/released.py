"""Why a hold is gone when it was released by force: the ``forced`` note a force
release leaves on the row (the fence and owner of the hold it freed, who, why)."""

from __future__ import annotations

from typing import Any

from ...core.text import clean_text

__all__ = ["forced_reason"]


def forced_reason(forced: Any, owner: str, fence: int | None = None
                  ) -> tuple[int, str] | None:
    """``(fence, "released by ...")`` when ``forced`` names ``owner``'s hold (and
    ``fence``, when given); else None."""
    if not isinstance(forced, dict) or forced.get("owner") != owner:
        return None
    try:
        freed = int(forced.get("fence"))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if fence is not None and freed != fence:
        return None
    by = clean_text(forced.get("by")) or "someone"
    reason = clean_text(forced.get("reason"))
    return freed, (f"released by {by}: {reason}" if reason else f"released by {by}")
