"""The demo command, end to end: its own redis-server, real prefork workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_runs_to_the_end_and_the_lock_sells_exactly_the_stock() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "celery_dlock", "demo", "--workers", "1",
         "--concurrency", "2", "--stock", "20", "--buyers", "60"],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Starting an embedded redis-server" in out
    assert "With LockedTask exactly 20 units were sold, 0 left." in out
    assert "over-sold by" in out


def test_cli_usage_and_unknown_command() -> None:
    ok = subprocess.run([sys.executable, "-m", "celery_dlock", "--help"],
                        capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0 and "demo" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "celery_dlock", "nope"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "unknown command" in bad.stderr
