"""Every relative link in README.md and docs/*.md names a file that exists, and every
page under docs/ is reachable from the README (directly or through another page)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _relative_links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    return [t for t in LINK.findall(text)
            if "://" not in t and not t.startswith("mailto:")]


def test_every_relative_link_names_an_existing_file() -> None:
    broken = [(p.relative_to(ROOT).as_posix(), target)
              for p in _pages() for target in _relative_links(p)
              if not (p.parent / target).exists()]
    assert broken == []


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    seen: set[Path] = set()
    todo = [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo.extend((page.parent / t).resolve() for t in _relative_links(page))
    unreachable = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p not in seen]
    assert unreachable == []


def test_the_readme_layout_lists_every_module() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = text[text.index("## Layout"):]
    package = ROOT / "celery_dlock"
    missing = [p.relative_to(package).as_posix() for p in sorted(package.rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py") and
               f" {p.name} " not in layout.replace("\n", " ")]
    assert missing == []
