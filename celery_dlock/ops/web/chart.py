"""The summary's chart: events per minute over the last hour, as server-side SVG.

The counts are those the workers keep per minute when the app records events
(``dlock_record_events``, see :mod:`celery_dlock.task.event_counts`): one series per
kind (``acquired``, ``contended``, ``duplicate``, ``parked``, ``lost``, ``released`` by
hand), every event of the hour counted (the history list keeps only the newest).
"""

from __future__ import annotations

import html
from collections.abc import Sequence

__all__ = ["MINUTES", "SERIES", "svg_chart"]

#: Minutes shown.
MINUTES = 60
#: The kinds of event charted, each with its colour.
SERIES = (("acquired", "#607d8b"), ("contended", "#ef6c00"), ("duplicate", "#6a1b9a"),
          ("parked", "#2e7d32"), ("lost", "#c62828"), ("released", "#1565c0"))


def svg_chart(counts: dict[str, list[int]], width: int = 720, height: int = 200
              ) -> str:
    """A line per kind of event over the minutes of ``counts``, with axes, a legend
    and each point's count in a tooltip."""
    left, right, top, bottom = 36, 10, 26, 24
    inner_w, inner_h = width - left - right, height - top - bottom
    n = max((len(v) for v in counts.values()), default=MINUTES)
    peak = max([1, *(max(v, default=0) for v in counts.values())])
    step = inner_w / max(1, n - 1)

    def x(i: int) -> float:
        return left + i * step

    def y(v: int) -> float:
        return top + inner_h - v * inner_h / peak

    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
             'aria-label="events per minute over the last hour">',
             f'<line x1="{left}" y1="{top + inner_h}" x2="{width - right}" '
             f'y2="{top + inner_h}" stroke="#999"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + inner_h}" '
             'stroke="#999"/>',
             f'<text x="{left - 4}" y="{top + 10}" font-size="11" '
             f'text-anchor="end">{peak}</text>',
             f'<text x="{left - 4}" y="{top + inner_h}" font-size="11" '
             'text-anchor="end">0</text>']
    for i in range(0, n, 10):
        label = f"-{n - i}m"
        parts.append(f'<text x="{x(i):.1f}" y="{height - 6}" font-size="11" '
                     f'text-anchor="middle">{label}</text>')
    parts.append(f'<text x="{x(n - 1):.1f}" y="{height - 6}" font-size="11" '
                 'text-anchor="end">now</text>')
    for k, (kind, colour) in enumerate(SERIES):
        values: Sequence[int] = counts.get(kind, [])
        if values:
            points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values))
            parts.append(f'<polyline class="s-{kind}" fill="none" stroke="{colour}" '
                         f'stroke-width="2" points="{points}"/>')
            for i, v in enumerate(values):
                if v:
                    parts.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="2.5" '
                                 f'fill="{colour}"><title>{html.escape(kind)}: {v} '
                                 f'at -{n - i}m</title></circle>')
        total = sum(values)
        parts.append(f'<rect x="{left + 8 + k * 112}" y="6" width="10" '
                     f'height="10" fill="{colour}"/><text x="{left + 22 + k * 112}" '
                     f'y="15" font-size="11">{html.escape(kind)} ({total})'
                     '</text>')
    parts.append("</svg>")
    return "".join(parts)
