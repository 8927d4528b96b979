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
