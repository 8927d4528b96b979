"""The README's "Your own app in five minutes", run as a reader runs it: its ``tasks.py``
(with the test's own Redis for ``localhost``, and a 10 s report for a 20 s one), a real
``celery worker``, the duplicate call, ``celery dlock ls`` and ``release``."""

from __future__ import annotations

import re
import time
from pathlib import Path

import doc_snippets as docs
import pytest

from celery_dlock.ops.embedded import EmbeddedRedis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_the_readme_app_runs_the_report_once_and_the_cli_sees_and_frees_it(
        own_server: EmbeddedRedis, tmp_path: Path) -> None:
    section = docs.section("README.md", "Your own app in five minutes")
    (tasks_py,) = docs.blocks(section, "python")
    assert "time.sleep(20)" in tasks_py and "redis://localhost:6379/0" in tasks_py
    (tmp_path / "tasks.py").write_text(
        tasks_py.replace("redis://localhost:6379/0", own_server.url)
        .replace("time.sleep(20)", "time.sleep(10)"), encoding="utf-8")
    shell = docs.blocks(section, "sh")
    start, call = docs.commands(shell[0])
    ls, release = docs.commands(shell[1])
    with docs.worker(start, tmp_path) as log:
        called = docs.run(call, tmp_path)
        assert called.returncode == 0, called.stderr
        first, second = called.stdout.split()
        assert first == second  # the second call is a duplicate of the first
        # the one run holds the lock while it builds the report
        deadline = time.monotonic() + 20
        while "report:2026-11-27" not in (listed := docs.run(ls, tmp_path)).stdout:
            assert time.monotonic() < deadline, listed.stdout + listed.stderr
            time.sleep(0.2)
        assert first in listed.stdout
        freed = docs.run(release, tmp_path, stdin="y\n")
        assert freed.returncode == 0, freed.stdout + freed.stderr
        after = docs.run(ls, tmp_path)
        assert "report:2026-11-27" not in after.stdout, after.stdout
    worker_log = log.read_text()
    assert len(re.findall(r"Task tasks\.build_report\[\S+\] received", worker_log)) == 1
    # the released run is told: it fails with LockLost instead of finishing unlocked
    assert "LockLost" in worker_log
