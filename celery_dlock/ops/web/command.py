"""``celery dlock web``: serve the operators' page (:mod:`celery_dlock.ops.web.app`)
with the standard library's WSGI server, on 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import ipaddress
import logging
import sys
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import click

from ..target import target_of
from .app import WebApp
from .guard import TOKEN_ENV, Guard

__all__ = ["serve", "web"]

logger = logging.getLogger("celery_dlock.web")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    """Requests logged on ``celery_dlock.web`` at debug level, not on stderr; a
    connection left idle (a browser's opened ahead) closed after a while."""

    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(app: WebApp, host: str, port: int) -> WSGIServer:
    """A server of ``app`` bound to ``host``:``port`` (0: a free port), not yet
    serving (call ``serve_forever``)."""
    return make_server(host, port, app, server_class=_Server, handler_class=_Quiet)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8787, show_default=True,
              help="Port to listen on (0: any free one).")
@click.option("--token", metavar="TOKEN",
              help=f"Allow releasing locks from the page to whoever gives this token "
                   f"(default: ${TOKEN_ENV}, which unlike --token no process list "
                   f"shows; neither: the page is read-only).")
@click.option("--refresh", type=click.FloatRange(min=0.5), default=5.0,
              show_default=True, help="Seconds between refreshes of a page.")
@click.pass_context
def web(ctx: click.Context, host: str, port: int, token: str | None,
        refresh: float) -> None:
    """Serve a web page of the locks: held locks, semaphores, queued calls, rates, one
    lock's history, contention per minute; releasing one hold when a token is set."""
    target = target_of(ctx)
    guard = Guard.from_env(token)
    server = serve(WebApp(target, guard, refresh=refresh), host, port)
    where = f"http://{host}:{server.server_port}/"
    mode = "releasing allowed with the token" if guard.writable else "read-only"
    click.echo(f"celery dlock web: serving {target.store()} {target.where()} prefix "
               f"{target.prefix!r} on {where} ({mode}); Ctrl-C stops.")
    if not _loopback(host):
        click.echo(f"celery dlock web: {host} is reachable from other machines and the "
                   "page has no login of its own: put it behind one (docs/web.md).",
                   err=True)
    sys.stdout.flush()
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        click.echo("")
    finally:
        server.server_close()
