"""Free text that reaches a server or an operator (who released a lock, and why): one
line, bounded, URL passwords masked."""

from __future__ import annotations

from .urls import mask_secrets

__all__ = ["REASON_MAX", "clean_text"]

#: The longest ``reason`` (and ``by``) kept, in characters.
REASON_MAX = 200


def clean_text(text: str | None, limit: int = REASON_MAX) -> str:
    """``text`` as one line of at most ``limit`` characters, URL passwords masked."""
    if not text:
        return ""
    line = " ".join(str(text).split())
    line = mask_secrets(line)
    if len(line) > limit:
        line = line[:limit - 3].rstrip() + "..."
    return line
