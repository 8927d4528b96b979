"""URLs that may carry a password: cut a ``;``-separated list, mask the secrets, and
refuse a URL that cannot be read one way only.

The rule (README, "Settings"):

* a password (or user name, or query value) holding any of ``; # ? / @ : %`` is
  written percent-encoded: ``%3B %23 %3F %2F %40 %3A %25``
  (``urllib.parse.quote(password, safe="")``); redis-py decodes it before it is sent;
* ``;`` separates URLs only where another URL starts (``;`` then ``scheme://``), so a
  ``;`` inside a password, even unencoded, never cuts a list;
* a URL with a ``#``, or with an ``@`` after the host (an unencoded ``/``, ``?`` or
  ``#`` in its password moved the host), is refused: :func:`ambiguity` says why,
  naming no part of the URL.

No message shows a password: :func:`mask_url` replaces it (and every ``password``,
``secret``, ``token`` or ``auth`` query value) by ``**``; a URL that cannot be read
one way only is shown as its scheme alone.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import InvalidLockConfig

__all__ = ["ENCODE_HINT", "ambiguity", "check_unambiguous", "mask_secrets",
           "mask_setting", "mask_url", "split_urls"]

_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*://"
_STARTS = re.compile(_SCHEME)
# A ';' (and blanks) that a next URL, or nothing, follows.
_NEXT_URL = re.compile(r";\s*(?=" + _SCHEME + r"|$)")
# A user name shown as it is (no delimiter, nothing percent-encoded).
_PLAIN_USER = re.compile(r"[A-Za-z0-9._~!$&'()*+,=\-]+")
_SECRET_VALUE = re.compile(
    r"(?P<key>[?&][^=&?#/]*(?:pass|secret|token|auth)[^=&?#/]*=)[^&]*", re.IGNORECASE)
# A URL in free text: up to a blank, a quote, a bracket or a comma.
_IN_TEXT = re.compile(_SCHEME + r"[^\s'\"()<>,]*")

#: How to write a password with special characters, for error messages.
ENCODE_HINT = ("percent-encode the password (and any user name or query value) "
               "holding ; # ? / @ : or %: %3B %23 %3F %2F %40 %3A %25, e.g. "
               "urllib.parse.quote(password, safe='')")


def split_urls(text: str) -> list[str]:
    """The URLs of a ``;``-separated list: cut only at a ``;`` that another
    ``scheme://`` (or the end) follows; blank parts dropped."""
    return [part.strip() for part in _NEXT_URL.split(text) if part.strip()]


def _parts(url: str) -> tuple[str, str, str] | None:
    """``(scheme://, authority, rest)`` read strictly (the authority ends at the first
    ``/``, ``?`` or ``#``); None without a scheme."""
    found = _STARTS.match(url)
    if found is None:
        return None
    after = url[found.end():]
    end = min((i for i in (after.find(c) for c in "/?#") if i >= 0), default=len(after))
    return found.group(0), after[:end], after[end:]


def ambiguity(url: str) -> str | None:
    """Why ``url`` cannot be read one way only (words that quote none of it), or None.

    A ``#`` anywhere (redis-py would drop what follows it), or an ``@`` after the host:
    both are what an unencoded ``#``, ``?`` or ``/`` in a password leaves.
    """
    parts = _parts(url)
    if parts is None:
        return None
    _, _, rest = parts
    if "#" in url:
        return "it has a '#'"
    if "@" in rest:
        return "it has an '@' after the host"
    return None


def _mask_one(url: str) -> str:
    parts = _parts(url)
    if parts is None:
        return _SECRET_VALUE.sub(lambda m: m["key"] + "**", url)
    scheme, authority, rest = parts
    if ambiguity(url) is not None:
        return scheme + "**"
    userinfo, at, host = authority.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        shown = f"{user}:**" if colon and (not user or _PLAIN_USER.fullmatch(user)) \
            else "**"
        authority = f"{shown}@{host}"
    return scheme + authority + _SECRET_VALUE.sub(lambda m: m["key"] + "**", rest)


def mask_url(url: str) -> str:
    """``url`` (or ``;``-separated URLs) with every password and secret query value
    replaced by ``**``; a URL that cannot be read one way only: its scheme and ``**``."""
    return ";".join(_mask_one(part) for part in split_urls(url)) if url else url


def mask_secrets(text: str) -> str:
    """Free ``text`` with every URL in it masked (:func:`mask_url`)."""
    return _IN_TEXT.sub(lambda match: mask_url(match.group(0)), text)


def mask_setting(value: Any) -> str:
    """A setting's value fit for a message: a URL (or ``;``-separated URLs, or a list
    of them) masked by :func:`mask_url`; anything else by its type only."""
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(repr(mask_setting(v)) for v in value) + "]"
    if not isinstance(value, str):
        return f"<a {type(value).__name__}>"
    return mask_url(value)


def check_unambiguous(url: str, where: str) -> str:
    """``url``, when it reads one way only; else :class:`InvalidLockConfig` naming
    ``where`` and how to encode, quoting no part of the URL."""
    why = ambiguity(url)
    if why is not None:
        raise InvalidLockConfig(f"{where} cannot be read one way only ({why}): "
                                f"{ENCODE_HINT}")
    return url
