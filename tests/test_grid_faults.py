"""python -m grid under faults (docs/grid.md#running): a killed grid leaves no trainer running on and the same command
resumes it; a run its trainer still holds is waited for, never failed nor doubled; runs trained with other flags
are not counted; bad grid files, duplicate axes, the grid's own filesystem errors and a damaged grid.jsonl give
one-line errors; the Slurm script quotes what sbatch would split."""
from __future__ import annotations

import errno
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fileio import hold_lock, process_alive
from grid import execute
from grid.__main__ import main
from grid.execute import Journal
from run.log import read_log
from tests.helpers import GRID_ENV, ROOT, started, wait_until

pytestmark = pytest.mark.slow  # grids that train, are killed and wait for trainers: ~20 s


def states_in_order(directory: Path, run: str) -> list[str]:
    return [r["state"] for r in Journal(directory).records() if r.get("run") == run]


def test_a_killed_grid_stops_its_trainers_with_a_checkpoint_and_the_same_command_resumes_them(
        tmp_path, tiny_flags, capsys):
    args = ["--name", "gkill", "--run-dir", str(tmp_path), "--axis", "seed=1,2", "--no-report", "--", *tiny_flags,
            "--steps", "100000"]
    driver = subprocess.Popen([sys.executable, "-m", "grid", *args], cwd=ROOT, env=GRID_ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    directory, log = tmp_path / "gkill", tmp_path / "gkill" / "seed=1" / "log.jsonl"
    wait_until(lambda: log.is_file() and '"train_loss"' in log.read_text(), "the first run's first step")
    trainer = next(r["pid"] for r in Journal(directory).records() if r.get("state") == "running")
    driver.kill()  # SIGKILL: the grid process has no say
    driver.wait()
    try:
        wait_until(lambda: not process_alive(trainer), "the trainer to stop after its grid died", timeout=120)
    finally:
        if process_alive(trainer):
            os.kill(trainer, signal.SIGKILL)
    last = read_log(directory / "seed=1")[-1]
    assert not last.get("summary") and last["step"] < 100000
    assert (directory / "seed=1" / "checkpoints" / "latest.pt").is_file()

    assert main(["status", str(directory)]) == 0  # right afterwards: nothing runs it, the journal said running
    status = capsys.readouterr().out
    assert "seed=1  interrupted" in status and "no grid process is running here" in status
    assert main([*args[:6], "--dry-run", *args[6:]]) == 0
    assert "[resume] seed=1" in capsys.readouterr().out


def test_a_run_its_trainer_still_holds_is_waited_for_in_its_slot_then_trained(tmp_path, tiny_flags):
    directory = tmp_path / "held"
    (directory / "seed=1").mkdir(parents=True)
    trainer = hold_lock(directory / "seed=1" / ".lock", f"pid {os.getpid()} on host test")  # as a live trainer
    args = ["--name", "held", "--run-dir", str(tmp_path), "--axis", "seed=1,2", "--workers", "1", "--no-report",
            "--", *tiny_flags, "--steps", "2"]
    driver = subprocess.Popen([sys.executable, "-m", "grid", *args], cwd=ROOT, env=GRID_ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: any(r.get("adopted") for r in Journal(directory).records()) or driver.poll() is not None,
                 "the grid to wait for the held run")
        time.sleep(1.0)  # a second in which a grid that did not wait would start seed=2 (no event marks a non-start)
        assert driver.poll() is None and started(directory) == ["seed=1"]  # seed=2 waits: the one slot is taken
    finally:
        trainer.close()  # the trainer ends without finishing: the grid trains the run itself
    out, err = driver.communicate(timeout=600)
    assert driver.returncode == 0, out[-3000:] + err[-3000:]
    assert states_in_order(directory, "seed=1") == ["running", "interrupted", "running", "finished"]
    assert states_in_order(directory, "seed=2") == ["running", "finished"]
    assert "2 of 2 runs finished" in out


def test_status_says_how_each_run_stands_now(tmp_path, capsys):
    directory = tmp_path / "g"
    runs = {name: directory / name for name in ("done", "held", "orphaned", "failed-then-done")}
    journal = Journal(directory)
    directory.mkdir()
    journal.append({"event": "start", "runs": [{"name": name, "path": str(path), "steps": 3, "batch_tokens": 32}
                                               for name, path in runs.items()]})
    for name in runs:
        runs[name].mkdir()
        journal.append({"run": name, "state": "failed" if name == "failed-then-done" else "running"})
    for name in ("done", "failed-then-done"):
        (runs[name] / "log.jsonl").write_text(json.dumps({"step": 3, "train_loss": 5.0}) + "\n"
                                              + json.dumps({"step": 3, "summary": True}) + "\n")
    lock = hold_lock(runs["held"] / ".lock", "pid 1 on host test")
    try:
        assert main(["status", str(directory)]) == 0
    finally:
        lock.close()
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[2:6]}
    assert rows == {"done": "finished", "held": "running", "orphaned": "interrupted", "failed-then-done": "finished"}


def test_runs_trained_with_other_flags_are_not_counted_as_this_grids(tmp_path, tiny_flags, capsys):
    args = ["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1", "--no-report", "--", *tiny_flags,
            "--steps", "2"]
    assert main(args) == 0
    for extra in ([], ["--dry-run"], ["--print-slurm"]):
        capsys.readouterr()
        assert main([*args[:6], *extra, *args[6:], "--lr", "0.05", "--warmup-steps", "1"]) == 2
        err = capsys.readouterr().err
        assert "1 of the runs in" in err and "seed=1: --warmup-steps 0 (now 1), --lr 0.0001 (now 0.05)" in err
    assert started(tmp_path / "g") == ["seed=1"]
    assert main(args) == 0 and "0 to start, 0 to resume, 1 finished" in capsys.readouterr().out


@pytest.mark.parametrize("axes, message", [
    (["seed=1,2", "seed=3"], "--axis seed is given twice (seed=1,2 and seed=3): give one --axis per flag with all "
                             "its values, e.g. --axis seed=1,2,3"),
    (["seed=1,01"], "--axis seed: 1 and 01 are one value to train_gpt.py (runs seed=1 and seed=01 would train the "
                    "same configuration)"),
    (["compile=true,on"], "--axis compile: true and on are one value to train_gpt.py"),
])
def test_duplicate_axes_and_values_are_refused(tmp_path, capsys, axes, message):
    argv = ["--name", "dup", "--run-dir", str(tmp_path), "--dry-run"]
    assert main([*argv, *(word for axis in axes for word in ("--axis", axis)), "--", "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (b'name = 5\n[axes]\nseed = [1]\n', "name = 5: give a non-empty string, e.g. name = \"paper\""),
    (b'name = ["a"]\n[axes]\nseed = [1]\n', "name = ['a']: give a non-empty string"),
    (b'name = "g"\nrun_dir = 7\n[axes]\nseed = [1]\n', "run_dir = 7: give a non-empty string"),
    (b'name = "g\xff"\n[axes]\nseed = [1]\n', "not UTF-8 text (byte 0xff at offset 9)"),
    (b'name = "g"\n[axes]\nbias_mode = ["none"]\nbias-mode = ["bq"]\n',
     "[axes] names --bias-mode twice (bias_mode and bias-mode): keep one"),
    (b'name = "g"\n[axes]\nseed = 1\n', "[axes] seed = 1: give a non-empty list of strings, numbers or booleans"),
    (b'name = "g"\n[axes]\nseed = [1]\n[flags]\nsteps = [3]\n', "[flags] steps = [3]: give a string, a number"),
    (b'name = "g"\n[axes]\nseed = [1]\n[flags]\nkeep-checkpoints = true\n',
     "[flags] keep-checkpoints = true: --keep-checkpoints takes a value, not true or false"),
])
def test_bad_grid_files_are_refused_with_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "grid.toml"
    path.write_bytes(content)
    assert main(["--grid", str(path), "--run-dir", str(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_boolean_in_a_grid_file_sets_a_boolean_flag(tmp_path):
    from grid import plan

    path = tmp_path / "grid.toml"
    path.write_text('name = "g"\n[axes]\nseed = [1]\n[flags]\nkeep_checkpoints = -1\ncompile = false\n')
    assert plan.read_toml(path)["flags"] == ["--keep-checkpoints=-1", "--no-compile"]


@pytest.mark.parametrize("damage, message", [
    (b'{"event": "start", "runs": []}\n\xff\xfe\n', "line 2: bytes that are not UTF-8 text"),
    (b'[1, 2]\n', "line 1: not a JSON object"),
    (b'{"event": "start", "argv": []}\n', "line 1: a plan (\"event\": \"start\") without its runs"),
    (b'{"event": "start", "runs": [{"name": "seed=1", "steps": 3, "batch_tokens": 32}]}\n',
     "line 1: a planned run without its name, path, steps or batch_tokens"),
    (b'{"event": "start", "runs": []}\n{"run": 5, "state": "running"}\n',
     "line 2: a run's transition without the run's name and state"),
])
@pytest.mark.parametrize("command", ["status", "report"])
def test_a_damaged_journal_is_refused_naming_the_line(tmp_path, capsys, damage, message, command):
    (tmp_path / "grid.jsonl").write_bytes(damage)
    assert main([command, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'grid.jsonl'} {message}: the grid's journal is damaged" in err and err.count("\n") == 1


def test_a_line_cut_by_a_crash_is_skipped_and_the_next_record_starts_a_line_of_its_own(tmp_path, capsys):
    path = tmp_path / "g" / "grid.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"event": "start", "runs": [{"name": "seed=1", "path": str(tmp_path / "g" / "seed=1"),
                                                            "steps": 3, "batch_tokens": 32}]}) + '\n{"run": "se')
    Journal(path.parent).append({"run": "seed=1", "state": "failed", "error": "boom"})
    assert Journal(path.parent).states()["seed=1"]["state"] == "failed"
    assert main(["status", str(path.parent)]) == 0 and "seed=1: failed: boom" in capsys.readouterr().out


def test_a_read_only_run_dir_is_one_line(tmp_path, monkeypatch, capsys):
    mkdir = pathlib.Path.mkdir

    def read_only(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    assert main(["--name", "g", "--run-dir", str(tmp_path / "ro"), "--axis", "seed=1", "--", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'ro' / 'g'}: Read-only file system (EROFS);") and err.count("\n") == 1


def test_a_full_disk_under_the_journal_is_one_line_and_status_does_not_say_running(tmp_path, tiny_flags,
                                                                                       monkeypatch, capsys):
    append = Journal.append

    def disk_fills(self, record: dict) -> None:
        if record.get("state") == "finished":
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        append(self, record)

    monkeypatch.setattr(execute.Journal, "append", disk_fills)
    args = ["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1", "--no-report", "--", *tiny_flags,
            "--steps", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'g' / 'grid.jsonl'}: No space left on device (ENOSPC);" in err, err
    assert states_in_order(tmp_path / "g", "seed=1") == ["running"]  # what the journal could keep
    monkeypatch.setattr(execute.Journal, "append", append)
    assert main(["status", str(tmp_path / "g")]) == 0
    assert "grid g: 1 runs: 1 finished" in capsys.readouterr().out


def test_status_every_must_be_a_positive_number(tmp_path, capsys):
    argv = ["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1", "--dry-run", "--status-every"]
    assert main([*argv, "nan"]) == 2 and "--status-every must be a finite number, got nan" in capsys.readouterr().err
    assert main([*argv, "0"]) == 2 and "--status-every must be > 0, got 0.0" in capsys.readouterr().err


def test_the_slurm_script_quotes_a_grid_name_with_a_space(tmp_path, capsys):
    assert main(["--name", "my grid", "--run-dir", str(tmp_path / "50%"), "--axis", "seed=1,2", "--print-slurm",
                 "--", "--device", "cpu"]) == 0
    lines = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in capsys.readouterr().out.splitlines()
             if line.startswith("#SBATCH --")}
    assert shlex.split(lines["#SBATCH --job-name"]) == ["grid-my grid"]  # sbatch reads quotes as the shell does
    assert shlex.split(lines["#SBATCH --output"]) == [f"{tmp_path}/50%%/my grid/logs/slurm-%A_%a.log"]
