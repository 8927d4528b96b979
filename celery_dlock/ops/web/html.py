"""HTML for the operators' page: escaping, the page frame, tables, and the few lines of
inline CSS and JavaScript it ships (nothing is loaded from elsewhere).

Everything read from a store (lock names, task names, arguments, reasons) goes through
:func:`esc`: control characters are written as Python escapes (``\\x1b``), characters
that are not text (a name's non-UTF-8 bytes kept as surrogates) as ``\\udcff``, and
``<``, ``>``, ``&`` and quotes as entities, so such data shows as text and never runs.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from urllib.parse import quote, unquote

from ..formatting import printable

__all__ = ["CSS", "REFRESH_JS", "attr", "esc", "link", "page", "query", "quoted",
           "table", "text_of", "unquoted"]


def text_of(value: object) -> str:
    """``value`` as one line of plain text: None as ``-``, control characters and
    non-text code points escaped."""
    if value is None or value == "":
        return "-"
    text = printable(str(value))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def esc(value: object) -> str:
    """``value`` as HTML text (see the module's docstring)."""
    return html.escape(text_of(value), quote=True)


def attr(value: object) -> str:
    """``value`` as the text of an attribute (a form field's value): empty stays
    empty."""
    return "" if value is None or value == "" else esc(value)


def quoted(name: str) -> str:
    """``name`` percent-encoded, its surrogates (bytes that are not UTF-8) as those
    bytes: a form carries any name exactly (control characters included), and
    :func:`unquoted` gives it back."""
    return quote(name.encode("utf-8", "surrogateescape"), safe="")


def unquoted(text: str) -> str:
    return unquote(text, errors="surrogateescape")


def query(**params: object) -> str:
    """A query string; a name's surrogates (its non-UTF-8 bytes) are sent as those
    bytes, so the name read back is the name given."""
    pairs = []
    for key, value in params.items():
        if value is None or value == "":
            continue
        pairs.append(f"{quote(key)}={quoted(str(value))}")
    return "&".join(pairs)


def link(path: str, label: object, **params: object) -> str:
    """An ``<a>`` to ``path`` with ``params``."""
    qs = query(**params)
    href = f"{path}?{qs}" if qs else path
    return f'<a href="{html.escape(href, quote=True)}">{esc(label)}</a>'


def table(headers: Sequence[str], rows: Iterable[Sequence[str]],
          numeric: Iterable[str] = (), nowrap: Iterable[str] = ()) -> str:
    """A table; ``rows`` hold HTML already escaped (``esc``, ``link``); the
    ``numeric`` columns right-aligned, those and the ``nowrap`` ones never wrapped."""
    right, keep = set(numeric), set(nowrap)

    def cls(h: str) -> str:
        return " class=n" if h in right else " class=w" if h in keep else ""

    head = "".join(f"<th{cls(h)}>{html.escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = "".join(f"<td{cls(h)}>{cell}</td>"
                        for h, cell in zip(headers, row, strict=True))
        body.append(f"<tr>{cells}</tr>")
    if not body:
        return f"<table><tr>{head}</tr></table><p class=none>Nothing here.</p>"
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:8px 16px}
header a{color:#cfd8dc;margin-right:14px;text-decoration:none}
header a.on{color:#fff;font-weight:bold;border-bottom:2px solid #80cbc4}
header .where{float:right;color:#b0bec5}
main{padding:12px 16px}
table{border-collapse:collapse;background:#fff;margin:8px 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top;
 max-width:40em;overflow-wrap:anywhere}
th{background:#eceff1;white-space:nowrap}td.n,th.n{text-align:right}
td.n,td.w{white-space:nowrap}
.ro{background:#fff3e0;border:1px solid #ffb74d;padding:6px 10px;margin:8px 0}
.ok{background:#e8f5e9;border:1px solid #81c784;padding:6px 10px}
.err{background:#ffebee;border:1px solid #e57373;padding:6px 10px}
.none{color:#777}form.filter input{margin-right:8px}
button.danger{background:#c62828;color:#fff;border:0;padding:6px 14px}
.chart{background:#fff;border:1px solid #ddd}
"""

#: Auto-refresh: every few seconds, fetch the page's ``#live`` part again and swap it
#: in (the header, a filter being typed and the scroll position stay).
REFRESH_JS = """
(function(){var live=document.getElementById('live');if(!live)return;
var every=(+live.getAttribute('data-refresh')||5)*1000;
function tick(){var u=new URL(location.href);u.searchParams.set('fragment','1');
fetch(u,{credentials:'same-origin'}).then(function(r){
if(r.ok)return r.text();throw r.status}).then(function(t){live.innerHTML=t;
live.removeAttribute('data-stale')}).catch(function(){
live.setAttribute('data-stale','1')}).finally(function(){setTimeout(tick,every)})}
setTimeout(tick,every)})();
"""


def page(title: str, tabs: Sequence[tuple[str, str]], current: str, where: str,
         body: str, *, head: str = "", live: bool = True, refresh: float = 5.0,
         notice: str = "") -> str:
    """A whole page: a header of tabs (path, label), ``notice``, the title,
    ``head`` (HTML that stays: a filter form) and ``body`` (inside ``#live``,
    refreshed in place, when ``live``)."""
    nav = "".join(f'<a href="{html.escape(path)}"'
                  f'{" class=on" if path == current else ""}>{html.escape(label)}</a>'
                  for path, label in tabs)
    main = (f'<div id="live" data-refresh="{refresh:g}">{body}</div>' if live
            else body)
    script = f"<script>{REFRESH_JS}</script>" if live else ""
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<title>{esc(title)} - celery dlock</title>"
            '<meta name="viewport" content="width=device-width">'
            f"<style>{CSS}</style></head><body><header>{nav}"
            f'<span class="where">{esc(where)}</span></header>'
            f"<main>{notice}<h1>{esc(title)}</h1>{head}{main}</main>{script}</body></html>")
