"""The operators' web page of the locks (``celery dlock web``, or :func:`make_app` as
a WSGI application mounted in an existing site).  Standard library only: server-side
HTML and SVG, a few lines of inline JavaScript to refresh in place, nothing loaded
from elsewhere.  See ``docs/web.md``."""

from __future__ import annotations

from .app import WebApp, make_app

__all__ = ["WebApp", "make_app"]
