"""Issue 20.13: a newcomer can navigate: every relative link in README.md and docs/*.md resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Pages the README links to that other branches of issue 20 write (they land with the merge).
_WRITTEN_ELSEWHERE = {
    "docs/training.md",
    "docs/families.md",
    "docs/families-mtp-dflash2.md",
    "docs/diagnose.md",
}
_LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


def test_every_relative_link_resolves():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in _LINK.finditer(page.read_text()):
            target = match.group(1)
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path = (page.parent / target).resolve()
            if not path.exists() and path.relative_to(ROOT).as_posix() not in _WRITTEN_ELSEWHERE:
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert {name for name in pages if name not in readme} == set()
