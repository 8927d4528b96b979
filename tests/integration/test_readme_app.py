"""The README's "Your own app in five minutes", run as a reader runs it: its ``tasks.py``
(with the test's own Redis for ``localhost``, and a 4 s report for a 20 s one), a real
``celery worker``, the duplicate call, ``celery dlock ls`` and ``release``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from celery_dlock.ops.embedded import EmbeddedRedis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _section() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("## Your own app in five minutes")
    return text[start:text.index("\n## ", start + 1)]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def _run(argv: list[str], cwd: Path, env: dict[str, str], stdin: str = "",
         timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, input=stdin, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_the_readme_app_runs_the_report_once_and_the_cli_sees_and_frees_it(
        own_server: EmbeddedRedis, tmp_path: Path) -> None:
    section = _section()
    (tasks_py,) = _blocks(section, "python")
    assert "time.sleep(20)" in tasks_py and "redis://localhost:6379/0" in tasks_py
    (tmp_path / "tasks.py").write_text(
        tasks_py.replace("redis://localhost:6379/0", own_server.url)
        .replace("time.sleep(20)", "time.sleep(4)"), encoding="utf-8")
    start, call = _blocks(section, "sh")[0].strip().splitlines()
    ls, release = (line.split("#")[0].strip()
                   for line in _blocks(section, "sh")[1].strip().splitlines())
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(tmp_path)}
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(shlex.split(start), cwd=tmp_path, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while b"ready." not in (tmp_path / "worker.log").read_bytes():
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.2)
        called = _run(shlex.split(call), tmp_path, env)
        assert called.returncode == 0, called.stderr
        first, second = called.stdout.split()
        assert first == second  # the second call is a duplicate of the first
        # the one run holds the lock while it builds the report
        deadline = time.monotonic() + 20
        while "report:2026-11-27" not in (listed := _run(shlex.split(ls), tmp_path,
                                                         env)).stdout:
            assert time.monotonic() < deadline, listed.stdout + listed.stderr
            time.sleep(0.2)
        assert first in listed.stdout
        freed = _run(shlex.split(release), tmp_path, env, stdin="y\n")
        assert freed.returncode == 0, freed.stdout + freed.stderr
        after = _run(shlex.split(ls), tmp_path, env)
        assert "report:2026-11-27" not in after.stdout, after.stdout
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(timeout=10)
        log.close()
    worker_log = (tmp_path / "worker.log").read_text()
    assert len(re.findall(r"Task tasks\.build_report\[\S+\] received", worker_log)) == 1
    # the released run is told: it fails with LockLost instead of finishing unlocked
    assert "LockLost" in worker_log
