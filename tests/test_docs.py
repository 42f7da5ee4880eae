"""The user-facing Markdown stands alone: no references outside the repository, and every relative link resolves."""
from __future__ import annotations

import dataclasses
import re
import sys
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
                 "--gpus-per-task", "--gpus-per-node", "--nodes", "--ntasks", "--ntasks-per-node", "--time",
                 "--partition", "--account", "--qos", "--requeue", "--dependency", "--cpus-per-task"}
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


# The pages' commands and grid files are tested examples: every ```bash command of README.md and docs/ is parsed by
# the tool it runs (train_gpt.py's own checks and a grid's plan included; nothing trains), so is every inline
# `python ...` span (as a part of a command: arguments it leaves out may be required), and every ```toml block is
# planned as a grid whose runs train_gpt.py accepts.
COMMAND_PAGES = [page for page in PAGES if page.name != "BENCHMARKS.md"]  # BENCHMARKS.md records past commands
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`((?:python|torchrun) [^`]+)`(?!`)")
# An inline span that describes a form rather than a command: "python -m bench.<name>", "--optimizer X", "DIR".
DESCRIPTIVE = re.compile(r"\.\.\.|<|\[| \| |(?<![\w/-])[A-Z][A-Z_]*(?![\w/-])")
PLACEHOLDER_COMMANDS = {"python -m module"}  # README's description of how every tool is run
FOREIGN_MODULES = {"pytest", "venv"}


class Parsed(BaseException):
    """Raised in place of running a tool once its parser has accepted the command line."""


def page_commands() -> list[tuple[str, list[str], bool]]:
    """(where, words, whole) of each python/torchrun command of the pages: fenced bash blocks (continuation lines
    joined, comments dropped, the first command of a pipeline or list; whole commands) and inline code spans that
    are not forms (parts of commands)."""
    import shlex

    found = []
    for page in COMMAND_PAGES:
        text, name = page.read_text(), page.relative_to(ROOT)
        blocks = [m.group(2) for m in FENCE.finditer(text) if m.group(1) == "bash"]
        for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            words = list(lexer)
            words = words[next((i for i, w in enumerate(words) if not re.match(r"\w+=", w)), len(words)):]
            words = words[:next((i for i, w in enumerate(words) if w in {";", "&&", "||", "|", ">", "&"}), None)]
            if words[:1] in (["python"], ["torchrun"]):
                found.append((f"{name}: {line.strip()}", words, True))
        for span in INLINE.findall(FENCE.sub("", text)):
            span = " ".join(span.split())
            if not DESCRIPTIVE.search(span) and span not in PLACEHOLDER_COMMANDS:
                found.append((f"{name}: `{span}`", shlex.split(span), False))
    return found


def command_problem(words: list[str], whole: bool, monkeypatch, capsys) -> str | None:
    """Why the tool of `words` refuses them (its parser's error; for a part of a command, `whole` False, a missing
    required argument is no error), None when it accepts them."""
    import argparse
    import importlib.util

    import train_gpt
    from grid.__main__ import plan_grid, run_parser
    from grid.plan import GridError, plan_runs

    if words[0] == "torchrun":  # the trainer (or a module) on this many processes; the launcher's flags are its own
        start = next((i for i, w in enumerate(words) if w in ("train_gpt.py", "-m")), None)
        if start is None:
            return None
        launcher = dict(re.findall(r"--(nnodes|nproc_per_node)=(\d+)", " ".join(words[:start])))
        world = int(launcher.get("nnodes", 1)) * int(launcher.get("nproc_per_node", 1))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world))
        words = ["python", *words[start:]]
    try:
        if words[1] == "train_gpt.py":  # the trainer's parser and checks; files --resume and --init-from name aside
            flags = words[2:]
            drop = {i + k for i, w in enumerate(flags) if w in ("--resume", "--init-from") for k in (0, 1)}
            train_gpt.parse_config([w for i, w in enumerate(flags) if i not in drop])
            return None
        assert words[1] == "-m", words
        module, argv = words[2], words[3:]
        if module in FOREIGN_MODULES:
            return None
        if module == "grid" and {"--axis", "--grid"} & set(argv):  # a grid to run: planned, every run checked
            cut = argv.index("--") if "--" in argv else len(argv)
            spec, known, _ = plan_grid(run_parser().parse_args(argv[:cut]), argv[cut + 1:])
            refused = [f"{run.name}: {run.problem}" for run in plan_runs(spec, known, 1, False) if run.problem]
            return f"{len(refused)} runs refused, e.g. {refused[0]}" if refused else None
        spec = importlib.util.find_spec(module)
        if spec is None:
            return f"no module {module} here"
        original = argparse.ArgumentParser.parse_known_args

        def parse_only(self, args=None, namespace=None):
            original(self, args, namespace)
            raise Parsed

        monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_only)
        monkeypatch.setattr(sys, "argv", [module, *argv])  # as `python -m module ARGS` (some mains take no argv)
        importlib.import_module(module + ".__main__" * (spec.submodule_search_locations is not None)).main()
        return "ran past its parser"
    except Parsed:
        return None
    except SystemExit as exc:
        error = capsys.readouterr().err.strip()
        return None if exc.code == 0 or not whole and "arguments are required" in error else error or str(exc.code)
    except GridError as exc:
        return str(exc)
    finally:
        capsys.readouterr()


def test_every_command_of_the_pages_is_accepted_by_its_tool(monkeypatch, capsys) -> None:
    commands = page_commands()
    assert len(commands) > 40 and any(words[1] == "train_gpt.py" for _, words, _ in commands)
    problems = []
    for where, words, whole in commands:
        with monkeypatch.context() as patch:
            if problem := command_problem(words, whole, patch, capsys):
                problems.append(f"{where}: {problem}")
    assert not problems, "\n".join(problems)


def test_every_grid_file_of_the_pages_plans_runs_the_trainer_accepts(tmp_path) -> None:
    from grid.plan import build_spec, check_flags, plan_runs, train_flags

    blocks = [(page, m.group(2)) for page in COMMAND_PAGES for m in FENCE.finditer(page.read_text())
              if m.group(1) == "toml"]
    assert blocks
    for index, (page, block) in enumerate(blocks):
        path = tmp_path / f"grid{index}.toml"
        path.write_text(block)
        spec = build_spec(None, None, [], [], path)
        check_flags(spec, train_flags())
        refused = [f"{run.name}: {run.problem}" for run in plan_runs(spec, train_flags(), 1, False) if run.problem]
        assert not refused, f"{page.relative_to(ROOT)}: {refused[0]}"
