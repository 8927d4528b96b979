"""Text layout for ``celery dlock``: durations, cells, aligned tables that fit a width."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core.holds import HoldInfo

__all__ = ["QUEUED_FIELDS", "cell_text", "duration_text", "fit_widths", "holder_text",
           "printable", "queued_text", "row_cells", "slot_text", "table_lines",
           "value_cells", "with_slots"]

#: What ``celery dlock ls`` adds to a lock name with a queue marker (an enqueue-time
#: ``lock_mode``): the queued call's task id and the marker's seconds left.
QUEUED_FIELDS = ("queued_task_id", "queued_ttl")
_DURATIONS = {"ttl", "held_for", "queued_ttl"}


def duration_text(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 60:
        return f"{value:.1f}s"
    whole = int(value)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def printable(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1: ESC, BEL, BS, CR, LF, ...)
    escaped as Python would (``\\x1b``, ``\\n``), so that nothing read from a server
    can move the cursor, ring, or forge a line of a table on the operator's terminal."""
    if text.isprintable():
        return text
    return "".join(ch.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(ch) == "Cc" else ch for ch in text)


def cell_text(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


_NUMERIC = {"pid", "count", "fence", "ttl", "held_for", "waiting", "queued_ttl"}
#: The one number that may be cut when nothing else can give: a fence keeps its last
#: digits (which tell holds apart), at least this many, behind a "~".
_FENCE_DIGITS_KEPT = 7


def table_lines(columns: Sequence[str], rows: Iterable[Sequence[str]],
                widths: dict[str, int] | None = None, gap: int = 2) -> list[str]:
    """Aligned text columns; numbers right-aligned; ``widths`` caps (and cuts) some."""
    cut = [list(row) for row in rows]
    if widths:
        for row in cut:
            for i, name in enumerate(columns):
                cap = widths.get(name)
                if cap and len(row[i]) > cap:
                    row[i] = ("~" + row[i][-(cap - 1):] if name == "fence"
                              else row[i][:cap - 1] + "~")
    sizes = [len(name) for name in columns]
    for row in cut:
        sizes = [max(size, len(cell)) for size, cell in zip(sizes, row, strict=True)]
    lines = []
    for row in [[name.upper() for name in columns], *cut]:
        cells = [cell.rjust(size) if name in _NUMERIC else cell.ljust(size)
                 for name, cell, size in zip(columns, row, sizes, strict=True)]
        lines.append((" " * gap).join(cells).rstrip())
    return lines


def fit_widths(columns: Sequence[str], rows: Sequence[Sequence[str]],
               caps: dict[str, int], width: int, gap: int) -> dict[str, int]:
    """Caps for the text columns so a row fits ``width``: the widest text is cut
    first, down to its header; then the fence keeps only its last digits; other
    numbers are never cut."""
    sizes = {name: max([len(name)] + [len(row[i]) for row in rows])
             for i, name in enumerate(columns)}
    sizes = {name: min(size, caps.get(name, size)) for name, size in sizes.items()}
    budget = width - gap * (len(columns) - 1)
    text = [name for name in columns if name not in _NUMERIC]
    while sum(sizes.values()) > budget:
        widest = max(text, key=lambda name: sizes[name] - len(name))
        if sizes[widest] <= max(len(widest), 4):
            break
        sizes[widest] -= 1
    fence_floor = max(len("fence"), _FENCE_DIGITS_KEPT + 1)
    if "fence" in sizes and sum(sizes.values()) > budget and sizes["fence"] > fence_floor:
        over = sum(sizes.values()) - budget
        sizes["fence"] = max(fence_floor, sizes["fence"] - over)
        text.append("fence")
    return {name: sizes[name] for name in text}


def row_cells(info: HoldInfo, columns: Sequence[str], extra: dict[str, Any] | None = None
         ) -> list[str]:
    return value_cells({**info.as_dict(), **(extra or {})}, columns)


def value_cells(values: Mapping[str, Any], columns: Sequence[str]) -> list[str]:
    """One table row from field values: durations as durations, None as ``-``."""
    return [duration_text(values.get(name)) if name in _DURATIONS
            else cell_text(values.get(name)) for name in columns]


def queued_text(task_id: str, left: float | None) -> str:
    """A queue marker in a line: its task id and time left."""
    return f"{task_id} ({'no expiry' if left is None else f'ttl {left:.3f}s'})"


def holder_text(info: HoldInfo) -> str:
    if info.task_name or info.task_id:
        return (f"task {info.task_name or '?'}[{info.task_id or '?'}], "
                f"owner {info.owner}, fence {cell_text(info.fence)}")
    return f"owner {info.owner}, fence {cell_text(info.fence)}"


def with_slots(columns: Sequence[str], infos: Iterable[HoldInfo]) -> tuple[str, ...]:
    """``columns`` with ``slots`` (a semaphore's used/limit) after ``key`` when any
    of ``infos`` is a semaphore."""
    if not any(i.limit is not None for i in infos):
        return tuple(columns)
    out = list(columns)
    out.insert(out.index("key") + 1 if "key" in out else 0, "slots")
    return tuple(out)


def slot_text(info: HoldInfo) -> str:
    """One holder of a semaphore in a line: who, fence, ttl left, held for."""
    return (f"{info.describe()}, owner {info.owner}, fence {cell_text(info.fence)}, "
            f"ttl {duration_text(info.ttl)}, held for {duration_text(info.held_for)}")
