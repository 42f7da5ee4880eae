"""One policy for filesystem errors in every command that writes (docs/runs.md#filesystem-errors): on a full disk,
a read-only filesystem and a folder it may not write to, each command ends with exit code 2 and one line that names
the path, the operation that failed and what to do, never a traceback, and leaves nothing half written (no
temporary file, no output that is not whole). The commands run in this process on tiny inputs; the filesystems are
real (tests/filesystems.py): a small tmpfs, a read-only bind mount, mode bits that bind even root."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import export
import train_gpt
from data import tokenize
from eval import compare, report, val_loss
from grid.__main__ import main as grid_main
from run.log import read_log
from tests.filesystems import full_disk, mount_problem, no_permission, read_only
from tests.helpers import tiny_args

pytestmark = pytest.mark.slow  # 36 commands on three filesystems, a tiny run and its export first: ~40 s

PROBLEM = mount_problem()
needs_mount = pytest.mark.skipif(PROBLEM is not None, reason=f"{PROBLEM}")


@pytest.fixture(scope="module")
def made(corpus, tmp_path_factory) -> dict[str, Path]:
    """What the commands read: a finished tiny run, its export, a text file, and a grid directory whose journal
    plans that run (made in a folder outside every test filesystem)."""
    root = tmp_path_factory.mktemp("inputs")
    train_gpt.main(tiny_args(corpus, root, "run", steps=2, **{"val-every": 0}))
    export.main(["to-hf", "--checkpoint", str(root / "run"), "--out", str(root / "hf")])
    (root / "text.txt").write_text(" ".join(f"word{i}" for i in range(300)))
    grid = root / "grid"
    (grid / "seed=1").mkdir(parents=True)
    for item in (root / "run").iterdir():
        (grid / "seed=1" / item.name).symlink_to(item)
    plan = {"event": "start", "runs": [{"name": "seed=1", "path": str(grid / "seed=1"), "steps": 2,
                                        "batch_tokens": 256}]}
    (grid / "grid.jsonl").write_text(json.dumps(plan) + "\n")
    return {"root": root, "run": root / "run", "hf": root / "hf", "text": root / "text.txt", "grid": grid}


def commands(made: dict[str, Path], corpus: Path) -> dict[str, callable]:
    """Every command that writes, each writing into the folder it is given (for eval.report, into the copy of the
    run placed there: it writes beside the run)."""
    ckpt = str(made["run"] / "checkpoints" / "latest.pt")
    return {
        "train_gpt.py": lambda at: train_gpt.main(tiny_args(corpus, at, "new", steps=2, **{"val-every": 0})),
        "train_gpt.py --resume": lambda at: train_gpt.main(["--resume", ckpt, "--steps", "3", "--run-dir", str(at),
                                                            "--run-name", "resumed"]),
        "data.tokenize": lambda at: tokenize.main([str(made["text"]), "--out", str(at / "tok"), "--workers", "1",
                                                   "--val-tokens", "20", "--shard-tokens", "100"]),
        "export to-hf": lambda at: export.main(["to-hf", "--checkpoint", ckpt, "--out", str(at / "hf")]),
        "export from-hf": lambda at: export.main(["from-hf", "--source", str(made["hf"]), "--out", str(at / "m.pt")]),
        "eval.val_loss": lambda at: val_loss.main(["--checkpoint", ckpt, "--out", str(at / "eval"), "--val-tokens",
                                                   "256"]),
        "eval.report": lambda at: report.main(["--run", str(at / "run"), "--quick"]),
        "eval.compare": lambda at: compare.main(["--run", str(made["run"]), "--out", str(at / "compare")]),
        "grid": lambda at: grid_main(["--name", "g", "--run-dir", str(at), "--axis", "seed=1", "--no-report", "--",
                                      *tiny_args(corpus, at, "x", steps=2)[:-2]]),
        "grid report": lambda at: grid_main(["report", str(at / "grid"), "--quick"]),
    }


def placed(made: dict[str, Path], at: Path) -> Path:
    """`at` holding what a command reads there: a copy of the run (eval.report) and of the grid (grid report)."""
    import shutil

    shutil.copytree(made["run"], at / "run")
    shutil.copytree(made["grid"], at / "grid", symlinks=True)
    return at


def check_one_line_and_nothing_half_written(name: str, outcome, err: str, at: Path, before: dict[Path, bytes]):
    code = outcome.value.code if isinstance(outcome.value, SystemExit) else outcome.value
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err and lines, f"{name}: exit {code}\n{err}"
    assert lines[-1].startswith("error: ") and "could not " in lines[-1] and str(at) in lines[-1], f"{name}: {err}"
    after = {p: p.read_bytes() for p in at.rglob("*") if p.is_file() and p.name != ".filler"}
    leftovers = [p for p in after if ".tmp" in p.name or any(".tmp" in part for part in p.relative_to(at).parts)]
    assert not leftovers, f"{name}: temporary files left: {leftovers}"
    outputs = [p for p in after if p not in before and p.suffix in (".pt", ".safetensors", ".bin", ".md", ".png")]
    assert not outputs, f"{name}: outputs written by a command that failed: {outputs}"


class Outcome:
    def __init__(self, value):
        self.value = value


def run_command(command, at: Path) -> Outcome:
    try:
        return Outcome(command(at))
    except SystemExit as exc:
        return Outcome(exc)


NAMES = ["train_gpt.py", "train_gpt.py --resume", "data.tokenize", "export to-hf", "export from-hf", "eval.val_loss",
         "eval.report", "eval.compare", "grid", "grid report"]


@needs_mount
@pytest.mark.parametrize("name", NAMES)
def test_a_full_disk_is_one_line_and_nothing_half_written(name, made, corpus, tmp_path, capsys):
    with full_disk(tmp_path / "full", size=4 << 20, fill=placed(made, tmp_path / "inputs")) as at:
        before = {p: p.read_bytes() for p in at.rglob("*") if p.is_file() and p.name != ".filler"}
        outcome = run_command(commands(made, corpus)[name], at)
        check_one_line_and_nothing_half_written(name, outcome, capsys.readouterr().err, at, before)


@needs_mount
@pytest.mark.parametrize("name", NAMES)
def test_a_read_only_filesystem_is_one_line_and_nothing_written(name, made, corpus, tmp_path, capsys):
    with read_only(placed(made, tmp_path / "ro")) as at:
        before = {p: p.read_bytes() for p in at.rglob("*") if p.is_file()}
        outcome = run_command(commands(made, corpus)[name], at)
        check_one_line_and_nothing_half_written(name, outcome, capsys.readouterr().err, at, before)


@pytest.mark.parametrize("name", NAMES)
def test_no_permission_is_one_line_and_nothing_written(name, made, corpus, tmp_path, capsys):
    with no_permission(placed(made, tmp_path / "locked")) as at:
        before = {p: p.read_bytes() for p in at.rglob("*") if p.is_file()}
        outcome = run_command(commands(made, corpus)[name], at)
        err = capsys.readouterr().err
    check_one_line_and_nothing_half_written(name, outcome, err, at, before)
    assert "no permission" in err


@needs_mount
def test_a_disk_that_fills_at_the_checkpoint_stops_the_run_in_one_line_saying_what_it_kept(made, corpus, tmp_path,
                                                                                            capsys):
    """Room for the run directory's config, code and logs, not for its checkpoint: the run stops at its first
    checkpoint with the file named, no temporary left, and says that no checkpoint was written."""
    run = made["run"]
    needed = sum(-(-p.stat().st_size // 4096) * 4096 for p in run.rglob("*") if p.is_file() and p.suffix != ".pt")
    with full_disk(tmp_path / "full", size=8 << 20, free=needed + (128 << 10)) as at:
        with pytest.raises(SystemExit) as stopped:
            train_gpt.main(tiny_args(corpus, at, "r", steps=2, **{"val-every": 0}))
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and "Traceback" not in err, err
        line = err.strip().splitlines()[-1]
        assert line.startswith(f"error: could not write the checkpoint {at / 'r' / 'checkpoints' / 'latest.pt'}: "
                               "No space left on device (ENOSPC); the filesystem is full"), line
        assert line.endswith("the run stopped before it wrote a checkpoint"), line
        assert list((at / "r" / "checkpoints").iterdir()) == []
        assert [r["step"] for r in read_log(at / "r") if "train_loss" in r] == [1, 2]


@needs_mount
def test_resuming_a_run_on_a_read_only_filesystem_says_to_continue_elsewhere(made, tmp_path, capsys):
    """--resume goes on in the run's own directory: where that is read-only, the line says how to go on in another
    (--run-dir and --run-name), and going on there works."""
    with read_only(placed(made, tmp_path / "ro")) as at:
        with pytest.raises(SystemExit) as refused:
            train_gpt.main(["--resume", str(at / "run"), "--steps", "3"])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert refused.value.code == 2 and f"could not create the lock file {at / 'run' / '.lock'}" in line, line
        assert "Read-only file system (EROFS)" in line and "--run-dir/--run-name" in line, line
        summary = train_gpt.main(["--resume", str(at / "run"), "--steps", "3", "--run-dir", str(tmp_path),
                                  "--run-name", "elsewhere"])
    assert summary["step"] == 3 and summary["run_dir"] == str(tmp_path / "elsewhere")


@pytest.mark.parametrize("name, argv", [
    ("eval.val_loss", lambda made, out: val_loss.main(["--checkpoint", str(made["run"]), "--out", str(out)])),
    ("eval.report", lambda made, out: report.main(["--run", str(made["run"]), "--out", str(out), "--quick"])),
    ("eval.compare", lambda made, out: compare.main(["--run", str(made["run"]), "--out", str(out)])),
])
def test_an_out_that_names_a_file_is_one_line(name, argv, made, tmp_path, capsys):
    out = tmp_path / "a_file"
    out.write_text("kept")
    with pytest.raises(SystemExit) as refused:
        argv(made, out)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"error: could not create the directory {out}: File exists (EEXIST); a "
                                            "file is in the way of a directory there: choose another --out, or move "
                                            "the file")
    assert out.read_text() == "kept"
