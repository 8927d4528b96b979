"""Every ``celery dlock`` sub-command against a store nobody answers (Redis,
PostgreSQL, MySQL, ZooKeeper): one masked line that names the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import cli_app
import pytest
from config_app import ENV_CONF

REPO = Path(__file__).resolve().parents[2]

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


#: A store other than Redis nobody answers at, and the name the line must give it.
OTHER_STORES = [
    ("PostgreSQL", "postgresql://app:s3cret-pw@127.0.0.1:1/db",
     "postgresql://app:**@127.0.0.1:1/db"),
    ("MySQL", "mysql://app:s3cret-pw@127.0.0.1:1/db", "mysql://app:**@127.0.0.1:1/db"),
    ("ZooKeeper", "zookeeper://app:s3cret-pw@127.0.0.1:1/?connect_timeout=1",
     "zookeeper://app:**@127.0.0.1:1/?connect_timeout=1"),
]


def _dlock_at(url: str, *args: str, by_option: bool) -> subprocess.CompletedProcess[str]:
    """``celery -A config_app dlock ARGS`` with the app's ``dlock_url`` at ``url``, or
    (``by_option``) an app with none and ``--url URL``."""
    conf = {"broker_url": "memory://"} if by_option else {"dlock_url": url,
                                                          "broker_url": "memory://"}
    env = {**os.environ, ENV_CONF: json.dumps(conf),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    pre = ("--url", url) if by_option else ()
    return subprocess.run([sys.executable, "-m", "celery", "-A", "config_app", "dlock",
                           *pre, *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO, check=False)


@pytest.mark.parametrize(("store", "url", "shown"), OTHER_STORES,
                         ids=[s[0] for s in OTHER_STORES])
@pytest.mark.parametrize("args", [*SUB_COMMANDS, ("--url-option", "ls")],
                         ids=" ".join)
def test_an_unreachable_store_is_one_masked_line_naming_it(
        store: str, url: str, shown: str, args: tuple[str, ...]) -> None:
    """It said "cannot reach Redis at postgresql://...", and a ZooKeeper's line came
    after kazoo's own log lines."""
    pytest.importorskip({"PostgreSQL": "psycopg", "MySQL": "pymysql",
                         "ZooKeeper": "kazoo"}[store])
    by_option = args[0] == "--url-option"
    started = time.monotonic()
    proc = _dlock_at(url, *args[by_option:], by_option=by_option)
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "s3cret-pw" not in out and "Traceback" not in out, out
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"cannot reach {store} at {shown}"), out
    assert "Redis" not in line, out
    assert took < 30, f"took {took:.1f}s: {out}"
