"""Records of a chaos run: JSON lines, one file per process, each line written with a
single ``write(2)`` on an ``O_APPEND`` file, so a line survives the process being
killed right after it and lines of one file never interleave."""

from __future__ import annotations

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
