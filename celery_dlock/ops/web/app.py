"""The operators' page as a WSGI application: routing, requests and responses.

::

    from celery_dlock.ops.web import make_app
    application = make_app(celery_app)             # read-only
    application = make_app(celery_app, token=...)  # releasing allowed

Mount it under any path (Django, Flask, any WSGI server): links are relative.  Pages:
``locks`` (the index), ``semaphores``, ``queued`` (only where the backend keeps queue
markers), ``rates`` (only where it keeps rates), ``summary``, ``lock?name=``, and
``release`` (the confirmation, and the POST that frees).  ``?fragment=1`` returns only
the part the page refreshes in place.

The store is read by one request at a time (a lock around each page's reads): an
operators' page never adds more than one reader to the store, and a backend object is
never shared between threads mid-call.  The list of holds is read at most once a
second, whatever the number of pages open (:mod:`.snapshot`).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl

from redis.exceptions import RedisError

from ...core.errors import BackendUnavailable, DLockError
from ...core.registry import MARKERS, RATES
from ..target import Target
from . import views
from .guard import Guard
from .html import REFRESH_JS, esc, link, page, unquoted
from .lockpage import confirm_view, lock_view, release
from .snapshot import Snapshot

__all__ = ["CSP", "WebApp", "make_app"]

logger = logging.getLogger("celery_dlock.web")

_SCRIPT_HASH = base64.b64encode(hashlib.sha256(REFRESH_JS.encode()).digest()).decode()
#: Nothing but the page itself: its one inline script (by hash), its inline style,
#: fetches to itself, forms to itself, never framed.
CSP = (f"default-src 'none'; script-src 'sha256-{_SCRIPT_HASH}'; "
       "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")

#: What a store that cannot be read raises (the page says so, in one line).
_STORE_ERRORS = (BackendUnavailable, RedisError, DLockError)

#: The largest POST body read.
_MAX_BODY = 16 * 1024

StartResponse = Callable[..., Any]


def _params(raw: str) -> dict[str, str]:
    return dict(parse_qsl(raw, keep_blank_values=True, errors="surrogateescape"))


class WebApp:
    """The WSGI application (see the module's docstring)."""

    def __init__(self, target: Target, guard: Guard, *, refresh: float = 5.0) -> None:
        self.target = target
        self.guard = guard
        self.refresh = refresh
        self._store = threading.Lock()
        self.snapshot = Snapshot(target, max_age=min(1.0, refresh / 2))

    # -- what the backend offers (its capabilities) ------------------------------
    def can(self, capability: str) -> bool:
        try:
            return capability in self.target.backend().capabilities
        except _STORE_ERRORS:  # a store down: said by the page that reads it
            return False

    def has_markers(self) -> bool:
        return self.can(MARKERS)

    def has_rates(self) -> bool:
        return self.can(RATES)

    def tabs(self) -> list[tuple[str, str]]:
        tabs = [("locks", "Locks"), ("semaphores", "Semaphores")]
        if self.has_markers():
            tabs.append(("queued", "Queued"))
        if self.has_rates():
            tabs.append(("rates", "Rates"))
        tabs.append(("summary", "Summary"))
        return tabs

    # -- WSGI ------------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: StartResponse
                 ) -> Iterable[bytes]:
        raw_path = str(environ.get("PATH_INFO") or "")
        if not raw_path:  # mounted at /x and asked for /x: relative links need /x/
            start_response("301 Moved Permanently", [
                ("Location", str(environ.get("SCRIPT_NAME") or "") + "/")])
            return [b""]
        path = raw_path.strip("/") or "locks"
        params = _params(str(environ.get("QUERY_STRING") or ""))
        method = str(environ.get("REQUEST_METHOD") or "GET").upper()
        seed = self.guard.seed_of(environ)
        headers: list[tuple[str, str]] = []
        if seed is None:
            seed = self.guard.new_seed()
            headers.append(self.guard.cookie_header(
                seed, str(environ.get("SCRIPT_NAME") or "") + "/"))
        try:
            with self._store:
                status, body = self._route(path, method, params, environ, seed)
        except _STORE_ERRORS as exc:
            logger.warning("celery dlock web: the store did not answer: %s", exc)
            status = "503 Service Unavailable"
            body = self._page("Store unavailable", path, "",
                              f"<p class=err>Cannot read {esc(self.target.store())} at "
                              f"{esc(self.target.where())}: {esc(exc)}</p>")
        except Exception:  # a bug: logged in full, the page says only that
            logger.exception("celery dlock web: %s %s failed", method, path)
            status = "500 Internal Server Error"
            body = self._page("Error", path, "", "<p class=err>This page failed; the "
                              "server's log (celery_dlock.web) has why.</p>",
                              live_part=False)
        data = body.encode("utf-8", "backslashreplace")
        headers += [("Content-Type", "text/html; charset=utf-8"),
                    ("Content-Length", str(len(data))),
                    ("Content-Security-Policy", CSP),
                    ("X-Content-Type-Options", "nosniff"),
                    ("X-Frame-Options", "DENY"),
                    ("Referrer-Policy", "no-referrer"),
                    ("Cache-Control", "no-store")]
        start_response(status, headers)
        return [data]

    def _page(self, title: str, path: str, head: str, live: str, *,
              live_part: bool = True) -> str:
        notice = "" if self.guard.writable else (
            '<p class="ro">Read-only: releasing from this page is off (start it with '
            "--token or DLOCK_WEB_TOKEN to allow it).</p>")
        where = (f"{self.target.store()} {self.target.where()} "
                 f"prefix {self.target.prefix!r}")
        return page(title, self.tabs(), path, where, live, head=head, live=live_part,
                    refresh=self.refresh, notice=notice)

    def _route(self, path: str, method: str, params: Mapping[str, str],
               environ: Mapping[str, Any], seed: str) -> tuple[str, str]:
        fragment = params.get("fragment") == "1"
        holds = self.snapshot.holds
        lists: dict[str, Callable[[], views.View]] = {
            "locks": lambda: views.locks_view(self.target, params, holds),
            "semaphores": lambda: views.semaphores_view(self.target, params, holds),
            "summary": lambda: views.summary_view(
                self.target, params, lambda: views.summary_counts(
                    self.target, holds, self.has_markers(), self.has_rates())),
        }
        if self.has_markers():
            lists["queued"] = lambda: views.queued_view(self.target, params)
        if self.has_rates():
            lists["rates"] = lambda: views.rates_view(self.target, params)
        if method == "POST":
            if path != "release":
                return "405 Method Not Allowed", self._message(path, "Not allowed.")
            return self._release(environ, seed)
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", self._message(path, "Not allowed.")
        if path in lists:
            view = lists[path]()
        elif path == "lock" and "name" in params:
            view = lock_view(self.target, params["name"], self.guard.writable)
        elif path == "release" and "name" in params:
            if not self.guard.writable:
                return "403 Forbidden", self._message(path, "Releasing is off: this "
                                                      "page is read-only.")
            try:
                fence = int(params.get("fence", ""))
            except ValueError:
                return "400 Bad Request", self._message(path, "No fence given.")
            view = confirm_view(self.target, params["name"], fence,
                                self.guard.csrf_for(seed))
            return "200 OK", self._page(view.title, path, "", view.live,
                                        live_part=False)
        else:
            return "404 Not Found", self._message(path, "No such page.")
        if fragment:
            return "200 OK", view.live
        return "200 OK", self._page(view.title, path, view.head, view.live)

    def _message(self, path: str, text: str) -> str:
        return self._page(text, path, "", f"<p class=err>{esc(text)}</p>",
                          live_part=False)

    def _release(self, environ: Mapping[str, Any], seed: str) -> tuple[str, str]:
        form = self._form(environ)
        if not self.guard.csrf_ok(environ, form.get("csrf")):
            return "403 Forbidden", self._message(
                "release", "Refused: this form did not come from this page (CSRF).")
        if not self.guard.writable:
            return "403 Forbidden", self._message(
                "release", "Releasing is off: this page is read-only.")
        if not self.guard.token_ok(form.get("token")):
            return "403 Forbidden", self._message("release", "Refused: wrong token.")
        remote = str(environ.get("REMOTE_ADDR") or "")
        freed, text = release(self.target, form, remote)
        self.snapshot.forget()
        back = link("lock", "Back to the lock", name=unquoted(form.get("key", "")))
        body = f"{text}<p>{back} &middot; <a href=locks>All locks</a></p>"
        return ("200 OK" if freed else "409 Conflict"), self._page(
            "Released" if freed else "Not released", "release", "", body,
            live_part=False)

    @staticmethod
    def _form(environ: Mapping[str, Any]) -> dict[str, str]:
        try:
            size = min(int(environ.get("CONTENT_LENGTH") or 0), _MAX_BODY)
        except ValueError:
            size = 0
        raw = environ["wsgi.input"].read(size) if size > 0 else b""
        return _params(raw.decode("latin-1"))


def make_app(celery_app: Any, *, url: str | None = None, prefix: str | None = None,
             token: str | None = None, refresh: float = 5.0) -> WebApp:
    """The page for ``celery_app``'s lock store (or ``url``'s), under ``prefix``;
    ``token`` (else ``DLOCK_WEB_TOKEN``) allows releasing."""
    return WebApp(Target(celery_app, url, prefix), Guard.from_env(token),
                  refresh=refresh)
