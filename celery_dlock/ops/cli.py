"""``celery dlock``: see and free the locks that tasks hold.

Installed as a Celery sub-command (the ``celery.commands`` entry point), so it uses the
app given with ``-A``::

    celery -A proj dlock ls                 # a table of held locks
    celery -A proj dlock ls --json          # the same, as a JSON list
    celery -A proj dlock show stock:42      # one lock, every field
    celery -A proj dlock release stock:42   # free it (asks first; --force does not)
    celery -A proj dlock top                # a live view, with recent contention
    celery -A proj dlock web                # the same on a page (docs/web.md)

Redis is the app's (``dlock_client``, ``dlock_url``, a Redis broker URL or a Redis result
backend, as the workers find it; passwords are never printed) and the key prefix
``dlock_key_prefix`` (``dlock``); ``--url`` and ``--prefix`` before the sub-command
override them: ``celery -A proj dlock --url redis://other:6379/1 ls``.

Exit codes: 0 done, 1 nothing to do (an unknown lock, a release that was declined or
found the lock changed hands), 2 Redis unreachable or not configured.

``top`` shows recent contention only when the workers record it: set
``app.conf.dlock_record_events = True`` (see :mod:`celery_dlock.task.events`).

Names with a queue marker (a call sent with an enqueue-time ``lock_mode``, queued and
not yet started) show its task id: ``ls`` in the ``QUEUED_TASK_ID`` and ``QUEUED_TTL``
columns (and a row of their own when nobody holds the lock), ``show`` on its
``queued`` line, ``top`` as a count and a short list.  The markers are reached through
:func:`celery_dlock.task.backend.markers_for`; where the backend keeps none, nothing
about them is shown.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import unquote

import click
from celery import current_app
from redis.exceptions import RedisError

from ..core.errors import DLockError, LockKeyConflict
from ..core.holds import SUMMARY_FIELDS, HoldChanged, HoldInfo
from .audit import released_by
from .check import check
from .formatting import (
    QUEUED_FIELDS,
    cell_text,
    duration_text,
    holder_text,
    printable,
    queued_text,
    slot_text,
    table_lines,
    value_cells,
    with_slots,
)
from .freeing import free_hold
from .oneline import OneLineGroup
from .rates import rate_cell, rate_state, rate_states, rate_text
from .target import (
    EXIT_NOT_FOUND,
    EXIT_UNAVAILABLE,
    Queued,
    Target,
    fail,
    reports_redis_errors,
    target_of,
)
from .top import top
from .web.command import web

__all__ = ["dlock"]

#: The fields of a row of ``ls --json``.
LS_FIELDS = (*SUMMARY_FIELDS, *QUEUED_FIELDS, "rate")


def _lock_name(backend: Any, prefix: str, text: str) -> str:
    """The lock name ``text`` stands for: itself, or the name whose storage key it is
    (``dlock:{report:2026-11-02}``, as ``show`` prints it, as a log may name it), when
    it is one and that name is held.  Whatever a read runs into (another
    application's data at the name, a store down) is left to the command to say."""
    try:
        if backend.read(prefix, text) is not None:
            return text
        head, _, tail = backend.storage_key(prefix, "probe").rpartition("probe")
        if len(text) > len(head) + len(tail) and text.startswith(head) and \
                text.endswith(tail):
            inner = text[len(head):len(text) - len(tail)]
            # as written, or percent-encoded (a ZooKeeper node's segment)
            for name in dict.fromkeys((inner, unquote(inner))):
                if backend.read(prefix, name) is not None:
                    return name
    except (DLockError, RedisError):
        pass
    return text


def _row(name: str, info: HoldInfo | None, queued: Queued | None) -> dict[str, Any]:
    """One lock name's fields: its hold's (None when not held), its marker's."""
    row: dict[str, Any] = info.summary() if info is not None else {
        field: (name if field == "key" else None) for field in SUMMARY_FIELDS}
    row["queued_task_id"], row["queued_ttl"] = queued if queued else (None, None)
    return row


#: The logger kazoo's clients write to (celery_dlock/backends/zookeeper/logs.py).
KAZOO_LOGGER = "celery_dlock.kazoo"

# -- the group ------------------------------------------------------------------------

@click.group(name="dlock", cls=OneLineGroup)
@click.option("--url", metavar="URL",
              help="The store to read: a Redis, PostgreSQL, MySQL or ZooKeeper URL "
                   "(default: the app's, as the workers find it).")
@click.option("--prefix", metavar="PREFIX",
              help="Key prefix (default: app.conf.dlock_key_prefix, else 'dlock').")
@click.pass_context
def dlock(ctx: click.Context, /, url: str | None, prefix: str | None,
          **_preload: Any) -> None:
    """Inspect and free the locks of celery-dlock tasks, in the app's lock store
    (Redis, PostgreSQL, MySQL or ZooKeeper)."""
    # kazoo's own warnings (a connection dropped, tried again) would print beside the
    # one line a ZooKeeper that cannot be reached is reported in.
    logging.getLogger(KAZOO_LOGGER).setLevel(logging.CRITICAL)
    app = getattr(ctx.obj, "app", None)
    if app is None:  # invoked outside `celery` (no CLIContext): the current app
        app = current_app
    target = Target(app, url, prefix)
    ctx.meta["celery_dlock.target"] = target
    ctx.call_on_close(target.close)


@dlock.command(name="ls")
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON list (fields: " + ", ".join(LS_FIELDS) + ").")
@click.pass_context
@reports_redis_errors
def ls(ctx: click.Context, as_json: bool) -> None:
    """List held locks, and queued calls' markers, sorted by key.

    TTL is the time left before the hold expires unless renewed, HELD_FOR the time
    since it was taken (by the Redis server's clock).  QUEUED_TASK_ID is the call
    queued with an enqueue-time lock_mode (shown when any is), QUEUED_TTL its
    marker's time left; a name queued and not held has a row of its own.  RATE is
    the state of a lock_rate (shown when any name has one): calls that may start
    now of its burst, and when the next slot is free; a rated name not held has a
    row of its own too.  ARGS (shown when any is) are the arguments that made a
    hashed name (a task with lock_key=None, a compat shim's keys or unique_on).
    """
    target = target_of(ctx)
    backend = target.backend()
    infos = {info.key: info for info in backend.holds(target.prefix)}
    queued = target.queued() or {}
    rates = rate_states(backend, target.prefix)
    rows = [_row(name, infos.get(name), queued.get(name))
            for name in sorted(infos.keys() | queued.keys() | rates.keys())]
    for row in rows:
        rate = rates.get(row["key"])
        row["rate"] = rate.as_dict() if rate is not None else None
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo(printable(f"No locks held under prefix {target.prefix!r}."))
        return
    columns = with_slots((*SUMMARY_FIELDS, *(QUEUED_FIELDS if queued else ()),
                          *(("rate",) if rates else ())), infos.values())
    if any(row.get("args") for row in rows):  # hashed names: what made them, after them
        columns = (*columns[:columns.index("key") + 1], "args",
                   *columns[columns.index("key") + 1:])
    cells = ({**row, "rate": rate_cell(rates.get(row["key"]))} for row in rows)
    for line in table_lines(columns, (value_cells(row, columns) for row in cells)):
        click.echo(printable(line))


@dlock.command()
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.pass_context
@reports_redis_errors
def show(ctx: click.Context, key: str, as_json: bool) -> None:
    """Show one lock (KEY is the lock name, as ls shows it, or where the store keeps
    it, as show prints it: redis_key or stored_at) with every field, the
    call queued for it (an enqueue-time lock_mode's marker) and its lock_rate's
    state."""
    target = target_of(ctx)
    backend = target.backend()
    key = _lock_name(backend, target.prefix, key)
    info = backend.read(target.prefix, key)
    queued = target.queued_one(key)
    rate = rate_state(backend, target.prefix, key)
    if info is None and queued is None and rate is None:
        _not_held(ctx, target, key)
        return
    if as_json:
        full: dict[str, Any] = info.as_dict() if info is not None else {
            **_row(key, None, None), "host": None, "extra": {}}
        full["queued_task_id"], full["queued_ttl"] = queued if queued else (None, None)
        full["rate"] = rate.as_dict() if rate is not None else None
        click.echo(json.dumps(full, indent=2))
        return
    fields: list[tuple[str, str]] = [] if info is not None else [("key", key),
                                                                 ("held", "no")]
    for name, value in (info.as_dict() if info is not None else {}).items():
        if name == "extra":
            fields += [(f"extra.{k}", v) for k, v in value.items()]
        elif name == "holders":  # a semaphore's: one line each
            assert info is not None
            fields += [(f"holder.{i}", slot_text(h))
                       for i, h in enumerate(info.holders, 1)]
        elif name in ("ttl", "held_for"):
            fields.append((name, "-" if value is None else f"{value:.3f}s"))
        else:
            fields.append((name, cell_text(value)))
    if target.markers() is not None:
        fields.append(("queued", queued_text(*queued) if queued else "-"))
    if info is not None:
        waiting = backend.waiting(target.prefix, [key]).get(key, 0)
        fields.append(("waiting", str(waiting)))
    if rate is not None:
        fields.append(("rate", rate_text(rate)))
    label = "redis_key" if backend.kind in ("redis", "redlock") else "stored_at"
    fields.append((label, backend.storage_key(target.prefix, key)))
    size = max(len(name) for name, _ in fields) + 1
    for name, text in fields:
        click.echo(printable(f"{name + ':':<{size}} {text}"))


def _not_held(ctx: click.Context, target: Target, key: str) -> None:
    fail(ctx, f"No lock named {key!r} is held under prefix {target.prefix!r}.",
         EXIT_NOT_FOUND)


@dlock.command()
@click.argument("key")
@click.option("-f", "--force", is_flag=True, help="Don't ask for confirmation.")
@click.option("--reason", metavar="TEXT",
              help="Why: recorded with who released it (event, log line, and the "
                   "reason the holder's lock_lost reports).")
@click.pass_context
@reports_redis_errors
def release(ctx: click.Context, key: str, force: bool, reason: str | None) -> None:
    """Free the lock KEY whoever holds it, and wake the next waiter.

    The holder is not stopped: a task still running goes on without its lock (its
    scheduler reports the lock lost, "released by USER@HOST with celery dlock release
    --force: REASON").  Without --force, asks first, and frees only the hold it showed.
    """
    target = target_of(ctx)
    backend = target.backend()
    key = _lock_name(backend, target.prefix, key)
    expected: int | None = None
    if not force:
        info = backend.read(target.prefix, key)
        if info is None:
            _not_held(ctx, target, key)
            return
        if info.limit is not None:
            click.confirm(
                f"Semaphore {key!r} has {info.slots} slots held, by "
                + "; ".join(printable(h.describe()) for h in info.holders)
                + ".\nReleasing frees every slot while their holders may still be "
                "running.\n(to skip this prompt use --force)\nRelease them?",
                abort=True)
        else:
            click.confirm(
                f"Lock {key!r} is held by {printable(info.describe())} for "
                f"{duration_text(info.held_for)} "
                f"(owner {printable(info.owner)}, fence {cell_text(info.fence)}).\n"
                "Releasing it lets another run take it while this one may still be "
                "running.\n(to skip this prompt use --force)\nRelease it?",
                abort=True)
            expected = info.fence
    try:
        freed = free_hold(target, key, fence=expected, by=released_by(force),
                          reason=reason)
    except HoldChanged as exc:
        now = f": now {holder_text(exc.current)}" if exc.current else ""
        fail(ctx, f"Lock {key!r} changed hands since it was shown{now}. "
                   "Nothing was released.", EXIT_NOT_FOUND)
        return
    except LockKeyConflict as exc:
        fail(ctx, f"celery dlock: {exc}", EXIT_UNAVAILABLE)
        return
    if freed is None:
        _not_held(ctx, target, key)
        return
    if freed.limit is not None:
        click.echo(printable(f"Released {len(freed.holders)} slot(s) of semaphore "
                             f"{key!r}: "
                             + "; ".join(holder_text(h) for h in freed.holders) + "."))
        return
    click.echo(printable(f"Released lock {key!r}: {holder_text(freed)}."))


dlock.add_command(top)
dlock.add_command(check)
dlock.add_command(web)
