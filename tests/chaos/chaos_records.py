"""Records of a chaos run: JSON lines, one file per process, each line written with a
single ``write(2)`` on an ``O_APPEND`` file, so a line survives the process being
killed right after it and lines of one file never interleave."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Recorder:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, ev: str, **fields: Any) -> None:
        fields.setdefault("t", time.time())
        line = json.dumps({"ev": ev, "pid": os.getpid(), **fields}) + "\n"
        os.write(self._fd, line.encode())


def read_all(directory: Path) -> Iterator[dict[str, Any]]:
    """Every record of every file in ``directory`` (a torn last line is skipped)."""
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            rec["file"] = path.name
            yield rec


def hold_of(rec: dict[str, Any]) -> tuple[int, Any]:
    """The hold a record is about: (process, its acquisition number); records without
    one (older runs) fall back to the fence."""
    return rec["pid"], rec.get("acq", rec.get("fence"))


class Tail:
    """Follows the records files as they grow: which holds are open right now."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: dict[Path, int] = {}
        self.open: dict[tuple[int, Any], float] = {}

    def read(self) -> None:
        for path in self.directory.glob("*.jsonl"):
            offset = self.offsets.get(path, 0)
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
            complete = data.rfind(b"\n") + 1
            self.offsets[path] = offset + complete
            for line in data[:complete].splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                key = hold_of(rec)
                if rec["ev"] == "acquired":
                    self.open[key] = rec["t"]
                elif rec["ev"] in ("releasing", "released", "lost"):
                    self.open.pop(key, None)

    def newest_open(self, since: float) -> int | None:
        fresh = [(t, k[0]) for k, t in self.open.items()
                 if t >= since and Path(f"/proc/{k[0]}").exists()]
        return max(fresh)[1] if fresh else None


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The records of one file (a torn last line is skipped)."""
    recs = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            recs.append(json.loads(line))
    return recs
