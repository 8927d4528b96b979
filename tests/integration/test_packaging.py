"""The sdist and the wheel as ``python -m build`` makes them, and ``twine check``."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from dlock_helpers import tracked_copy

REPO = Path(__file__).resolve().parents[2]

# (xdist_group: the two modules that build the package run one at a time)
pytestmark = pytest.mark.xdist_group("sdist")


@pytest.mark.slow
def test_sdist_and_wheel_carry_the_license_docs_and_examples(tmp_path: Path) -> None:
    pytest.importorskip("build")
    pytest.importorskip("twine")
    source = tracked_copy(REPO, tmp_path / "source")  # never build in the checkout
    proc = subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel",
                           "--outdir", str(tmp_path), str(source)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = tmp_path.glob("celery_dlock-*.tar.gz")
    (wheel,) = tmp_path.glob("celery_dlock-*-py3-none-any.whl")

    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for needed in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml",
                   "docs/cli.md", "examples/inventory.py", "celery_dlock/py.typed",
                   "celery_dlock/ops/demo.py"):
        assert needed in names, needed
    assert not any("__pycache__" in name for name in names)

    with zipfile.ZipFile(wheel) as whl:
        files = set(whl.namelist())
        (metadata,) = [n for n in files if n.endswith(".dist-info/METADATA")]
        meta = whl.read(metadata).decode()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in files)
    assert "celery_dlock/py.typed" in files
    assert not any(n.startswith(("tests/", "examples/", "docs/")) for n in files)
    assert "License-Expression: BSD-3-Clause" in meta
    assert "Project-URL: Source, https://github.com/celery-dlock/celery-dlock" in meta
    assert ("Project-URL: Issues, https://github.com/celery-dlock/celery-dlock/issues"
            in meta)

    check = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                            str(sdist), str(wheel)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
