"""One lock's page, and releasing it.

The page shows what ``celery dlock show`` shows (every field of the hold, a
semaphore's holders, the queued call, the waiters, the rate, where the store keeps
it, the arguments of a hashed name) and the lock's recent history (contended, lost,
released by hand: the events ``top`` shows).

Releasing takes two steps: a confirmation that shows the hold to be freed (holder,
fence) and asks for the token and a reason, then a POST that frees exactly that hold
through :func:`~celery_dlock.ops.freeing.free_hold` (as ``celery dlock release``
does): a hold that changed in between is not freed.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...core.holds import HoldChanged, HoldInfo
from ..audit import operator
from ..formatting import duration_text, holder_text, queued_text
from ..freeing import free_hold
from ..rates import rate_state, rate_text
from ..target import Target
from .html import esc, link, quoted, table, unquoted
from .views import View, events_table, history

__all__ = ["confirm_view", "lock_view", "release"]


def _fields(info: HoldInfo) -> list[tuple[str, str]]:
    fields: list[tuple[str, str]] = []
    for name, value in info.as_dict().items():
        if name == "extra":
            fields += [(f"extra.{k}", esc(v)) for k, v in value.items()]
        elif name == "holders":
            fields += [(f"holder.{n}", esc(f"{h.describe()}, owner {h.owner}, fence "
                                          f"{h.fence}, ttl {duration_text(h.ttl)}"))
                       for n, h in enumerate(info.holders, 1)]
        elif name in ("ttl", "held_for"):
            fields.append((name, esc(duration_text(value))))
        else:
            fields.append((name, esc(value)))
    return fields


def _release_links(info: HoldInfo, writable: bool) -> str:
    if not writable:
        return ""
    holds = info.holders if info.limit is not None else (info,)
    links = [link("release", f"Release {h.describe()} (fence {h.fence})", name=info.key,
                  fence=h.fence) for h in holds]
    return "<p>" + "<br>".join(links) + "</p>"


def lock_view(target: Target, name: str, writable: bool) -> View:
    backend = target.backend()
    info = backend.read(target.prefix, name)
    fields: list[tuple[str, str]] = [] if info is not None else [
        ("key", esc(name)), ("held", "no")]
    if info is not None:
        fields += _fields(info)
        waiting = backend.waiting(target.prefix, [name]).get(name, 0)
        fields.append(("waiting", esc(waiting)))
    if target.markers() is not None:
        queued = target.queued_one(name)
        fields.append(("queued", esc(queued_text(*queued) if queued else None)))
    rate = rate_state(backend, target.prefix, name)
    if rate is not None:
        fields.append(("rate", esc(rate_text(rate))))
    fields.append(("stored at", esc(backend.storage_key(target.prefix, name))))
    body = table(["field", "value"], fields, nowrap=("field",))
    if info is not None:
        body += _release_links(info, writable)
    body += "<h2>History</h2>"
    events, note = history(target)
    if note is not None:
        body += f"<p class=none>{esc(note)}</p>"
    if target.client() is not None:
        body += events_table([e for e in events if e.key == name])
    return View(f"Lock {name}", "", body)


def _hold_of(info: HoldInfo, fence: int | None) -> HoldInfo | None:
    for hold in (info.holders if info.limit is not None else (info,)):
        if hold.fence == fence:
            return hold
    return None


def confirm_view(target: Target, name: str, fence: int | None, csrf: str) -> View:
    """What will be freed, and the form that frees it."""
    info = target.backend().read(target.prefix, name)
    hold = None if info is None else _hold_of(info, fence)
    if info is None or hold is None:
        back = link("lock", "Back to the lock", name=name)
        return View(f"Release {name}", "", "<p class=err>This hold is no longer there: "
                    f"{esc(name)} is {'free' if info is None else 'held by another'}. "
                    f"Nothing to release.</p><p>{back}</p>")
    body = (f"<p>This frees the hold of <b>{esc(name)}</b> by "
            f"<b>{esc(hold.describe())}</b>, held for {esc(duration_text(hold.held_for))}"
            f" (owner {esc(hold.owner)}, fence <b>{esc(hold.fence)}</b>).</p>"
            "<p>The task is not stopped: it goes on without its lock, and is told it "
            "lost it, with your reason. If the hold changes before you confirm, "
            "nothing is freed.</p>"
            '<form method="post" action="release">'
            f'<input type="hidden" name="csrf" value="{esc(csrf)}">'
            f'<input type="hidden" name="key" value="{esc(quoted(name))}">'
            f'<input type="hidden" name="fence" value="{esc(hold.fence)}">'
            '<p><label>Reason <input name="reason" size="60" maxlength="200" '
            'required></label></p>'
            '<p><label>Token <input name="token" type="password" required></label></p>'
            '<p><button class="danger" type="submit">Release this hold</button> '
            f"{link('lock', 'Cancel', name=name)}</p></form>")
    return View(f"Release {name}", "", body)


def release(target: Target, form: Mapping[str, str], remote: str) -> tuple[bool, str]:
    """Free the hold the confirmation showed; (freed, a message in HTML)."""
    name = unquoted(form.get("key", ""))
    try:
        fence = int(form.get("fence", ""))
    except ValueError:
        return False, "<p class=err>No fence given: nothing was released.</p>"
    reason = form.get("reason", "").strip() or None
    who = f"{operator()} with celery dlock web (from {remote or '?'})"
    try:
        freed = free_hold(target, name, fence=fence, by=who, reason=reason, who=who)
    except HoldChanged as exc:
        now = f": now {holder_text(exc.current)}" if exc.current else ""
        return False, (f"<p class=err>Lock {esc(name)} changed hands since it was "
                       f"shown{esc(now)}. Nothing was released.</p>")
    if freed is None:
        return False, f"<p class=err>{esc(name)} is not held: nothing released.</p>"
    hold = (freed.holders[0] if freed.limit is not None and freed.holders else freed)
    return True, (f"<p class=ok>Released {esc(name)}: {esc(holder_text(hold))}. "
                  f"Reason: {esc(reason or 'no reason given')}.</p>")
