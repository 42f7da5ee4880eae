"""Every command line shares one parser (cli.ArgumentParser): usage names the command as it is run, --help shows
each flag's default once and has a line for every flag, abbreviated and misspelt flags are refused with the flag
they resemble, and every refusal is one line."""
from __future__ import annotations

import argparse
import importlib
import inspect
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cli
import config
import train_gpt
from run.directory import module_file
from tests.helpers import repository_modules

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def command_modules() -> list[str]:
    """Every module of the repository that runs as a command (has a `__main__` block), as `python -m` names it."""
    return sorted(module.removesuffix(".__main__") for module in repository_modules()
                  if 'if __name__ == "__main__":' in module_file(module).read_text(encoding="utf-8"))


def parser_of(module_name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `module_name`'s main() builds, caught when it starts parsing (nothing of the command runs)."""
    if module_name == "train_gpt":
        classes = config.section_classes(train_gpt.GPTConfig, train_gpt.TrainConfig, "adamw")
        return config.build_arg_parser(classes, "adamw", config.preset_values(classes, None, "adamw"))
    original = cli.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        if not self.add_help:  # a pre-parser of a few flags
            return original(self, args, namespace)
        raise _Captured(self)

    monkeypatch.setattr(cli.ArgumentParser, "parse_known_args", capture)
    monkeypatch.setattr(sys, "argv", [module_name, "--help"])  # a main() that reads sys.argv sees its own flags only
    module = importlib.import_module(module_name)
    main = module.main if hasattr(module, "main") else importlib.import_module(f"{module_name}.__main__").main
    with pytest.raises(_Captured) as caught:
        main(["--help"]) if inspect.signature(main).parameters else main()
    return caught.value.parser


def all_actions(parser: argparse.ArgumentParser) -> list[tuple[argparse.ArgumentParser, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += all_actions(sub)
        else:
            found.append((parser, action))
    return found


def test_every_command_is_found():
    modules = command_modules()
    assert {"train_gpt", "sample", "export", "data.tokenize", "eval.val_loss", "eval.report", "eval.compare",
            "bench.e2e"} <= set(modules), modules


def test_bench_commands_run_from_the_repository_root_without_editing_sys_path():
    """`python -m bench.NAME` from the repository root finds the repository's modules through the working directory:
    importing a benchmark leaves sys.path as it was (import has no side effects)."""
    bench = [name for name in command_modules() if name.startswith("bench.")]
    check = ("import importlib, sys\nbefore = list(sys.path)\nfor name in sys.argv[1:]:\n"
             "    importlib.import_module(name)\n    assert sys.path == before, f'{name} edits sys.path'\n")
    proc = subprocess.run([sys.executable, "-c", check, *bench], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert len(bench) >= 8 and proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("module_name", command_modules())
def test_every_command_uses_the_shared_parser(module_name, monkeypatch):
    parser = parser_of(module_name, monkeypatch)
    assert isinstance(parser, cli.ArgumentParser) and not parser.allow_abbrev
    assert parser.prog == ("train_gpt.py" if module_name == "train_gpt" else f"python -m {module_name}")
    for owner, action in all_actions(parser):
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{module_name} {name}: no help line"
        shown = owner._get_formatter()._expand_help(action)
        if action.default not in (None, "", argparse.SUPPRESS):
            assert shown.count("default") == 1, f"{module_name} {name}: defaults said {shown.count('default')}x"


def help_text(parser: argparse.ArgumentParser) -> str:
    out = io.StringIO()
    parser.print_help(out)
    return re.sub(r"\s+", " ", out.getvalue())


def test_help_says_each_default_once(monkeypatch):
    """--run-name, --wandb-run-name and --prompt explain their default; the parser adds no second "(default: )"."""
    trainer = help_text(parser_of("train_gpt", monkeypatch))
    assert "--run-name STR run directory name (default: timestamp-preset- optimizer); an existing run is never " \
           "overwritten --resume" in trainer
    assert "(default: )" not in trainer and "--steps INT optimizer steps" in trainer
    assert re.search(r"--steps INT .*?\(default: 122070\)", trainer)
    sample = help_text(parser_of("sample", monkeypatch))
    assert "(default: start after <|endoftext|>) --prompt-file" in sample
    logic = help_text(parser_of("eval.logic_puzzles", monkeypatch))
    assert re.search(r"--per-category \S+ .*?\(default: 250\)", logic)
    assert parser_of("eval.val_loss", monkeypatch).format_usage().startswith("usage: python -m eval.val_loss ")


@pytest.mark.parametrize("argv, expected", [
    (["--step", "3"], "unknown flag --step (flags are never abbreviated): did you mean --steps?"),
    (["--stpes", "3"], "unknown flag --stpes: did you mean --steps?"),
    (["--steps=3", "--lr-sched", "cosine"], "unknown flag --lr-sched (flags are never abbreviated): did you mean "
                                             "--lr-schedule?"),
    (["--zzzz"], "unknown flag --zzzz (train_gpt.py --help lists the flags)"),
    (["--n-embd", "100", "--n-head", "3"], "--n-embd 100 must be divisible by --n-head 3"),
])
def test_trainer_refusals_are_one_line(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        train_gpt.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == f"train_gpt.py: error: {expected}\n"


def test_abbreviations_are_refused_in_every_kind_of_command(capsys):
    """The same refusal in an evaluation (a misspelt required flag is named, not reported missing), in data.tokenize
    and in export's subcommands."""
    from data import tokenize
    from eval import val_loss

    import export

    for main, argv, expected in [
        (val_loss.main, ["--chekpoint", "x"], "python -m eval.val_loss: error: unknown flag --chekpoint: did you "
                                               "mean --checkpoint?"),
        (val_loss.main, ["--run", "x", "--val-tok", "5"], "python -m eval.val_loss: error: unknown flag --val-tok "
                                                          "(flags are never abbreviated): did you mean --val-tokens?"),
        (tokenize.main, ["a.txt", "--out", "x", "--prefx", "p"], "python -m data.tokenize: error: unknown flag "
                                                                  "--prefx: did you mean --prefix?"),
        (export.main, ["to-hf", "--checkpoint", "x", "--ou", "y"], "python -m export: error: unknown flag --ou "
                                                                    "(flags are never abbreviated): did you mean "
                                                                    "--out?"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert capsys.readouterr().err == expected + "\n"


def test_stray_values_and_several_unknown_flags():
    known = ["--steps", "--seed", "--lr"]
    assert cli.unknown_arguments(["3", "4"], known, "p") == "unexpected arguments: 3 4"
    assert cli.unknown_arguments(["--sed", "--lrr"], known, "p") == \
        "unknown flag --sed: did you mean --seed? (also unknown: --lrr)"
    assert cli.unknown_arguments(["-1"], known, "p") == "unexpected argument: -1"


def test_progress_outside_a_terminal_is_plain_lines(tmp_path, capsys):
    """A bar in a log file or a pipe writes whole lines (no carriage returns, no padding), the last with the total;
    data.tokenize's bar is one of them."""
    out = io.StringIO()
    for _ in cli.progress_bar(range(4), file=out, mininterval=0, delay=0, desc="work"):
        pass
    lines = out.getvalue().split("\n")
    assert "\r" not in out.getvalue() and lines[-1] == "" and lines[-2].startswith("work: 100%|")
    assert all(line.startswith("work: ") and line == line.rstrip() for line in lines[:-1])
    assert len(lines[:-1]) >= 2
    out = io.StringIO()
    for _ in cli.progress_bar(range(4), file=out, desc="quick"):  # shorter than the interval: the final line only
        pass
    assert out.getvalue().startswith("quick: 100%|") and out.getvalue().count("\n") == 1

    from data.tokenize import documents_to_shards

    documents_to_shards([f"document {i} " * 50 for i in range(40)], tmp_path, "p", val_tokens=100, workers=1,
                        progress=True)
    err = capsys.readouterr().err
    assert "tokenizing p" in err and "\r" not in err and err.endswith("\n")


def test_bench_e2e_warns_on_a_busy_machine():
    from bench.e2e import busy_warning

    assert busy_warning(1.9, 2) is None
    warning = busy_warning(5.2, 2)
    assert warning.startswith("WARNING: this machine is busy (load average 5.2 on 2 cores") and "below 2" in warning
