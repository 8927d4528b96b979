"""docs/troubleshooting.md has a row for every error class the package can raise."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import celery_dlock
from celery_dlock import DLockError
from celery_dlock.ops.embedded import RedisBinaryNotFound

DOC = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"


def _error_classes() -> set[type[BaseException]]:
    found: set[type[BaseException]] = {RedisBinaryNotFound}
    for info in pkgutil.walk_packages(celery_dlock.__path__, "celery_dlock."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            public = not obj.__name__.startswith("_")
            if issubclass(obj, DLockError) and obj is not DLockError and public \
                    and obj.__module__ == module.__name__:
                found.add(obj)
    return found


def test_the_search_finds_the_known_families() -> None:
    names = {cls.__name__ for cls in _error_classes()}
    assert {"BackendUnavailable", "LockLost", "StaleFence", "HoldChanged"} <= names


def test_every_error_class_has_a_row() -> None:
    rows = [line for line in DOC.read_text(encoding="utf-8").splitlines()
            if line.startswith("| `")]
    missing = sorted(cls.__name__ for cls in _error_classes()
                     if not any(line.startswith(f"| `{cls.__name__}`") for line in rows))
    assert missing == []
