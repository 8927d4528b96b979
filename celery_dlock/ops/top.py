"""``celery dlock top``: a live view of held locks, the calls queued with an
enqueue-time ``lock_mode`` (their markers), the names with a ``lock_rate``, and recent
contention."""

from __future__ import annotations

import shutil
import sys
import time

import click

from ..task.events import Event, recent_events, recording_enabled
from .formatting import (
    duration_text,
    fit_widths,
    printable,
    row_cells,
    table_lines,
    with_slots,
)
from .interrupt import CtrlC
from .rates import rate_cell, rate_states
from .target import Queued, Target, reports_redis_errors, target_of

__all__ = ["top"]

#: Queued calls listed by name (the header counts them all).
_QUEUED_SHOWN = 5

# Ctrl-C ends the view at the next step, never lost in a client's finaliser
# (see .interrupt).
_CTRL_C = CtrlC()

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
    if event.kind == "duplicate":
        return (f"{stamp}  duplicate  {event.key}  {who} -> {event.policy or '?'}  "
                f"(queued: {event.holder_task_id or '?'}, {event.detail or '?'})")
    if event.kind == "parked":
        return f"{stamp}  parked     {event.key}  {who}: {event.detail or '?'}"
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


def _queued_lines(queued: dict[str, Queued] | None) -> list[str]:
    """The calls queued with an enqueue-time lock_mode, soonest to expire first (a few:
    ``celery dlock ls`` has them all)."""
    if not queued:
        return []
    order = sorted(queued.items(), key=lambda item: (
        item[1][1] is None, item[1][1] or 0.0, item[0]))
    lines = ["", f"Queued calls (queue markers, {len(queued)}):"]
    width = max(len(name) for name, _ in order[:_QUEUED_SHOWN])
    lines += [f"  {name:<{width}}  {task_id}  {duration_text(left)}"
              for name, (task_id, left) in order[:_QUEUED_SHOWN]]
    if len(order) > _QUEUED_SHOWN:
        lines.append(f"  ... and {len(order) - _QUEUED_SHOWN} more (celery dlock ls)")
    return lines


def _rate_lines(backend: object, prefix: str) -> list[str]:
    """The names with a lock_rate state (a call lately), next slot soonest first (a
    few: ``celery dlock ls`` has them all): free now of the burst, next slot."""
    states = rate_states(backend, prefix)
    if not states:
        return []
    order = sorted(states.items(), key=lambda item: (item[1].next_in, item[0]))
    lines = ["", f"Rates (lock_rate, {len(states)}):"]
    width = max(len(name) for name, _ in order[:_QUEUED_SHOWN])
    lines += [f"  {name:<{width}}  {rate_cell(state)}"
              for name, state in order[:_QUEUED_SHOWN]]
    if len(order) > _QUEUED_SHOWN:
        lines.append(f"  ... and {len(order) - _QUEUED_SHOWN} more (celery dlock ls)")
    return lines


def _top_screen(target: Target, max_events: int) -> list[str]:
    backend = target.backend()
    client = target.client()
    infos = list(backend.holds(target.prefix))
    infos.sort(key=lambda i: -1.0 if i.held_for is None else i.held_for, reverse=True)
    events = [] if client is None else recent_events(client, target.prefix, max_events)
    queued = target.queued()
    queue_lines = _queued_lines(queued) + _rate_lines(backend, target.prefix)
    size = shutil.get_terminal_size()
    room = max(3, size.lines - 7 - (len(events) or 1) - len(queue_lines))
    shown = infos[:room]
    waiting = backend.waiting(target.prefix, [i.key for i in shown])
    count = f"{len(infos)} held" + ("" if queued is None else f", {len(queued)} queued")
    lines = [f"celery dlock top - {target.where()} - prefix {target.prefix!r} - "
             f"{time.strftime('%H:%M:%S')} - {count}", ""]
    if shown:
        columns = with_slots(_TOP_COLUMNS, shown)
        rows = [row_cells(i, columns, {"waiting": waiting.get(i.key, 0)})
                for i in shown]
        # Narrow terminals: one space between columns rather than cut them.
        gap = 2 if size.columns >= 100 else 1
        widths = fit_widths(columns, rows, _TOP_WIDTHS, size.columns, gap)
        lines += table_lines(columns, rows, widths, gap)
        if len(infos) > len(shown):
            lines.append(f"... and {len(infos) - len(shown)} more (celery dlock ls)")
    else:
        lines.append("No locks held.")
    lines += queue_lines
    lines += ["", "Recent contention (newest first):"]
    if events:
        lines += ["  " + _event_line(e) for e in events]
    elif client is None:
        lines.append(f"  not kept by the {target.backend().kind} backend yet "
                     f"(docs/backends.md)")
    elif recording_enabled(target.app):
        lines.append("  none recorded")
    else:
        lines.append("  not recorded: set app.conf.dlock_record_events = True for "
                     "the workers to keep a history")
    if sys.stdout.isatty():
        lines = [line[:size.columns] for line in lines]
    return lines


@click.command()
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0,
              show_default=True, help="Seconds between refreshes.")
@click.option("--iterations", type=click.IntRange(min=0), default=0,
              help="Stop after this many refreshes (default: until Ctrl-C).")
@click.option("--events", "max_events", type=click.IntRange(min=0), default=10,
              show_default=True, help="Recent contention events to show.")
@click.pass_context
@reports_redis_errors
def top(ctx: click.Context, interval: float, iterations: int, max_events: int) -> None:
    """A live view of held locks, longest held first, and recent contention."""
    target = target_of(ctx)
    done = 0
    try:
        with _CTRL_C.installed():
            while True:
                lines = _top_screen(target, max_events)
                _CTRL_C.check()
                click.clear()
                click.echo("\n".join(printable(line) for line in lines))
                done += 1
                if iterations and done >= iterations:
                    return
                _CTRL_C.sleep(interval)
    except KeyboardInterrupt:
        click.echo("")
