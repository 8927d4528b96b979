"""``celery dlock``: see and free the locks that tasks hold.

Installed as a Celery sub-command (the ``celery.commands`` entry point), so it uses the
app given with ``-A``::

    celery -A proj dlock ls                 # a table of held locks
    celery -A proj dlock ls --json          # the same, as a JSON list
    celery -A proj dlock show stock:42      # one lock, every field
    celery -A proj dlock release stock:42   # free it (asks first; --force does not)
    celery -A proj dlock top                # a live view, with recent contention

Redis is the app's (``dlock_client``, ``dlock_url``, a Redis broker URL or a Redis result
backend, as the workers find it; passwords are never printed) and the key prefix
``dlock_key_prefix`` (``dlock``); ``--url`` and ``--prefix`` before the sub-command
override them: ``celery -A proj dlock --url redis://other:6379/1 ls``.

Exit codes: 0 done, 1 nothing to do (an unknown lock, a release that was declined or
found the lock changed hands), 2 Redis unreachable or not configured.

``top`` shows recent contention only when the workers record it: set
``app.conf.dlock_record_events = True`` (see :mod:`celery_dlock.task.events`).
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click
from celery import current_app
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..core.errors import BackendUnavailable, InvalidLockConfig, LockKeyConflict
from ..core.hold import DEFAULT_PREFIX
from ..core.protocol import Backend
from ..task.backend import backend_for, backend_of_client
from ..task.config import mask_url, resolve_url
from ..task.connection import client_for_url
from ..task.events import Event, recent_events, recording_enabled
from ..task.settings import conf_of, conf_value
from .audit import record_release, released_by
from .formatting import (
    cell_text,
    duration_text,
    fit_widths,
    holder_text,
    printable,
    row_cells,
    table_lines,
)
from .inspect import (
    SUMMARY_FIELDS,
    HoldChanged,
)
from .oneline import OneLineGroup

__all__ = ["dlock"]

EXIT_NOT_FOUND = 1
EXIT_UNAVAILABLE = 2

F = TypeVar("F", bound=Callable[..., Any])


class _Target:
    """Which backend and prefix the sub-commands read; made on first use."""

    def __init__(self, app: Any, url: str | None, prefix: str | None) -> None:
        self.app = app
        self.url = url
        self.prefix: str = prefix or conf_value(app, "dlock_key_prefix", DEFAULT_PREFIX)
        self._backend: Backend | None = None
        self._client: Any = None

    def backend(self) -> Backend:
        """The backend the locks are read from (one Redis; a Redlock is refused in
        one line: give --url with one of its servers)."""
        if self._backend is None:
            backend = (backend_of_client(self._url_client()) if self.url
                       else backend_for(self.app))
            if backend.kind == "redlock":
                backend.holds(self.prefix)  # raises NotSupported, in one line
            self._backend = backend
        return self._backend

    def client(self) -> Any:
        """The Redis client of the backend (for the event history)."""
        return getattr(self.backend(), "client", None)

    def _url_client(self) -> Any:
        if self._client is None and self.url:
            try:
                self._client = client_for_url(self.url, conf_of(self.app))
            except (ValueError, TypeError) as exc:
                text = str(exc).replace(self.url, mask_url(self.url))
                raise InvalidLockConfig(f"--url {mask_url(self.url)!r} is not a "
                                        f"Redis URL it can use: {text}") from None
            except (RedisClusterException, RedisError) as exc:  # a dead cluster
                text = str(exc).replace(self.url, mask_url(self.url))
                raise BackendUnavailable(f"Redis unavailable at "
                                         f"{mask_url(self.url)}: {text}") from None
        return self._client

    def where(self) -> str:
        """The Redis being read, for messages (passwords masked)."""
        if self.url:
            return mask_url(self.url)
        conf = conf_of(self.app)
        if conf_value(conf, "dlock_client"):
            client = getattr(self._backend, "client", None)
            kwargs = getattr(getattr(client, "connection_pool", None),
                             "connection_kwargs", None) or {}
            if "path" in kwargs:
                return f"unix://{kwargs['path']}"
            if "host" in kwargs:
                return f"{kwargs['host']}:{kwargs.get('port', 6379)}"
            return "the client of app.conf.dlock_client"
        try:
            return mask_url(resolve_url(conf))
        except InvalidLockConfig:
            return "?"

    def close(self) -> None:
        if self.url and self._client is not None:
            self._client.close()


def _target(ctx: click.Context) -> _Target:
    target = ctx.meta["celery_dlock.target"]
    assert isinstance(target, _Target)
    return target


def _fail(ctx: click.Context, message: str, code: int) -> None:
    click.echo(printable(message), err=True)
    ctx.exit(code)


def _reports_redis_errors(fun: F) -> F:
    """Turn an unreachable or unconfigured Redis into one line and exit code 2."""

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        target = _target(ctx)
        try:
            return fun(*args, **kwargs)
        except InvalidLockConfig as exc:
            _fail(ctx, f"celery dlock: {exc}", EXIT_UNAVAILABLE)
        except (BackendUnavailable, RedisConnectionError, RedisTimeoutError) as exc:
            cause = exc.__cause__ if isinstance(exc, BackendUnavailable) else exc
            _fail(ctx, f"cannot reach Redis at {target.where()}: {cause or exc}",
                  EXIT_UNAVAILABLE)
        except RedisError as exc:
            _fail(ctx, f"Redis at {target.where()} answered with an error: {exc}",
                  EXIT_UNAVAILABLE)
        return None

    return wrapper  # type: ignore[return-value]


# -- the group ------------------------------------------------------------------------

@click.group(name="dlock", cls=OneLineGroup)
@click.option("--url", metavar="URL",
              help="Redis to read (default: the app's, as the workers find it).")
@click.option("--prefix", metavar="PREFIX",
              help="Key prefix (default: app.conf.dlock_key_prefix, else 'dlock').")
@click.pass_context
def dlock(ctx: click.Context, /, url: str | None, prefix: str | None,
          **_preload: Any) -> None:
    """Inspect and free the Redis locks of celery-dlock tasks."""
    app = getattr(ctx.obj, "app", None)
    if app is None:  # invoked outside `celery` (no CLIContext): the current app
        app = current_app
    target = _Target(app, url, prefix)
    ctx.meta["celery_dlock.target"] = target
    ctx.call_on_close(target.close)


@dlock.command(name="ls")
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON list (fields: " + ", ".join(SUMMARY_FIELDS) + ").")
@click.pass_context
@_reports_redis_errors
def ls(ctx: click.Context, as_json: bool) -> None:
    """List held locks, sorted by key.

    TTL is the time left before the hold expires unless renewed, HELD_FOR the time
    since it was taken (by the Redis server's clock).
    """
    target = _target(ctx)
    infos = sorted(target.backend().holds(target.prefix), key=lambda i: i.key)
    if as_json:
        click.echo(json.dumps([info.summary() for info in infos], indent=2))
        return
    if not infos:
        click.echo(printable(f"No locks held under prefix {target.prefix!r}."))
        return
    rows = (row_cells(info, SUMMARY_FIELDS) for info in infos)
    for line in table_lines(SUMMARY_FIELDS, rows):
        click.echo(printable(line))


@dlock.command()
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.pass_context
@_reports_redis_errors
def show(ctx: click.Context, key: str, as_json: bool) -> None:
    """Show one lock (KEY is the lock name, as ls shows it) with every field."""
    target = _target(ctx)
    backend = target.backend()
    info = backend.read(target.prefix, key)
    if info is None:
        _fail(ctx, f"No lock named {key!r} is held under prefix {target.prefix!r}.",
              EXIT_NOT_FOUND)
        return
    if as_json:
        click.echo(json.dumps(info.as_dict(), indent=2))
        return
    waiting = backend.waiting(target.prefix, [key]).get(key, 0)
    fields: list[tuple[str, str]] = []
    for name, value in info.as_dict().items():
        if name == "extra":
            fields += [(f"extra.{k}", v) for k, v in value.items()]
        elif name in ("ttl", "held_for"):
            fields.append((name, "-" if value is None else f"{value:.3f}s"))
        else:
            fields.append((name, cell_text(value)))
    fields.append(("waiting", str(waiting)))
    fields.append(("redis_key", backend.storage_key(target.prefix, key)))
    size = max(len(name) for name, _ in fields) + 1
    for name, text in fields:
        click.echo(printable(f"{name + ':':<{size}} {text}"))


@dlock.command()
@click.argument("key")
@click.option("-f", "--force", is_flag=True, help="Don't ask for confirmation.")
@click.option("--reason", metavar="TEXT",
              help="Why: recorded with who released it (event, log line, and the "
                   "reason the holder's lock_lost reports).")
@click.pass_context
@_reports_redis_errors
def release(ctx: click.Context, key: str, force: bool, reason: str | None) -> None:
    """Free the lock KEY whoever holds it, and wake the next waiter.

    The holder is not stopped: a task still running goes on without its lock (its
    scheduler reports the lock lost, "released by USER@HOST with celery dlock release
    --force: REASON").  Without --force, asks first, and frees only the hold it showed.
    """
    target = _target(ctx)
    backend = target.backend()
    expected: int | None = None
    if not force:
        info = backend.read(target.prefix, key)
        if info is None:
            _fail(ctx, f"No lock named {key!r} is held under prefix "
                       f"{target.prefix!r}.", EXIT_NOT_FOUND)
            return
        click.confirm(
            f"Lock {key!r} is held by {printable(info.describe())} for "
            f"{duration_text(info.held_for)} "
            f"(owner {printable(info.owner)}, fence {cell_text(info.fence)}).\n"
            "Releasing it lets another run take it while this one may still be "
            "running.\n(to skip this prompt use --force)\nRelease it?", abort=True)
        expected = info.fence
    try:
        freed = backend.force_release(target.prefix, key, fence=expected,
                                      by=released_by(force), reason=reason)
    except HoldChanged as exc:
        now = f": now {holder_text(exc.current)}" if exc.current else ""
        _fail(ctx, f"Lock {key!r} changed hands since it was shown{now}. "
                   "Nothing was released.", EXIT_NOT_FOUND)
        return
    except LockKeyConflict as exc:
        _fail(ctx, f"celery dlock: {exc}", EXIT_UNAVAILABLE)
        return
    if freed is None:
        _fail(ctx, f"No lock named {key!r} is held under prefix {target.prefix!r}.",
              EXIT_NOT_FOUND)
        return
    record_release(target.client(), target.prefix, key, freed, reason)
    click.echo(printable(f"Released lock {key!r}: {holder_text(freed)}."))


# -- top ------------------------------------------------------------------------------

_TOP_COLUMNS = ("key", "task_name", "task_id", "worker", "pid", "count", "fence",
                "ttl", "held_for", "waiting")
_TOP_WIDTHS = {"key": 40, "task_name": 40, "task_id": 36, "worker": 30}


def _event_line(event: Event) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(event.at))
    who = f"{event.task_name or '?'}[{event.task_id or '?'}]"
    if event.kind == "released":
        return (f"{stamp}  released   {event.key}  by {event.worker or '?'}: "
                f"{event.detail or '?'}")
    if event.kind == "lost":
        return f"{stamp}  lost       {event.key}  {who}: {event.detail or 'lost'}"
    held = ""
    if event.holder_task_name or event.holder_task_id:
        held = f"{event.holder_task_name or '?'}[{event.holder_task_id or '?'}]"
    elif event.detail:
        held = event.detail
    if event.holder_worker and event.holder_worker not in held:
        held += f" on {event.holder_worker}"
    line = f"{stamp}  contended  {event.key}  {who}"
    if event.policy:
        line += f" -> {event.policy}"
    return line + (f"  (held by {held})" if held else "")


def _top_screen(target: _Target, max_events: int) -> list[str]:
    backend = target.backend()
    client = target.client()
    infos = list(backend.holds(target.prefix))
    infos.sort(key=lambda i: -1.0 if i.held_for is None else i.held_for, reverse=True)
    events = recent_events(client, target.prefix, max_events)
    size = shutil.get_terminal_size()
    room = max(3, size.lines - 7 - (len(events) or 1))
    shown = infos[:room]
    waiting = backend.waiting(target.prefix, [i.key for i in shown])
    lines = [f"celery dlock top - {target.where()} - prefix {target.prefix!r} - "
             f"{time.strftime('%H:%M:%S')} - {len(infos)} held", ""]
    if shown:
        rows = [row_cells(i, _TOP_COLUMNS, {"waiting": waiting.get(i.key, 0)})
                for i in shown]
        # Narrow terminals: one space between columns rather than cut them.
        gap = 2 if size.columns >= 100 else 1
        widths = fit_widths(_TOP_COLUMNS, rows, _TOP_WIDTHS, size.columns, gap)
        lines += table_lines(_TOP_COLUMNS, rows, widths, gap)
        if len(infos) > len(shown):
            lines.append(f"... and {len(infos) - len(shown)} more (celery dlock ls)")
    else:
        lines.append("No locks held.")
    lines += ["", "Recent contention (newest first):"]
    if events:
        lines += ["  " + _event_line(e) for e in events]
    elif recording_enabled(target.app):
        lines.append("  none recorded")
    else:
        lines.append("  not recorded: set app.conf.dlock_record_events = True for "
                     "the workers to keep a history")
    if sys.stdout.isatty():
        lines = [line[:size.columns] for line in lines]
    return lines


@dlock.command()
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0,
              show_default=True, help="Seconds between refreshes.")
@click.option("--iterations", type=click.IntRange(min=0), default=0,
              help="Stop after this many refreshes (default: until Ctrl-C).")
@click.option("--events", "max_events", type=click.IntRange(min=0), default=10,
              show_default=True, help="Recent contention events to show.")
@click.pass_context
@_reports_redis_errors
def top(ctx: click.Context, interval: float, iterations: int, max_events: int) -> None:
    """A live view of held locks, longest held first, and recent contention."""
    target = _target(ctx)
    done = 0
    try:
        while True:
            lines = _top_screen(target, max_events)
            click.clear()
            click.echo("\n".join(printable(line) for line in lines))
            done += 1
            if iterations and done >= iterations:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        click.echo("")
