"""Who may release a lock from the page: the operator's token and the CSRF check.

Releasing is off unless a token is configured (``--token`` or ``DLOCK_WEB_TOKEN``);
then the confirmation form asks for it and the server compares it in constant time.
Every POST also carries a CSRF token: an HMAC, under a key made when the app starts,
of a random value the browser keeps in a ``SameSite=Lax`` cookie (not sent with
another site's POST; sent when a link elsewhere opens the page, so that opening it
from a chat keeps the seed the open tabs' forms were made with).  A page of another
site can neither read the cookie nor the token, so a forged POST fails even when the
operator's browser holds the cookie; a POST whose ``Origin`` names another host is
refused too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from http.cookies import SimpleCookie

__all__ = ["COOKIE", "TOKEN_ENV", "Guard"]

#: The cookie holding the browser's CSRF seed.
COOKIE = "dlock_csrf"
#: The environment variable the release token is read from.
TOKEN_ENV = "DLOCK_WEB_TOKEN"


class Guard:
    """The release token (None: the page is read-only) and the CSRF key."""

    def __init__(self, token: str | None) -> None:
        self.token = token or None
        self._key = secrets.token_bytes(32)

    @classmethod
    def from_env(cls, token: str | None) -> Guard:
        """``token``, else ``DLOCK_WEB_TOKEN``, else read-only."""
        return cls(token if token else os.environ.get(TOKEN_ENV) or None)

    @property
    def writable(self) -> bool:
        return self.token is not None

    def token_ok(self, given: str | None) -> bool:
        if self.token is None or not given:
            return False
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                   self.token.encode("utf-8", "surrogateescape"))

    @staticmethod
    def seed_of(environ: Mapping[str, object]) -> str | None:
        """The CSRF seed of the request's cookie (None: none yet)."""
        cookie = SimpleCookie()
        try:
            cookie.load(str(environ.get("HTTP_COOKIE") or ""))
        except Exception:  # a malformed cookie header: as if none
            return None
        morsel = cookie.get(COOKIE)
        value = morsel.value if morsel is not None else ""
        return value if len(value) == 32 and value.isalnum() else None

    @staticmethod
    def new_seed() -> str:
        return secrets.token_hex(16)

    def csrf_for(self, seed: str) -> str:
        """The CSRF token a form of this browser carries."""
        return hmac.new(self._key, seed.encode("ascii"), hashlib.sha256).hexdigest()

    def csrf_ok(self, environ: Mapping[str, object], given: str | None) -> bool:
        """Whether a POST carries the CSRF token of its own cookie and comes from
        this page (an ``Origin`` header, when sent, naming this host)."""
        seed = self.seed_of(environ)
        if seed is None or not given:
            return False
        origin = str(environ.get("HTTP_ORIGIN") or "")
        if origin and origin != "null":
            host = str(environ.get("HTTP_HOST") or "")
            if origin.split("://", 1)[-1] != host:
                return False
        return hmac.compare_digest(given, self.csrf_for(seed))

    @staticmethod
    def cookie_header(seed: str, path: str) -> tuple[str, str]:
        return ("Set-Cookie", f"{COOKIE}={seed}; Path={path or '/'}; HttpOnly; "
                              "SameSite=Lax")
