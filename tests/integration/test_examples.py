"""The examples run as their users run them, and docker-compose.yml holds together.

Each example is one command (``python examples/NAME.py`` from the repository root) that
starts its own redis-server and real ``celery`` processes, and exits 0 only when the
property it demonstrates held; these tests run exactly that and look for its verdict.

No Docker engine runs here, so docker-compose.yml is checked by reading it: the
services exist, the workers are replicated, every command names a module or file of
this repository, and everything talks to the ``redis`` service.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import compose_file
import pytest

REPO = Path(__file__).resolve().parents[2]

#: script -> lines (or patterns) its output must contain.
EXAMPLES = {
    "inventory.py": ["sold 40, left 0", "OK: exactly 40 units sold with the lock",
                     re.compile(r"the stock row was last written with fence \d{16} ")],
    "once_per_period.py": ["OK: every period ran exactly once", "sent by all 2 beats"],
    "long_task_fencing.py": [re.compile(r"late write with fence \d+: REFUSED"),
                             "ensure_held(): LockLost",
                             "OK: the stale holder's write was refused by its fence"],
    "nested_reentry.py": ["RedisLock in audit's body", "hold count 3",
                          "OK: nested calls re-entered (1, 2, 3); the redelivery was "
                          "refused"],
}


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_and_holds(script: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "REPORT_INTERVAL", "REPORT_WORK")}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(Path("examples") / script)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    took = time.monotonic() - started
    output = f"exit {proc.returncode} after {took:.1f}s\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, output
    for line in EXAMPLES[script]:
        if isinstance(line, re.Pattern):
            assert line.search(proc.stdout), output
        else:
            assert line in proc.stdout, output


# -- docker-compose.yml ---------------------------------------------------------------


def _argv(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _referenced_paths(argv: list[str]) -> list[Path]:
    """The repository files a command runs: ``-A``/``--app``/``-m`` modules, scripts."""
    found = []
    for i, arg in enumerate(argv):
        module = None
        if arg in ("-A", "--app", "-m") and i + 1 < len(argv):
            module = argv[i + 1]
        elif arg.startswith("--app="):
            module = arg.split("=", 1)[1]
        if module:
            module = module.split(":", 1)[0]
            base = REPO.joinpath(*module.split("."))
            found.append(base.with_suffix(".py") if not base.is_dir()
                         else base / "__init__.py")
        elif arg.endswith(".py"):
            found.append(REPO / arg)
    return found


def test_compose_has_the_services() -> None:
    services = compose_file.services()
    assert {"redis", "worker", "beat", "producer", "flower"} <= set(services)
    assert services["redis"]["image"] == "redis:7-alpine"
    worker = services["worker"]
    replicas = (worker.get("deploy") or {}).get("replicas", worker.get("scale"))
    assert replicas == 2
    assert "worker" in _argv(services["worker"]["command"])
    assert "beat" in _argv(services["beat"]["command"])
    assert "produce" in _argv(services["producer"]["command"])
    assert "flower" in _argv(services["flower"]["command"])


def test_compose_commands_name_files_of_the_repo() -> None:
    services = compose_file.services()
    built = services["worker"].get("image")  # the one image, built by the worker
    for name, service in services.items():
        if name == "redis":
            continue
        build = service.get("build")
        if build is None:
            assert service.get("image") == built, f"{name} does not run the app image"
            continue
        context = build.get("context", ".") if isinstance(build, dict) else build
        assert context == ".", f"{name} is not built from the repository"
        paths = _referenced_paths(_argv(service["command"]))
        assert paths, f"{name}: its command names no module or file of the repo"
        for path in paths:
            assert path.is_file(), f"{name}: {path.relative_to(REPO)} does not exist"
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "FROM python:3.12-slim" in dockerfile
    assert "flower" in dockerfile


def test_compose_services_use_the_redis_service() -> None:
    services = compose_file.services()
    for name, service in services.items():
        if name == "redis":
            continue
        url = urlparse(compose_file.environment(service).get("REDIS_URL", ""))
        assert url.scheme == "redis" and url.hostname == "redis", name
        assert "redis" in (service.get("depends_on") or {}), name


def test_compose_workers_run_what_beat_and_producer_send() -> None:
    """The workers load one app module; its app must include the beat's tasks."""
    namespace = runpy.run_path(str(REPO / "examples" / "celery_app.py"))
    included = set(namespace["app"].conf.include)
    services = compose_file.services()
    for name in ("beat", "producer"):
        argv = _argv(services[name]["command"])
        module = argv[argv.index("-A" if "-A" in argv else "-m") + 1]
        assert module in included, f"the workers do not load {module} ({name})"
    worker_argv = _argv(services["worker"]["command"])
    assert worker_argv[worker_argv.index("-A") + 1] in included
