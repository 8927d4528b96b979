"""Every relative link in README.md and docs/*.md names a file that exists; every page
under docs/ is listed in docs/index.md and reachable from the README; the README stays a
short front page; docs/architecture.md lists every module."""

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


def test_the_docs_index_links_every_page_and_the_readme_links_the_index() -> None:
    index = ROOT / "docs" / "index.md"
    listed = {(index.parent / t).resolve() for t in _relative_links(index)}
    unlisted = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
                if p != index and p.resolve() not in listed]
    assert unlisted == []
    assert "docs/index.md" in _relative_links(ROOT / "README.md")


#: The README is a front page: what and why, the two commands, install, a first app,
#: the guarantees in brief and a map of docs/. Everything else lives in docs/.
README_MAX_LINES = 300


def test_the_readme_is_a_short_front_page_with_each_command_once() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    for command in ("celery-dlock demo", ".venv/bin/python -m pytest"):
        assert text.count(command) == 1, command
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    for needed in ("See it in one command", "Run the tests", "Install",
                   "Your own app in five minutes", "The guarantees in brief",
                   "Documentation"):
        assert needed in headings


def test_the_architecture_page_lists_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layout = text[text.index("## Every module"):]
    package = ROOT / "celery_dlock"
    missing = [p.relative_to(package).as_posix() for p in sorted(package.rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py") and
               f" {p.name} " not in layout.replace("\n", " ")]
    assert missing == []


def test_the_changelog_speaks_of_released_versions_only() -> None:
    """One "Unreleased" section until a release; every other section is a released
    version with its date, and no page names a version of celery-dlock that has not
    been released."""
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## (.+)$", changelog, flags=re.M)
    assert sections[0] == "Unreleased"
    released = sections[1:]
    assert all(re.fullmatch(r"\d+\.\d+\.\d+ \(\d{4}-\d\d-\d\d\)", s) for s in released)
    known = {s.split()[0] for s in released}
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        named = re.findall(r"celery-dlock (\d+\.\d+(?:\.\d+)?)\b|"
                           r"(?:goes away|removed|deprecated|its name) (?:in|before) "
                           r"(\d+\.\d+)\b", text)
        versions = {a or b for a, b in named}
        assert versions <= known | {v + ".0" for v in known}, (page.name, versions)


def test_the_migration_page_names_every_difference_a_migration_meets() -> None:
    """docs/migrating.md says what changes for code and settings coming from the
    peers (each a difference a migration met unwritten)."""
    text = " ".join((ROOT / "docs" / "migrating.md").read_text(encoding="utf-8").split())
    for difference in (
            "The locks move to `dlock_url`",  # ONCE['url'], singleton_backend_url
            "`singleton_backend_url`",
            "The shims need a store that keeps queue markers",
            "No `clear_lock(key)`, no `get_key`",
            "Markers expire",
            "A lock is never deleted by anyone but its holder"):
        assert difference in text, difference
