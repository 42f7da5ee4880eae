"""The user-facing Markdown stands alone: no references outside the repository, and every relative link resolves."""
from __future__ import annotations

import dataclasses
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


# Flags of other programs that the pages quote: torchrun's, pip's, Slurm's and the published trainer's.
FOREIGN_FLAGS = {"--nproc_per_node", "--standalone", "--nnodes", "--node_rank", "--rdzv_backend", "--rdzv_endpoint",
                 "--rdzv_id", "--index-url", "--use_bf16", "--sgdm_init_velocity_std", "--logdir", "--array",
                 "--gpus-per-task"}
PLACEHOLDER_FLAGS = {"--field-name", "--no-field-name"}  # README's description of how fields become flags
DOC_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")


def defined_flags() -> set[str]:
    """Every flag the code defines: a field of a config dataclass (cli.flag; booleans also as --no-NAME), or a
    literal "--name" in a module (argparse)."""
    import train_gpt
    from cli import option
    from optim import OPTIMIZERS
    from variants import ResearchConfig

    flags = {"--help"}  # argparse's own
    for cls in (train_gpt.GPTConfig, train_gpt.TrainConfig, ResearchConfig,
                *(spec.config for spec in OPTIMIZERS.values())):
        for field in dataclasses.fields(cls):
            flags |= {option(field.name), option("no_" + field.name)}
    for path in ROOT.rglob("*.py"):
        if "tests" not in path.relative_to(ROOT).parts:
            flags |= set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", path.read_text()))
    return flags


def test_every_flag_the_pages_name_exists() -> None:
    known = defined_flags() | FOREIGN_FLAGS | PLACEHOLDER_FLAGS
    unknown = {f"{page.relative_to(ROOT)}: {name}" for page in PAGES for name in DOC_FLAG.findall(page.read_text())
               if name not in known}
    assert not unknown, sorted(unknown)
