"""docs/backends.md's "Quickstart without Redis", run as written: RabbitMQ as the
broker, PostgreSQL as the lock store, no Redis anywhere; a real ``celery worker``, the
same invoice sent twice (the second waits for the first), ``celery dlock ls`` while one
runs."""

from __future__ import annotations

import ast
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import doc_snippets as docs
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def rabbitmq() -> Iterator[Any]:
    from rabbitmq_server import RabbitServer, Unavailable

    try:
        server = RabbitServer().start()
    except Unavailable as exc:
        pytest.skip(f"no RabbitMQ node: {exc}")
    try:
        yield server
    finally:
        server.stop()


def test_the_rabbitmq_and_postgresql_quickstart_runs_as_written(
        rabbitmq: Any, postgres_server: Any, tmp_path: Path) -> None:
    section = docs.section("docs/backends.md",
                           "Quickstart without Redis: RabbitMQ and PostgreSQL")
    (tasks_py,) = docs.blocks(section, "python")
    broker = "amqp://guest:guest@localhost:5672//"
    store = "postgresql://app:secret@localhost:5432/app"
    assert broker in tasks_py and store in tasks_py and "redis" not in tasks_py
    (tmp_path / "tasks.py").write_text(
        tasks_py.replace(broker, rabbitmq.url).replace(store, postgres_server.url),
        encoding="utf-8")
    (shell,) = docs.blocks(section, "sh")
    start, call = docs.commands(shell)
    with docs.worker(start, tmp_path):
        sent = subprocess.Popen(
            call, cwd=tmp_path, env=docs.env_for(tmp_path), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # While the first invoice runs, celery dlock ls lists it with its holder.
        deadline = time.monotonic() + 30
        while "invoice:9" not in (listed := docs.run(
                ["celery", "-A", "tasks", "dlock", "ls"], tmp_path)).stdout:
            assert time.monotonic() < deadline, listed.stdout + listed.stderr
            time.sleep(0.2)
        out, err = sent.communicate(timeout=60)
        assert sent.returncode == 0, err
    first, second = (ast.literal_eval(line) for line in out.strip().splitlines())
    # one after the other, never together, the second with a higher fence
    assert first[1] <= second[0] or second[1] <= first[0], (first, second)
    assert (first[2] < second[2]) == (first[0] < second[0])
