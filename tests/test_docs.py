"""The user-facing Markdown stands alone: no references outside the repository, and every relative link resolves."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])
FORBIDDEN = re.compile(r"\bSPEC\b|\.\./shared|device machine|\blent (GPU|to)\b|development machine")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def headings(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (fenced code skipped)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def indexed_docs() -> set[Path]:
    """The docs files the index (docs/README.md) lists: pages written beside this one may not exist yet."""
    return {(ROOT / "docs" / name).resolve() for name in LINK.findall((ROOT / "docs" / "README.md").read_text())}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_references_outside_the_repository(page: Path) -> None:
    assert not [m.group(0) for m in FORBIDDEN.finditer(page.read_text())], page


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    problems = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            if file not in indexed_docs():
                problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in headings(file):
            problems.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not problems, f"{page.relative_to(ROOT)}: " + "; ".join(problems)
