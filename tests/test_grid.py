"""python -m grid (docs/grid.md): a paper grid file at the CPU scale, cut to two tiny runs on 2 workers, finishes,
reports, compares and scores (every cell not comparable); a refused or failing run does not stop the others; SIGINT
then the same command gives runs bit-identical to uninterrupted ones, and the same command once more starts nothing;
the plan from a TOML file, GPU placement, the Slurm script, the errors."""
from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import types

import pytest
import torch

import train_gpt
from run.checkpoint import load_checkpoint
from run.log import read_log
from grid import plan
from grid.__main__ import main
from grid import execute
from grid.execute import Journal
from tests.helpers import GRID_ENV, ROOT, PipedLines, held_env, started, wait_until


def markdown_rows(text: str, heading: str) -> list[list[str]]:
    """The header and body rows of the first Markdown table after `heading`."""
    lines = text.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start:end]]
    return [rows[0]] + rows[2:]


@pytest.mark.serial
def test_a_paper_grid_at_cpu_scale_finishes_reports_compares_and_scores(tmp_path, capsys):
    """Table 1's grid file at --scale cpu on the default data, cut to AdamW's two bias modes (one seed) of a
    1-layer, 16-wide model on 2 workers: each run trains and is reported, the grid compares them (the pivot of
    optimizers by bias mode with its Δ column; more rows: test_eval_report) and scores them against the paper's
    cells, every one not comparable at this scale."""
    args = ["--grid", str(ROOT / "grids" / "table1.toml"), "--scale", "cpu", "--run-dir", str(tmp_path), "--axis",
            "optimizer=adamw", "--axis", "seed=42", "--workers", "2", "--", "--n-layer", "1", "--n-embd", "16",
            "--seq-len", "16", "--batch-tokens", "32", "--micro-batch", "2", "--val-tokens", "32", "--steps", "3",
            "--val-every", "3", "--log-every", "1"]
    assert main(args) == 0, capsys.readouterr().err[-3000:]
    first = capsys.readouterr().out
    directory = tmp_path / "table1-cpu"
    names = [f"optimizer=adamw,bias-mode={b},seed=42" for b in ("none", "bqbv")]
    assert sorted(started(directory)) == sorted(names)
    for name in names:
        assert read_log(directory / name)[-1]["summary"] and read_log(directory / name)[-1]["step"] == 3
        assert (directory / name / "report.md").is_file()
    assert json.loads((directory / names[0] / "eval" / "report.json").read_text())["budget"] == "quick"
    page = (directory / "compare.md").read_text()
    runs_table = markdown_rows(page, "## Runs")
    assert [row[0] for row in runs_table[1:]] == names
    pivot = markdown_rows(page, "## Best validation loss")
    assert pivot[0] == ["optimizer and settings", "symmetric (none)", "b_Q + b_V (bqbv)", "Δ b_Q + b_V"]
    assert [row[0] for row in pivot[1:]] == ["adamw"] and pivot[1][3].startswith(("+", "-"))  # the Δ column
    assert (directory / "compare_loss.png").is_file() and f"comparison: {directory / 'compare.md'}" in first
    assert "scorecard.md" in first
    cells = json.loads((directory / "scorecard.json").read_text())["cells"]
    with_runs = [c for c in cells if c["verdict"] != "no run"]
    assert with_runs and all(c["verdict"] == "not comparable" for c in with_runs)
    assert any(c["ours"] is not None for c in with_runs)  # the path computed our numbers, and still no verdict
    top = (directory / "scorecard.md").read_text().split("**The rule**")[0]
    assert f"every one of the {len(with_runs)} cells with runs is not comparable" in top

    assert main(["status", str(directory)]) == 0
    status = capsys.readouterr().out
    assert "grid table1-cpu: 2 runs: 2 finished" in status and "3/3" in status and "CPU worker" in status


def without(flags: list[str], *names: str) -> list[str]:
    """`flags` less each `--name VALUE` pair of `names`."""
    drop = {i + k for i, word in enumerate(flags) if word in names for k in (0, 1)}
    return [word for i, word in enumerate(flags) if i not in drop]


@pytest.mark.serial
def test_a_refused_and_a_failing_run_do_not_stop_the_others(tmp_path, tiny_flags, capsys):
    args = ["--name", "g", "--run-dir", str(tmp_path), "--axis", "n-head=2,3", "--axis", "val-tokens=32,100000000",
            "--workers", "2", "--no-report", "--", *without(tiny_flags, "--n-head", "--val-tokens"), "--steps", "2"]
    assert main(args) == 1
    stderr = capsys.readouterr().err
    directory = tmp_path / "g"
    assert read_log(directory / "n-head=2,val-tokens=32")[-1]["summary"]
    assert started(directory) == ["n-head=2,val-tokens=32", "n-head=2,val-tokens=100000000"]  # n-head 3: refused
    assert ("NOT FINISHED n-head=3,val-tokens=32: --n-embd 16 must be divisible by --n-head 3" in stderr), stderr
    failure = stderr.split("NOT FINISHED n-head=2,val-tokens=100000000: failed", 1)[1]
    assert "--val-tokens" in failure  # the last lines of the run's output, which name the cause
    assert Journal(directory).states()["n-head=2,val-tokens=100000000"]["state"] == "failed"

    assert main(["status", str(directory)]) == 0
    status = capsys.readouterr().out
    assert "1 finished" in status and "1 failed" in status and "2 invalid" in status
    assert main(args[:8] + ["--dry-run"] + args[8:]) == 0  # failed runs wait for --retry-failed
    assert "[failed] n-head=2,val-tokens=100000000 (--retry-failed runs it again)" in capsys.readouterr().out
    assert main(args[:8] + ["--dry-run", "--retry-failed"] + args[8:]) == 0
    assert "[new] n-head=2,val-tokens=100000000 -> CPU worker 1" in capsys.readouterr().out


@pytest.mark.serial
def test_sigint_stops_every_run_with_a_checkpoint_the_same_command_completes_them_bit_identically_then_starts_nothing(
        tmp_path, tiny_flags, capsys, one_thread):
    args = ["--name", "stopped", "--run-dir", str(tmp_path), "--axis", "seed=1,2", "--workers", "2", "--no-report",
            "--", *tiny_flags, "--steps", "8"]
    proc = subprocess.Popen([sys.executable, "-m", "grid", *args], cwd=ROOT, env=held_env(3, GRID_ENV),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = PipedLines(proc)  # each run holds after step 3 until the grid passes the signal on
    outputs = [tmp_path / "stopped" / "logs" / f"seed={seed}.log" for seed in (1, 2)]
    wait_until(lambda: all(p.is_file() and "held after step 3" in p.read_text() for p in outputs),
               "both runs holding after step 3")
    assert main(args) == 2  # a second grid process on the same directory is refused
    assert f"{tmp_path / 'stopped'} is in use by grid pid {proc.pid}" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "stopped")]) == 0  # from another terminal
    assert f"running: grid pid {proc.pid} on host" in capsys.readouterr().out
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 130, output.text()[-3000:]
    states = Journal(tmp_path / "stopped").states()
    assert {s["state"] for s in states.values()} == {"interrupted"}, states
    kept = [f"seed={seed}" for seed in (1, 2)
            if load_checkpoint(tmp_path / "stopped" / f"seed={seed}" / "checkpoints" / "latest.pt")["step"] == 3]
    assert kept == ["seed=1", "seed=2"], states  # each stopped where it was, with a checkpoint

    before = len(Journal(tmp_path / "stopped").records())
    assert main(args) == 0, capsys.readouterr().err[-3000:]  # the same command
    resumed = [r["run"] for r in Journal(tmp_path / "stopped").records()[before:] if r.get("state") == "running"
               and r["resume"]]
    assert resumed == kept
    before = len(Journal(tmp_path / "stopped").records())
    assert main(args) == 0, capsys.readouterr().err[-3000:]  # once more: every run finished, none starts again
    assert "0 to start, 0 to resume, 2 finished" in capsys.readouterr().out
    assert not [r for r in Journal(tmp_path / "stopped").records()[before:] if r.get("state") == "running"]
    for seed in (1, 2):  # uninterrupted runs with the flags the grid gives, trained here (one thread, as its workers)
        train_gpt.main([*tiny_flags, "--steps", "8", f"--seed={seed}", "--run-dir", str(tmp_path / "straight"),
                        "--run-name", f"seed={seed}"])
        done, straight = (tmp_path / name / f"seed={seed}" for name in ("stopped", "straight"))
        a = load_checkpoint(done / "checkpoints" / "latest.pt")["model"]
        b = load_checkpoint(straight / "checkpoints" / "latest.pt")["model"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        losses = [{r["step"]: r["train_loss"] for r in read_log(run) if "train_loss" in r}
                  for run in (done, straight)]
        assert losses[0] == losses[1] and len(losses[0]) == 8


def test_a_grid_file_gives_the_same_plan_as_the_command_line(tmp_path, tiny_flags):
    toml = tmp_path / "paper.toml"
    toml.write_text('name = "paper"\nrun_dir = "%s"\n[axes]\noptimizer = ["ecd", "adamw"]\nbias-mode = ["none", '
                    '"bqbv"]\nseed = [42, 83]\nbias_per_head = [true, false]\n[flags]\nsteps = 3\ncompile = false\n'
                    % tmp_path)
    from_file = plan.build_spec(None, None, [], [], toml)
    from_line = plan.build_spec("paper", str(tmp_path), ["optimizer=ecd,adamw", "bias-mode=none,bqbv", "seed=42,83",
                                                         "bias-per-head=true,false"],
                                ["--steps=3", "--no-compile"], None)
    assert from_file == from_line
    known = plan.train_flags()
    runs_ = plan.plan_runs(from_file, known, 1, False)
    assert len(runs_) == 16 and runs_[0].name == "optimizer=ecd,bias-mode=none,seed=42,bias-per-head=true"
    assert runs_[0].flags[-4:] == ["--optimizer=ecd", "--bias-mode=none", "--seed=42", "--bias-per-head"]
    assert runs_[1].flags[-1] == "--no-bias-per-head" and all(r.problem is None for r in runs_)
    override = plan.build_spec("other", None, ["seed=7"], ["--steps=5"], toml)
    assert override.name == "other" and [a.values for a in override.axes][2] == ["7"]
    assert override.flags[-1] == "--steps=5"


def test_toml_needs_python_311_or_tomli(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(plan.GridError, match=r"Python 3\.11 or newer, or on Python 3\.10 the tomli package"):
        plan.read_toml(tmp_path / "grid.toml")


@pytest.mark.parametrize("args, message", [
    (["--axis", "lrr=1,2"], "--axis lrr: train_gpt.py has no flag --lrr (did you mean --lr?)"),
    (["--axis", "optimizer"], "--axis optimizer: write FLAG=V1,V2,..."),
    (["--axis", "run-name=a,b"], "the grid names each run after its axis values"),
    (["--axis", "compile=yes,maybe"], "--axis compile: a boolean flag takes true or false"),
    (["--axis", "seed=1,2", "--", "--stpes", "3"], "--stpes after --: train_gpt.py has no flag --stpes (did you "
                                                   "mean --steps?)"),
    (["--axis", "seed=1,2", "--", "--run-dir", "x"], "give --run-dir to the grid (before --)"),
    (["--axis", "n-head=3,5", "--", "--n-embd", "16"], "train_gpt.py refuses every run of the grid, e.g. n-head=3: "
                                                      "--n-embd 16 must be divisible by --n-head 3"),
])
def test_bad_grids_are_refused_before_anything_runs(tmp_path, capsys, args, message):
    assert main(["--name", "bad", "--run-dir", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad" / "grid.jsonl").exists()


def test_gpu_placement_one_gpu_or_torchrun_per_run_and_a_queue(tmp_path, capsys):
    base = ["--name", "p", "--run-dir", str(tmp_path), "--axis", "seed=1,2,3", "--gpus", "0,1,2,3", "--dry-run"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "slots: GPU 0, GPU 1, GPU 2, GPU 3" in out
    assert "[new] seed=1 -> GPU 0" in out and "[new] seed=3 -> GPU 2" in out
    assert "CUDA_VISIBLE_DEVICES=1 " in out
    assert main(base + ["--gpus-per-run", "2"]) == 0
    out = capsys.readouterr().out
    assert "[new] seed=2 -> GPUs 2,3" in out and "[new] seed=3 -> queued: the next free cuda slot" in out
    assert "CUDA_VISIBLE_DEVICES=2,3 " in out and "-m torch.distributed.run --standalone --nproc_per_node=2" in out


def test_the_slurm_script_gives_each_valid_run_an_array_task_that_runs_it_as_the_plan_gives_it(tmp_path, capsys):
    assert main(["--name", "paper", "--run-dir", str(tmp_path), "--axis", "optimizer=ecd,adamw", "--axis",
                 "n-head=12,5", "--gpus-per-run", "2", "--print-slurm", "--slurm-time", "24:00:00",
                 "--slurm-partition", "gpu", "--slurm-option=--constraint=h100", "--", "--steps", "10"]) == 0
    script = capsys.readouterr().out
    assert {"#SBATCH --array=0-1", "#SBATCH --gpus-per-task=2", "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue",
            "#SBATCH --open-mode=append", "#SBATCH --time=24:00:00", "#SBATCH --partition=gpu",
            "#SBATCH --constraint=h100"} <= set(script.splitlines())
    assert "# not run: optimizer=ecd,n-head=5: --n-embd 768 must be divisible by --n-head 5" in script
    path = tmp_path / "paper.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    directory = tmp_path / "paper"
    assert f'-m grid task {directory} "${{runs[$SLURM_ARRAY_TASK_ID]}}"' in script
    spec = plan.build_spec("paper", str(tmp_path), ["optimizer=ecd,adamw", "n-head=12,5"], ["--steps", "10"], None)
    valid = [r for r in plan.plan_runs(spec, plan.train_flags(), 2, True) if r.problem is None]
    assert shlex.split(re.search(r"^runs=\((.*)\)$", script, re.M).group(1)) == [r.name for r in valid]
    # what each task reads: the plan in grid.jsonl, with each run's flags; Slurm's output files go to logs/
    planned = {r["name"]: plan.PlannedRun.from_record(r) for r in Journal(directory).plan()["runs"]}
    for run in valid:
        for resume in (False, True):
            assert plan.train_command(planned[run.name], 2, resume) == plan.train_command(run, 2, resume)
    assert (directory / "logs").is_dir()


def test_a_slurm_task_trains_its_run_as_the_printed_plan_gives_it_and_then_has_nothing_to_do(tmp_path, tiny_flags,
                                                                                             capsys):
    """`python -m grid task DIR RUN`, what each array task runs, here outside Slurm: status reads the plan that
    --print-slurm wrote, the task trains its run and says so at the end of the run's log, a second task has nothing
    to do, and a task of a run the plan does not have says why in that run's log too."""
    assert main(["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1,2", "--print-slurm", "--",
                 *tiny_flags, "--steps", "2"]) == 0
    directory = tmp_path / "g"
    capsys.readouterr()
    assert main(["status", str(directory)]) == 0
    assert "grid g: 2 runs: 2 queued" in capsys.readouterr().out
    assert main(["task", str(directory), "seed=1"]) == 0
    assert read_log(directory / "seed=1")[-1]["summary"]
    assert re.fullmatch(r"=== [-\d: ]+ \S+: finished in \dm\d\ds",
                        (directory / "logs" / "seed=1.log").read_text().splitlines()[-1])
    assert main(["task", str(directory), "seed=1"]) == 0
    assert "grid: seed=1: finished: nothing to do" in capsys.readouterr().out
    assert main(["status", str(directory)]) == 0
    assert "grid g: 2 runs: 1 finished, 1 queued" in capsys.readouterr().out
    assert main(["task", str(directory), "seed=3"]) == 2
    assert f"{directory / 'grid.jsonl'}: its last plan has no run seed=3" in capsys.readouterr().err
    assert "its last plan has no run seed=3" in (directory / "logs" / "seed=3.log").read_text()


def test_what_only_reads_a_grid_imports_no_torch(tmp_path):
    """`grid status` and a Slurm task whose run has finished read the journal and the runs' logs: neither imports
    torch (or numpy), whose import takes seconds (docs/grid.md#progress)."""
    directory, name = tmp_path / "g", "seed=1"
    for folder in (name, "logs"):  # logs: made by --print-slurm
        (directory / folder).mkdir(parents=True)
    (directory / name / "log.jsonl").write_text(json.dumps({"step": 3, "train_loss": 5.0}) + "\n"
                                                + json.dumps({"step": 3, "summary": True}) + "\n")
    Journal(directory).append({"event": "start", "runs": [
        {"name": name, "values": {"seed": "1"}, "flags": ["--seed=1"], "path": str(directory / name), "steps": 3,
         "batch_tokens": 32, "stop_at_target": False, "device": "cpu", "problem": None}]})
    probe = ("import sys\nfrom grid.__main__ import main\ncode = main(sys.argv[1:])\n"
             "print('imported:', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'}))\n"
             "sys.exit(code)")
    for command, says in ((["status", str(directory)], f"{name}  finished  3/3"),
                          (["task", str(directory), name], f"grid: {name}: finished: nothing to do")):
        result = subprocess.run([sys.executable, "-c", probe, *command], cwd=ROOT, env=GRID_ENV, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert says in result.stdout and "imported: []" in result.stdout, result.stdout


def test_the_progress_table_reads_each_runs_log_and_redraws_in_place_on_a_terminal(tmp_path):
    from grid.progress import Display, progress_row, progress_table

    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "tokens": 4096 * s, "train_loss": 5.0 - s / 100, "tokens_per_s": 4096.0} for s in (50, 100)]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 101, "trai')
    row = progress_row({"name": "run", "path": str(run), "steps": 1000, "batch_tokens": 4096},
                       {"state": "running", "placement": "GPU 3"})
    assert row == ["run", "running", "100/1000", "4.0000", "4,096", "15m00s", "GPU 3"]
    lines = progress_table([row])
    assert lines[0].split() == ["run", "state", "step", "loss", "tok/s", "ETA", "device"]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    screen = Terminal()
    display = Display(screen)
    display.refresh(lines)
    display.event("grid: run: finished")
    display.refresh(lines)
    assert screen.getvalue() == ("\n".join(lines) + "\n" + "\x1b[2F\x1b[J" + "grid: run: finished\n" + "\n".join(lines)
                                 + "\n" + "\x1b[2F\x1b[J" + "\n".join(lines) + "\n")
    plain = io.StringIO()
    display = Display(plain, plain_every=3600)
    display.refresh(lines)
    display.event("grid: run: finished")
    assert plain.getvalue() == "grid: run: finished\n"  # no escape codes, the table only every --status-every s
    display.refresh(lines, force=True)
    assert plain.getvalue().endswith("\n".join(lines) + "\n") and "\x1b" not in plain.getvalue()


def test_a_runs_log_starts_with_its_header_when_the_child_writes_at_once(tmp_path, monkeypatch):
    class Quiet:  # journal and display
        def states(self) -> dict:
            return {}

        def append(self, record: dict) -> None:
            pass

        def event(self, line: str) -> None:
            pass

    def child_writes_at_once(command, stdout, **kwargs):
        os.write(stdout.fileno(), b"child output\n")
        return types.SimpleNamespace(pid=1)

    monkeypatch.setattr(execute.subprocess, "Popen", child_writes_at_once)
    run = plan.PlannedRun(name="lr=1", values={}, flags=[], path=tmp_path / "lr=1")
    scheduler = execute.Scheduler(tmp_path, "grid", [run], [], Quiet(), Quiet())
    scheduler.train(run, execute.Slot("cpu", "cpu 0", {}), resume=False)
    lines = (tmp_path / "logs" / "lr=1.log").read_text().splitlines()
    assert lines[1].startswith("=== ") and lines[2] == "child output", lines
