"""Passwords holding URL delimiters, and the check that no part of one was shown.

Each password is used raw and percent-encoded (``quote(password, safe="")``): the
encoded form is how the README says to write it; the raw form is what a user may write
anyway.  ``RAW_WORKS`` marks a password whose raw form still reads one way only (a
``;``, ``:``, ``@`` or ``%`` not followed by two hex digits, but no ``#``, ``?`` or
``/``), so redis-py gets it right unencoded too.
"""

from __future__ import annotations

from urllib.parse import quote

import pytest

__all__ = ["PASSWORDS", "RAW_WORKS", "assert_hidden", "encoded", "fragments"]

ALL_DELIMITERS = "p;a#s?s/w@o:r%d"
#: ``%41`` decodes to ``A`` unless it is written ``%2541``.
LOOKS_ENCODED = "%41x;Q7/@k?#z"
#: No ``#``, ``?`` or ``/``: the raw form reads one way only.
RAW_WORKS = "semi;colon:at@pct%zz"

PASSWORDS = [
    pytest.param(ALL_DELIMITERS, id="all-delimiters"),
    pytest.param(LOOKS_ENCODED, id="looks-encoded"),
    pytest.param(RAW_WORKS, id="raw-unambiguous"),
]

_DELIMITERS = set(";#?/@:%")
# The distinctive fragments named in the hardening issue, for the first password.
_NAMED = {ALL_DELIMITERS: ("p;a", "s?s", "w@o", "p%3Ba")}


def encoded(password: str) -> str:
    return quote(password, safe="")


def fragments(password: str) -> set[str]:
    """The password, raw and encoded, and every 4-character piece of either that holds
    a delimiter and a letter or digit (no message has a reason to contain one)."""
    found = {password, encoded(password), *_NAMED.get(password, ())}
    for form in (password, encoded(password)):
        for i in range(len(form) - 3):
            piece = form[i:i + 4]
            if _DELIMITERS & set(piece) and any(c.isalnum() for c in piece):
                found.add(piece)
    return found


def assert_hidden(text: str, password: str) -> None:
    """No fragment of ``password`` (:func:`fragments`) is in ``text``."""
    shown = sorted(f for f in fragments(password) if f in text)
    assert not shown, f"password fragments {shown} shown in: {text!r}"
