"""A newcomer's first hour, scripted: the sdist installed into a fresh venv, then every
command of ``celery-dlock`` and ``celery dlock`` with good and bad input.

The module builds the sdist once (``python -m build --sdist``) from a copy of the files
git tracks, which is what a newcomer's clone has (never in the checkout, whose build tree
another test process may be using), makes a fresh venv with ``python3 -m venv`` and
installs ``<sdist>[embedded]`` into it from PyPI: not editable, not the checkout.  Every
command runs as a subprocess of that venv's executables, from a directory outside the
checkout, so nothing of the checkout is imported.  The external Redis is a
password-protected redis-server this module starts.

Every failure path must print one line (on stderr), exit non-zero, show no traceback and
never the password.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import uuid
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from dlock_helpers import tracked_copy, wait_until

from celery_dlock import RedisLock
from celery_dlock.ops.embedded import EmbeddedRedis

# (xdist_group: where pytest-xdist honours it, one process runs the module, so the
# fixture below builds and installs once; two processes that both run it are safe, each
# builds in a copy of its own)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("newcomer")]

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "nc-S3cret-pw"
UNREACHABLE = f"redis://:{PASSWORD}@127.0.0.1:1/0"
PREFIX = "ncp"

# Signs that pip could not reach the index at all (rather than a broken package).
_OFFLINE = ("NewConnectionError", "Failed to establish a new connection",
            "Temporary failure in name resolution", "No matching distribution found",
            "Network is unreachable")

APP_MODULE = '''\
import os

from celery import Celery

app = Celery("ncapp", set_as_current=False)
app.conf.dlock_url = os.environ["NC_DLOCK_URL"]
app.conf.dlock_key_prefix = os.environ.get("NC_PREFIX", "dlock")
'''

Run = subprocess.CompletedProcess[str]


@dataclass
class Newcomer:
    bin: Path
    home: Path  # a directory outside the checkout: the cwd of every command
    redis_url: str  # the external Redis, with its password
    sdist: Path
    source: Path  # the copy of the tracked files the sdist was built from

    def run(self, exe: str, *args: str, timeout: float = 60, input: str | None = None,
            env: dict[str, str] | None = None) -> Run:
        base = {k: v for k, v in os.environ.items()
                if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        base["PATH"] = f"{self.bin}{os.pathsep}{base.get('PATH', '')}"
        base.update(COLUMNS="200", LINES="50")  # top fits its table to the terminal
        return subprocess.run([str(self.bin / exe), *args], cwd=self.home,
                              env={**base, **(env or {})}, input=input,
                              stdin=None if input is not None else subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout,
                              check=False)

    def dlock(self, *args: str, url: str | None = None, input: str | None = None,
              timeout: float = 60) -> Run:
        env = {"NC_DLOCK_URL": self.redis_url if url is None else url,
               "NC_PREFIX": PREFIX}
        return self.run("celery", "-A", "ncapp", "dlock", *args, env=env,
                        input=input, timeout=timeout)


def _pip_install(python: Path, *requirements: str) -> None:
    pip = subprocess.run([str(python), "-m", "pip", "install", "--quiet",
                          "--disable-pip-version-check", *requirements],
                         capture_output=True, text=True, timeout=400, check=False)
    out = pip.stdout + pip.stderr
    if pip.returncode != 0 and any(sign in out for sign in _OFFLINE):
        pytest.skip(f"PyPI unreachable (pip install {' '.join(requirements)}): "
                    f"{out[-300:]}")
    assert pip.returncode == 0, out[-3000:]


def _install(tmp: Path) -> tuple[Path, Path, Path]:
    """The venv's bin folder, the sdist, and the copy of the tracked files it is built
    from (``build`` comes with the test extra)."""
    dist = tmp / "dist"
    source = tracked_copy(REPO, tmp / "source")
    made = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir",
                           str(dist), str(source)],
                          capture_output=True, text=True, timeout=240, check=False)
    out = made.stdout + made.stderr
    if made.returncode != 0 and any(sign in out for sign in _OFFLINE):
        pytest.skip(f"PyPI unreachable (building the sdist): {out[-300:]}")
    assert made.returncode == 0, out[-3000:]
    (sdist,) = dist.glob("celery_dlock-*.tar.gz")

    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    _pip_install(env_dir / "bin" / "python", f"{sdist}[embedded]")
    return env_dir / "bin", sdist, source


@pytest.fixture(scope="module")
def external() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(password=PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory,
             external: EmbeddedRedis) -> Iterator[Newcomer]:
    tmp = tmp_path_factory.mktemp("newcomer")
    bin_dir, sdist, source = _install(tmp)
    home = tmp / "home"
    home.mkdir()
    (home / "ncapp.py").write_text(APP_MODULE)
    yield Newcomer(bin=bin_dir, home=home, redis_url=external.url, sdist=sdist,
                   source=source)
    shutil.rmtree(tmp / "venv", ignore_errors=True)


@pytest.fixture
def r(external: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(external.url, socket_timeout=10)
    yield client
    client.close()


def assert_one_line_failure(proc: Run, *, code: int | None = None) -> str:
    """Non-zero, one line on stderr, no traceback, no password; returns the line."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    if code is not None:
        assert proc.returncode == code, out
    assert "Traceback" not in out, out
    assert PASSWORD not in out, out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, out
    return lines[0]


def assert_clean_success(proc: Run) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    assert PASSWORD not in out, out


def _keyspace(client: redis.Redis) -> dict[bytes, object]:
    """Every key with its type, and the members of kombu's binding-deadline index."""
    state: dict[bytes, object] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        state[key] = (kind, frozenset(client.zrange(key, 0, -1))
                      if kind == b"zset" else None)
    return state


# -- what was installed ----------------------------------------------------------------

def test_the_installed_package_is_the_sdist_not_the_checkout(newcomer: Newcomer) -> None:
    proc = newcomer.run("python", "-c", "import celery_dlock, pathlib; "
                        "print(celery_dlock.__version__); "
                        "p = pathlib.Path(celery_dlock.__file__).parent; print(p); "
                        "print((p / 'py.typed').is_file())")
    assert_clean_success(proc)
    version, where, typed = proc.stdout.split()
    from celery_dlock import __version__
    assert version == __version__
    assert "site-packages" in where and not where.startswith(str(REPO)), where
    assert typed == "True"  # py.typed is installed, not only in the sdist
    assert newcomer.run("celery-dlock", "version").stdout.strip() == (
        f"celery-dlock {__version__}")


def test_the_sdist_carries_every_doc_and_example(newcomer: Newcomer) -> None:
    """test_packaging checks a few named files; here: every one under docs/ and
    examples/ that git tracks."""
    assert not newcomer.source.is_relative_to(REPO)  # built outside the checkout
    with tarfile.open(newcomer.sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    wanted = {str(path.relative_to(newcomer.source)) for folder in ("docs", "examples")
              for path in (newcomer.source / folder).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts}
    assert wanted and wanted <= names, sorted(wanted - names)


# -- celery-dlock and its demo -------------------------------------------------------

def test_help_of_the_command_and_of_the_demo(newcomer: Newcomer) -> None:
    top = newcomer.run("celery-dlock", "--help")
    assert_clean_success(top)
    assert "demo" in top.stdout and "celery -A proj dlock" in top.stdout
    demo = newcomer.run("celery-dlock", "demo", "--help")
    assert_clean_success(demo)
    for option in ("--redis-url", "--workers", "--concurrency", "--stock", "--buyers"):
        assert option in demo.stdout


SMALL = ("--workers", "1", "--concurrency", "2", "--stock", "20", "--buyers", "40")


def test_demo_on_the_embedded_redis(newcomer: Newcomer) -> None:
    proc = newcomer.run("celery-dlock", "demo", *SMALL, timeout=180)
    assert_clean_success(proc)
    assert "Starting an embedded redis-server" in proc.stdout
    assert "With LockedTask exactly 20 units were sold, 0 left." in proc.stdout
    over = [line for line in proc.stdout.splitlines() if "over-sold by" in line]
    assert len(over) == 1 and over[0].split()[-1] == "0", proc.stdout  # LockedTask


def test_demo_on_an_external_redis_leaves_its_keyspace_as_found(
        newcomer: Newcomer, r: redis.Redis) -> None:
    r.set("newcomer:own-data", "keep me")
    before = _keyspace(r)
    proc = newcomer.run("celery-dlock", "demo", "--redis-url", newcomer.redis_url,
                        *SMALL, timeout=180)
    assert_clean_success(proc)
    assert "embedded" not in proc.stdout
    assert "With LockedTask exactly 20 units were sold, 0 left." in proc.stdout
    assert _keyspace(r) == before
    assert r.get("newcomer:own-data") == b"keep me"


@pytest.mark.parametrize("args", [
    ("--redis-url", UNREACHABLE),
    ("--redis-url", f"http://:{PASSWORD}@127.0.0.1/0"),
    ("--workers", "0"), ("--workers", "17"),
    ("--concurrency", "0"), ("--concurrency", "33"),
    ("--stock", "0"), ("--stock", "100001"),
    ("--buyers", "0"), ("--buyers", "100001"),
    ("--workers", "many"),
    ("--workers",),
    ("--bogus",),
    (UNREACHABLE,),  # the URL given without --redis-url
], ids=lambda a: " ".join(a).replace(PASSWORD, "PW"))
def test_demo_bad_input_is_one_line(newcomer: Newcomer, args: tuple[str, ...]) -> None:
    proc = newcomer.run("celery-dlock", "demo", *args, timeout=60)
    line = assert_one_line_failure(proc)
    assert line.startswith("celery-dlock demo: "), line
    assert "Starting" not in proc.stdout


def test_demo_without_a_redis_server_binary_is_one_line(newcomer: Newcomer) -> None:
    proc = newcomer.run("celery-dlock", "demo", *SMALL,
                        env={"DLOCK_REDIS_SERVER": str(newcomer.home / "no-such")})
    line = assert_one_line_failure(proc, code=1)
    assert "DLOCK_REDIS_SERVER" in line


@pytest.mark.parametrize("args", [("nope",), ("--bogus",), ("demos", "--workers", "1")],
                         ids=" ".join)
def test_unknown_command_is_one_line(newcomer: Newcomer, args: tuple[str, ...]) -> None:
    line = assert_one_line_failure(newcomer.run("celery-dlock", *args), code=2)
    assert line.startswith("celery-dlock: "), line
    assert "--help" in line


# -- celery -A app dlock ---------------------------------------------------------------

@pytest.fixture
def held(external: EmbeddedRedis, r: redis.Redis) -> Iterator[str]:
    """A lock held by this test process on the external Redis."""
    name = f"stock:{uuid.uuid4().hex[:6]}"
    lock = RedisLock(r, name, ttl=120, prefix=PREFIX, auto_renew=False,
                     info={"task_name": "newcomer.buy"})
    assert lock.acquire()
    yield name
    r.delete(*r.keys(f"{PREFIX}:*") or ["-"])


def test_dlock_help_lists_the_sub_commands(newcomer: Newcomer) -> None:
    proc = newcomer.dlock("--help")
    assert_clean_success(proc)
    for sub in ("ls", "show", "release", "top", "web"):
        assert f"  {sub} " in proc.stdout, proc.stdout
        assert_clean_success(newcomer.dlock(sub, "--help"))


def test_dlock_ls_show_top_release_on_a_held_lock(newcomer: Newcomer, held: str,
                                                  r: redis.Redis) -> None:
    ls = newcomer.dlock("ls")
    assert_clean_success(ls)
    assert held in ls.stdout and "newcomer.buy" in ls.stdout
    as_json = newcomer.dlock("ls", "--json")
    assert_clean_success(as_json)
    assert f'"key": "{held}"' in as_json.stdout
    show = newcomer.dlock("show", held)
    assert_clean_success(show)
    assert f"redis_key: {PREFIX}:{{{held}}}" in show.stdout
    assert_clean_success(newcomer.dlock("show", held, "--json"))
    top = newcomer.dlock("top", "--iterations", "1", "--interval", "0.1")
    assert_clean_success(top)
    assert held in top.stdout and "1 held" in top.stdout

    declined = newcomer.dlock("release", held, input="n\n")
    assert declined.returncode != 0 and "Traceback" not in declined.stderr
    assert r.exists(f"{PREFIX}:{{{held}}}")
    confirmed = newcomer.dlock("release", held, input="y\n")
    assert_clean_success(confirmed)
    assert f"Released lock '{held}'" in confirmed.stdout
    assert not r.exists(f"{PREFIX}:{{{held}}}")


def test_dlock_release_force_with_a_reason(newcomer: Newcomer, held: str,
                                           r: redis.Redis) -> None:
    proc = newcomer.dlock("release", held, "--force", "--reason", "stuck since noon")
    assert_clean_success(proc)
    assert f"Released lock '{held}'" in proc.stdout
    assert not r.exists(f"{PREFIX}:{{{held}}}")
    gone = newcomer.dlock("ls")
    assert_clean_success(gone)
    assert held not in gone.stdout


BAD_DLOCK = [
    # (args, dlock_url or None for the external Redis, expected exit code)
    (("show", "no:such"), None, 1),
    (("release", "no:such", "--force"), None, 1),
    (("ls",), UNREACHABLE, 2),
    (("show", "k"), UNREACHABLE, 2),
    (("release", "k", "--force"), UNREACHABLE, 2),
    (("top", "--iterations", "1"), UNREACHABLE, 2),
    (("--url", UNREACHABLE, "ls"), None, 2),
    (("ls",), f"http://:{PASSWORD}@127.0.0.1/0", 2),
    (("ls",), f"redis://:{PASSWORD}@127.0.0.1:notaport/0", 2),
    (("ls",), "not a url", 2),
    (("--url", f"redis://:{PASSWORD}@127.0.0.1:99999/0", "ls"), None, 2),
    (("show",), None, 2),
    (("release",), None, 2),
    (("bogus",), None, 2),
    (("--bogus", "ls"), None, 2),
    (("ls", "--bogus"), None, 2),
    (("top", "--iterations", "-1"), None, 2),
    (("ls", UNREACHABLE), None, 2),  # a stray argument that carries a password
]


@pytest.mark.parametrize(("args", "url", "code"), BAD_DLOCK,
                         ids=[" ".join(a).replace(PASSWORD, "PW") + f" url={u and 'bad'}"
                              for a, u, _ in BAD_DLOCK])
def test_dlock_bad_input_is_one_line(newcomer: Newcomer, args: tuple[str, ...],
                                     url: str | None, code: int) -> None:
    proc = newcomer.dlock(*args, url=url)
    assert_one_line_failure(proc, code=code)


def test_dlock_a_bad_url_option_is_named_as_the_option(newcomer: Newcomer) -> None:
    """A --url that cannot be used is blamed on --url, not on the app's settings."""
    proc = newcomer.dlock("--url", f"http://:{PASSWORD}@127.0.0.1/0", "ls")
    line = assert_one_line_failure(proc, code=2)
    assert "--url" in line and "dlock_url" not in line, line


def test_dlock_without_a_sub_command_shows_the_help(newcomer: Newcomer) -> None:
    proc = newcomer.dlock()
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and PASSWORD not in out, out
    assert out.lstrip().startswith("Usage: celery dlock"), out
    assert "Commands:" in out and "release" in out, out


def test_demo_with_a_wrong_password_is_one_line(newcomer: Newcomer) -> None:
    wrong = newcomer.redis_url.replace(PASSWORD, "wrong-" + PASSWORD)
    proc = newcomer.run("celery-dlock", "demo", "--redis-url", wrong)
    line = assert_one_line_failure(proc, code=1)
    assert "wrong-" not in line and "redis://:**@" in line, line


def test_demo_whose_redis_goes_away_midway_is_one_line(newcomer: Newcomer) -> None:
    """The Redis stops while buyers are being sent: one line, exit 1, workers stopped."""
    with EmbeddedRedis(password=PASSWORD) as server:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.Popen(
            [str(newcomer.bin / "celery-dlock"), "demo", "--redis-url", server.url,
             "--workers", "1", "--concurrency", "1", "--stock", "20000",
             "--buyers", "20000"],
            cwd=newcomer.home, env=base, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert wait_until(lambda: any(client.scan_iter(match="dlock-demo-*:plain:*")),
                              timeout=60, interval=0.05)
            client.close()
            server.stop()
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    gone = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    line = assert_one_line_failure(gone, code=1)
    assert line.startswith("celery-dlock demo: "), line
    assert "stopping workers" in out
