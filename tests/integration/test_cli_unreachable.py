"""Every ``celery dlock`` sub-command against a Redis nobody answers: one masked line."""

from __future__ import annotations

import time

import cli_app
import pytest

URL = "redis://:s3cret-pw@127.0.0.1:1/0"

SUB_COMMANDS = [
    ("ls",),
    ("ls", "--json"),
    ("show", "some:key"),
    ("show", "some:key", "--json"),
    ("release", "some:key"),
    ("release", "some:key", "--force"),
    ("top", "--iterations", "1", "--interval", "0.1"),
]


@pytest.mark.parametrize("args", SUB_COMMANDS, ids=" ".join)
def test_unreachable_redis_is_one_masked_line_quickly(args: tuple[str, ...]) -> None:
    started = time.monotonic()
    proc = cli_app.run_cli(URL, "dlunreach", *args, timeout=120)
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "s3cret-pw" not in out
    assert "Traceback" not in out, out
    assert "redis://:**@127.0.0.1:1/0" in proc.stderr, out
    assert len(proc.stderr.strip().splitlines()) == 1, out
    assert took < 20, f"took {took:.1f}s: {out}"
