"""Run the code a page of the docs shows, as its reader would: the fenced blocks of one
section, a real ``celery worker`` started with the page's own command, and the page's
commands run against it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def section(page: str, heading: str) -> str:
    """The text of ``page`` (relative to the repository) under ``## heading``."""
    text = (REPO / page).read_text(encoding="utf-8")
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of ``language`` in ``text``."""
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[list[str]]:
    """A shell block's commands, one a line, without their ``#`` comments."""
    return [shlex.split(line.split("  #")[0]) for line in block.strip().splitlines()]


def env_for(folder: Path) -> dict[str, str]:
    """The environment the reader's shell has: this venv's commands first, and the
    folder with their ``tasks.py`` importable."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(folder)}


def run(argv: list[str], folder: Path, stdin: str = "",
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=folder, env=env_for(folder), input=stdin,
                          capture_output=True, text=True, timeout=timeout, check=False)


@contextmanager
def worker(argv: list[str], folder: Path, start_timeout: float = 60) -> Iterator[Path]:
    """A ``celery worker`` started with ``argv`` in ``folder``, ready; its log's path.
    Stopped (warm, then killed) when the block ends."""
    log_path = folder / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=folder, env=env_for(folder), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + start_timeout
            while b"ready." not in log_path.read_bytes():
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "the worker did not start"
                time.sleep(0.2)
            yield log_path
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
