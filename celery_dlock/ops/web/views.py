"""The list pages: held locks, semaphores, queue markers, rates, and the summary.

Each reads the store the way ``celery dlock ls`` and ``top`` do (the backend's
``holds()``, its markers and rates when it keeps them, the event history where there
is one), filters by a name prefix and a task, sorts by name and shows one page of
:data:`PAGE_SIZE` rows; the waiters are counted for the rows shown only, in one call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ...core.holds import HoldInfo
from ...task.event_counts import minute_counts
from ...task.events import EVENTS_MAX, Event, recent_events, recording_enabled
from ..formatting import duration_text
from ..rates import rate_states
from ..target import Target
from .chart import MINUTES, svg_chart
from .html import attr, esc, link, table, text_of

__all__ = ["EVENT_HEADERS", "PAGE_SIZE", "Holds", "View", "event_rows", "events_table",
           "history", "locks_view", "queued_view", "rates_view", "semaphores_view",
           "summary_counts", "summary_view"]

#: Rows per page.
PAGE_SIZE = 100

#: The holds under the prefix (a :class:`~.snapshot.Snapshot`'s ``holds``).
Holds = Callable[[], list[HoldInfo]]

T = TypeVar("T")


@dataclass(frozen=True)
class View:
    """What a page shows: its title, a part that stays (a filter form) and the part
    refreshed in place."""

    title: str
    head: str
    live: str


def _filter_form(path: str, params: Mapping[str, str]) -> str:
    return (f'<form class="filter" method="get" action="{esc(path)}">'
            f'<label>name starts with <input name="name" value="'
            f'{attr(params.get("name"))}"></label>'
            f'<label>task <input name="task" value="{attr(params.get("task"))}">'
            '</label><button>Filter</button></form>')


def _page_of(items: Sequence[T], params: Mapping[str, str], path: str
             ) -> tuple[Sequence[T], str]:
    """The rows of the page asked for, and the links to the others."""
    try:
        number = max(1, int(params.get("page", "1")))
    except ValueError:
        number = 1
    pages = max(1, -(-len(items) // PAGE_SIZE))
    number = min(number, pages)
    start = (number - 1) * PAGE_SIZE
    shown = items[start:start + PAGE_SIZE]
    keep = {k: v for k, v in params.items() if k in ("name", "task")}
    nav = [f"{len(items)} in all"]
    if pages > 1:
        nav.append(f"page {number} of {pages}")
        if number > 1:
            nav.append(link(path, "previous", **keep, page=number - 1))
        if number < pages:
            nav.append(link(path, "next", **keep, page=number + 1))
    return shown, f"<p class=pages>{' &middot; '.join(nav)}</p>"


def _matches(info: HoldInfo, params: Mapping[str, str]) -> bool:
    name, task = params.get("name", ""), params.get("task", "")
    if name and not info.key.startswith(name):
        return False
    if task:
        infos = info.holders or (info,)
        return any(task in (h.task_name or "") or task in (h.task_id or "")
                   for h in infos)
    return True


def _lock_link(name: str) -> str:
    return link("lock", name, name=name)


def _where(info: HoldInfo) -> str:
    where = info.worker or info.host
    if where and info.pid is not None:
        return f"{where} pid {info.pid}"
    return where or "-"


def _holds(holds: Holds, params: Mapping[str, str], semaphores: bool
           ) -> list[HoldInfo]:
    infos = [i for i in holds()
             if (i.limit is not None) == semaphores and _matches(i, params)]
    infos.sort(key=lambda i: i.key)
    return infos


def locks_view(target: Target, params: Mapping[str, str], holds: Holds) -> View:
    """The held locks (a semaphore's slots are on their own page)."""
    infos = _holds(holds, params, semaphores=False)
    shown, nav = _page_of(infos, params, "locks")
    waiting = target.backend().waiting(target.prefix, [i.key for i in shown])
    with_args = any(i.extra.get("args") for i in shown)
    headers = ["name", *(["args"] if with_args else []), "task", "task id", "worker",
               "age", "ttl left", "fence", "depth", "waiters"]
    rows = [[_lock_link(i.key), *([esc(i.extra.get("args"))] if with_args else []),
             esc(i.task_name), esc(i.task_id), esc(_where(i)),
             esc(duration_text(i.held_for)), esc(duration_text(i.ttl)), esc(i.fence),
             esc(i.count), esc(waiting.get(i.key, 0))] for i in shown]
    body = nav + table(headers, rows, numeric=("age", "ttl left", "fence", "depth",
                                                "waiters"))
    return View("Held locks", _filter_form("locks", params), body)


def semaphores_view(target: Target, params: Mapping[str, str], holds: Holds
                    ) -> View:
    """The semaphores (``lock_limit`` > 1): slots used of the limit, and who holds
    them."""
    infos = _holds(holds, params, semaphores=True)
    shown, nav = _page_of(infos, params, "semaphores")
    waiting = target.backend().waiting(target.prefix, [i.key for i in shown])
    rows = [[_lock_link(i.key), esc(i.slots),
             "<br>".join(esc(f"{h.describe()}, fence {text_of(h.fence)}, "
                             f"ttl {duration_text(h.ttl)}") for h in i.holders),
             esc(waiting.get(i.key, 0))] for i in shown]
    body = nav + table(["name", "slots used/limit", "holders", "waiters"], rows,
                       numeric=("slots used/limit", "waiters"))
    return View("Semaphores", _filter_form("semaphores", params), body)


def queued_view(target: Target, params: Mapping[str, str]) -> View:
    """The queue markers (calls sent with an enqueue-time ``lock_mode``, not yet
    started)."""
    queued = target.queued() or {}
    name, task = params.get("name", ""), params.get("task", "")
    items = sorted((k, v) for k, v in queued.items()
                   if k.startswith(name) and task in v[0])
    shown, nav = _page_of(items, params, "queued")
    rows = [[_lock_link(k), esc(task_id),
             esc("no expiry" if left is None else duration_text(left))]
            for k, (task_id, left) in shown]
    body = nav + table(["name", "queued task id", "ttl left"], rows,
                       numeric=("ttl left",))
    return View("Queued calls", _filter_form("queued", params), body)


def rates_view(target: Target, params: Mapping[str, str]) -> View:
    """The names with a ``lock_rate`` state: calls that may start now of the burst,
    when the next slot is free, the interval."""
    name = params.get("name", "")
    items = sorted((k, s) for k, s in rate_states(target.backend(), target.prefix)
                   .items() if k.startswith(name))
    shown, nav = _page_of(items, params, "rates")
    rows = [[_lock_link(k), esc(f"{s.available}/{s.burst}"), esc(f"{s.next_in:.2f}s"),
             esc(f"{s.interval:.3f}s")] for k, s in shown]
    body = nav + table(["name", "may start now", "next slot in", "window"], rows,
                       numeric=("may start now", "next slot in", "window"))
    return View("Rates", _filter_form("rates", params), body)


def history(target: Target) -> tuple[list[Event], str | None]:
    """The recorded events, newest first, and a note on what is missing: none kept by
    this backend, or (as ``top`` says) nothing recorded without
    ``dlock_record_events`` (releases by hand are recorded whatever it says)."""
    if target.client() is None:
        return [], (f"The {target.backend().kind} backend keeps no event history yet "
                    "(docs/backends.md).")
    events = recent_events(target.client(), target.prefix, EVENTS_MAX)
    if not recording_enabled(target.app):
        return events, ("Contention is not recorded: set app.conf.dlock_record_events "
                        "= True for the workers to keep a history (releases by hand are "
                        "recorded anyway).")
    return events, None


def event_rows(events: Iterable[Event]) -> list[list[str]]:
    """Events as table rows: when, what, which lock, by whom, held by, detail."""
    rows = []
    for e in events:
        who = (e.worker if e.kind == "released"
               else f"{e.task_name or '?'}[{e.task_id or '?'}]"
               + (f" on {e.worker}" if e.worker else ""))
        held = ""
        if e.holder_task_name or e.holder_task_id:
            held = f"{e.holder_task_name or '?'}[{e.holder_task_id or '?'}]"
        if e.holder_worker:
            held += f" on {e.holder_worker}"
        rows.append([esc(time.strftime("%H:%M:%S", time.localtime(e.at))), esc(e.kind),
                     _lock_link(e.key), esc(who), esc(held or None),
                     esc(e.policy), esc(e.detail)])
    return rows


EVENT_HEADERS = ["at", "event", "name", "by", "held by", "policy", "detail / reason"]


def events_table(events: Iterable[Event]) -> str:
    return table(EVENT_HEADERS, event_rows(events), nowrap=("at", "event", "policy"))


def summary_view(target: Target, params: Mapping[str, str],
                 tabs: Callable[[], Mapping[str, int | None]]) -> View:
    """Counts, the events per minute of the last hour, the newest events."""
    counts = tabs()
    facts = "".join(f"<li>{esc(label)}: <b>{esc(n)}</b></li>"
                    for label, n in counts.items() if n is not None)
    body = f"<ul class=facts>{facts}</ul>"
    events, note = history(target)
    if note is not None:
        body += f"<p class=none>{esc(note)}</p>"
    if target.client() is None:
        return View("Summary", "", body)
    per_minute = minute_counts(target.client(), target.prefix, time.time(), MINUTES)
    body += "<h2>Events per minute, last hour</h2>" + svg_chart(per_minute)
    body += "<h2>Newest events</h2>" + events_table(events[:50])
    return View("Summary", "", body)


def summary_counts(target: Target, holds: Holds, has_markers: bool, has_rates: bool
                   ) -> dict[str, int | None]:
    """How many locks, semaphores, queued calls and rates there are now."""
    infos = holds()
    semaphores = sum(1 for i in infos if i.limit is not None)
    queued = len(target.queued() or {}) if has_markers else None
    rates = len(rate_states(target.backend(), target.prefix)) if has_rates else None
    return {"held locks": len(infos) - semaphores, "semaphores": semaphores,
            "queued calls": queued, "names with a rate": rates}

