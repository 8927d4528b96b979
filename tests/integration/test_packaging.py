"""The sdist and the wheel as ``python -m build`` makes them, and ``twine check``.

They are built from a copy of the files git tracks (``tracked_copy``), never in the
checkout: setuptools writes its build tree into the source directory (the egg-info,
``build/``, and a ``celery_dlock-<version>/`` folder it makes and deletes again), where
another process of the suite may be building at the same time (the module fixture of
``test_newcomer.py`` runs once per test process that gets one of its tests).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from dlock_helpers import tracked_copy

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def build_output(root: Path) -> dict[str, tuple[int, int]]:
    """What setuptools' builds write into the source tree ``root``, each file and
    folder with its modification time and size."""
    found: dict[str, tuple[int, int]] = {}
    for top in root.iterdir():
        if top.name in ("build", "dist") or top.name.endswith(".egg-info") or (
                top.name.startswith("celery_dlock-")):
            for path in (top, *top.rglob("*")):
                stat = path.stat()
                found[str(path.relative_to(root))] = (stat.st_mtime_ns, stat.st_size)
    return found


@dataclass
class Built:
    sdist: Path
    wheel: Path
    checkout_before: dict[str, tuple[int, int]]
    checkout_after: dict[str, tuple[int, int]]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    tmp = tmp_path_factory.mktemp("packaging")
    before = build_output(REPO)
    source = tracked_copy(REPO, tmp / "source")
    proc = subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel",
                           "--outdir", str(tmp / "dist"), str(source)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = (tmp / "dist").glob("celery_dlock-*.tar.gz")
    (wheel,) = (tmp / "dist").glob("celery_dlock-*-py3-none-any.whl")
    yield Built(sdist, wheel, before, build_output(REPO))


def test_building_leaves_the_checkout_alone(built: Built) -> None:
    """No build output of the checkout was created, changed or removed."""
    assert built.checkout_after == built.checkout_before


def test_sdist_carries_the_license_docs_and_examples(built: Built) -> None:
    with tarfile.open(built.sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for needed in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml",
                   "docs/cli.md", "examples/inventory.py", "celery_dlock/py.typed",
                   "celery_dlock/ops/demo.py"):
        assert needed in names, needed
    assert not any("__pycache__" in name for name in names)


def test_wheel_carries_the_license_and_metadata_only_the_package(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as whl:
        files = set(whl.namelist())
        (metadata,) = [n for n in files if n.endswith(".dist-info/METADATA")]
        meta = whl.read(metadata).decode()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in files)
    assert "celery_dlock/py.typed" in files
    assert not any(n.startswith(("tests/", "examples/", "docs/")) for n in files)
    assert "License-Expression: BSD-3-Clause" in meta
    # what pip 23 shows as Home-page (it does not read Project-URL: Homepage)
    assert "Home-page: https://github.com/celery-dlock/celery-dlock\n" in meta
    assert "Project-URL: Homepage, https://github.com/celery-dlock/celery-dlock\n" in meta
    # the summary names every store, not Redis alone
    summary = meta.split("Summary: ", 1)[1].split("\n", 1)[0]
    assert all(store in summary
               for store in ("Redis", "PostgreSQL", "MySQL", "ZooKeeper"))
    assert "Project-URL: Source, https://github.com/celery-dlock/celery-dlock" in meta
    assert ("Project-URL: Issues, https://github.com/celery-dlock/celery-dlock/issues"
            in meta)


def test_twine_check_passes(built: Built) -> None:
    check = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                            str(built.sdist), str(built.wheel)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
