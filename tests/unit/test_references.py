"""Every cross-reference in the package's docstrings (``:mod:``, ``:func:``,
``:class:``, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:`` naming ``celery_dlock...``)
names a module or object that exists: a module that moved takes its references
along."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "celery_dlock"
ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`~?"
                  r"(celery_dlock(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")


def _resolves(ref: str) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_reference_in_a_docstring_resolves() -> None:
    refs: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for found in ROLE.finditer(text.replace("\n", " ")):
            refs.setdefault(found.group(1), []).append(path.name)
    assert len(refs) > 50  # the package does cross-reference itself
    broken = {ref: files for ref, files in refs.items() if not _resolves(ref)}
    assert broken == {}
