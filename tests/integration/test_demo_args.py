"""The demo command refuses what it cannot do, in one line, before starting anything."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


Run = subprocess.CompletedProcess[str]


def _demo(*args: str, timeout: float = 60) -> tuple[Run, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "celery_dlock", "demo", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          check=False)
    return proc, time.monotonic() - started


def test_unreachable_redis_is_one_masked_line_and_a_quick_failure() -> None:
    proc, took = _demo("--redis-url", "redis://:s3cret-pw@127.0.0.1:1/0", timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert took < 15, f"took {took:.1f}s: {out}"
    assert "s3cret-pw" not in out
    assert "Traceback" not in out, out
    assert "redis://:**@127.0.0.1:1/0" in proc.stderr, out
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Starting" not in proc.stdout, out  # no worker was started


@pytest.mark.parametrize(("args", "option"), [
    (("--workers", "0"), "--workers"),
    (("--workers", "-3"), "--workers"),
    (("--concurrency", "0"), "--concurrency"),
    (("--buyers", "0"), "--buyers"),
    (("--stock", "0"), "--stock"),
    (("--stock", "-1"), "--stock"),
    (("--workers", "1000"), "--workers"),
])
def test_nonsense_numbers_are_refused_up_front(args: tuple[str, ...],
                                               option: str) -> None:
    proc, took = _demo(*args, "--redis-url", "redis://127.0.0.1:1/0", timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert took < 15
    assert option in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stdout == ""
