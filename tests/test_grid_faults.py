"""python -m grid under faults (docs/grid.md#running): a killed grid leaves no trainer running on and the same command
resumes it; a run its trainer still holds is waited for, never failed nor doubled; runs trained with other flags
are not counted; bad grid files, duplicate axes, the grid's own filesystem errors and a damaged grid.jsonl give
one-line errors; the Slurm script quotes what sbatch would split, refuses a Slurm flag's value that would break it,
and --submit names sbatch's refusal, or the package that brings a missing sbatch."""
from __future__ import annotations

import errno
import json
import os
import pathlib
import shlex
import shutil
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
from tests.helpers import GRID_ENV, ROOT, started, train_tiny_run, wait_until

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
    """Each run as it stands: by its log, its trainer's lock and the journal; a run that finished but whose
    directory is gone is missing, not finished; lines of a log that are no record (damage) are passed over."""
    directory = tmp_path / "g"
    runs = {name: directory / name for name in ("done", "held", "orphaned", "failed-then-done", "deleted", "damaged")}
    journal = Journal(directory)
    directory.mkdir()
    journal.append({"event": "start", "runs": [{"name": name, "path": str(path), "steps": 3, "batch_tokens": 32}
                                               for name, path in runs.items()]})
    for name in runs:
        runs[name].mkdir()
        journal.append({"run": name, "state": "failed" if name == "failed-then-done" else "running"})
    for name in ("done", "failed-then-done", "deleted", "damaged"):
        (runs[name] / "log.jsonl").write_text(json.dumps({"step": 3, "train_loss": 5.0}) + "\n"
                                              + json.dumps({"step": 3, "summary": True}) + "\n")
    journal.append({"run": "deleted", "state": "finished"})
    shutil.rmtree(runs["deleted"])
    with open(runs["damaged"] / "log.jsonl", "a") as log:  # lines that are no record, after its summary
        log.write('[1, 2]\n{"step": 4, "train_loss": "abc", "tokens_per_s": "fast"}\n')
    lock = hold_lock(runs["held"] / ".lock", "pid 1 on host test")
    try:
        assert main(["status", str(directory)]) == 0
    finally:
        lock.close()
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines()[2:8]}
    assert {name: row[0] for name, row in rows.items()} == {
        "done": "finished", "held": "running", "orphaned": "interrupted", "failed-then-done": "finished",
        "deleted": "missing", "damaged": "finished"}
    assert rows["damaged"][1:] == ["3/3", "5.0000"]  # its last record that is one
    assert f"deleted: missing: it finished, but its directory {runs['deleted']} is gone; the grid command trains it " \
           "again" in out


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
    run = tmp_path / "g" / "seed=1"
    (run / "config.json").unlink()  # the flags its checkpoint records still tell
    assert main([*args[:6], "--dry-run", *args[6:], "--lr", "0.05"]) == 2
    assert "seed=1: --lr 0.0001 (now 0.05)" in capsys.readouterr().err
    assert main([*args[:6], "--dry-run", *args[6:]]) == 0 and "[finished] seed=1" in capsys.readouterr().out
    shutil.rmtree(run / "checkpoints")  # finished, and nothing records its flags: not this grid's run
    assert main([*args[:6], "--dry-run", *args[6:]]) == 2
    assert ("seed=1: neither a config.json nor a checkpoint records the flags it was trained with"
            in capsys.readouterr().err)


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
    assert err == (f"error: could not create the directory {tmp_path / 'ro' / 'g'}: Read-only file system (EROFS); "
                   "the filesystem is mounted read-only: choose another --run-dir, on a writable filesystem\n")


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
    assert err.rstrip().endswith("the grid stopped, and each of the 1 runs it had started stopped with a checkpoint "
                                 "where it could; the same command continues them once fixed"), err
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
             if line.startswith("#SBATCH --") and "=" in line}
    assert shlex.split(lines["#SBATCH --job-name"]) == ["grid-my grid"]  # sbatch reads quotes as the shell does
    assert shlex.split(lines["#SBATCH --output"]) == [f"{tmp_path}/50%%/my grid/logs/slurm-%A_%a.log"]


def test_a_gpu_memory_that_is_no_size_is_one_line(tmp_path, capsys):
    argv = ["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1", "--dry-run", "--gpu-memory"]
    for value in ("inf", "nan", "-1"):
        assert main([*argv, value, "--", "--device", "cpu"]) == 2
        assert capsys.readouterr().err == f"error: --gpu-memory {float(value)}: a GPU's memory in GiB, e.g. 80\n"


def test_runs_per_gpu_on_cpu_runs_is_said_to_apply_to_gpus_and_not_recorded(tmp_path, tiny_flags, capsys):
    args = ["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1", "--runs-per-gpu", "2", "--no-report",
            "--", *tiny_flags, "--steps", "1"]
    assert main(args) == 0
    assert "grid: --runs-per-gpu 2 applies to runs on GPUs; these runs are on the CPU" in capsys.readouterr().out
    assert Journal(tmp_path / "g").plan()["runs_per_gpu"] == 1
    assert main(["status", str(tmp_path / "g")]) == 0
    assert "share each GPU" not in capsys.readouterr().out


class Signalled:
    """A run's process as the scheduler sees it, recording the signals it is sent."""

    def __init__(self) -> None:
        self.pid, self.sent = 1, []

    def send_signal(self, signum: int) -> None:
        self.sent.append(signum)


def test_the_grid_passes_each_run_one_signal_and_a_second_one_only_says_it_waits(tmp_path, capfd):
    """Every signal a run gets lets it finish its step and write its checkpoint: the grid passes on the first and
    not the later ones (which the runs, already stopping, do not need)."""
    scheduler = execute.Scheduler(tmp_path, "g", [], [], Journal(tmp_path), execute.Display(live=False))
    runs = [Signalled(), Signalled()]
    scheduler.active = {i: execute.Active(None, None, run, tmp_path, 0.0) for i, run in enumerate(runs)}
    for signum in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        scheduler._on_signal(signum, None)
    assert [run.sent for run in runs] == [[signal.SIGINT], [signal.SIGINT]]
    assert scheduler.signals == [signal.SIGINT, signal.SIGINT, signal.SIGTERM]
    assert "grid: SIGTERM again: each run still finishes its step and writes its checkpoint" in capfd.readouterr().err


def test_a_report_ends_with_the_grid_process_that_started_it(tmp_path):
    """SIGKILL of the grid during its reports: each eval.report it started ends too (a parent-death signal), so
    the next grid's report never runs beside a left one. The report here is a stand-in that waits."""
    driver = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from pathlib import Path\n"
        "from grid import report\n"
        "from grid.execute import Slot\n"
        "popen = subprocess.Popen\n"
        "subprocess.Popen = lambda args, **kw: popen([sys.executable, '-c', 'import time; time.sleep(600)'], **kw)\n"
        "slot = Slot('cpu', 'CPU worker 1', {})\n"
        f"active = report.Reports(Path({str(tmp_path)!r}), [], [slot]).start(Path({str(tmp_path / 'run')!r}), slot)\n"
        "print('pid', active.process.pid, flush=True)\n"
        "time.sleep(600)\n")], cwd=ROOT, env=GRID_ENV, stdout=subprocess.PIPE, text=True)
    report_pid = int(next(line for line in driver.stdout if line.startswith("pid ")).split()[1])
    try:
        assert process_alive(report_pid)
        driver.kill()  # SIGKILL: the grid process has no say
        driver.wait()
        wait_until(lambda: not process_alive(report_pid) or zombie(report_pid), "the report to end with its grid")
    finally:
        if process_alive(report_pid) and not zombie(report_pid):
            os.kill(report_pid, signal.SIGKILL)


def test_ctrl_c_during_the_reports_reaches_each_report_once_through_the_grids_loop(tmp_path):
    """The reports run on the trainers' loop (grid.execute.SlotLoop): in sessions of their own, so a Ctrl-C reaches
    each through the grid, once, and the grid waits for them (each writes its partial page) and returns 130. The
    reports here are stand-ins that count the SIGINTs they get and exit at the first."""
    counts = tmp_path / "counts"
    stand_in = ("import os, signal, sys, time\n"
                "def got(signum, frame):\n"
                f"    with open({str(counts)!r}, 'a') as f: f.write(str(os.getpid()) + '\\n')\n"
                "    time.sleep(1)\n"  # a second SIGINT would arrive now
                "    sys.exit(130)\n"
                "signal.signal(signal.SIGINT, got)\n"
                "time.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys\n"
        "from pathlib import Path\n"
        "from grid import report\n"
        "from grid.execute import Slot\n"
        "popen = subprocess.Popen\n"
        f"subprocess.Popen = lambda args, **kw: popen([sys.executable, '-c', {stand_in!r}], **kw)\n"
        "slots = [Slot('cpu', f'CPU worker {i}', {}) for i in (1, 2)]\n"
        f"runs = [Path({str(tmp_path)!r}) / name for name in ('a', 'b', 'c')]\n"
        f"failures, code = report.report_runs(Path({str(tmp_path)!r}), runs, [], slots)\n"
        "print('code', code, len(failures), flush=True)\n")],
        cwd=ROOT, env=GRID_ENV, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in driver.stdout:  # both slots' reports started: the third waits for a free slot
        lines.append(line)
        if sum(line.startswith("grid: report ") for line in lines) == 2:
            break
    time.sleep(1)  # the stand-ins set their handlers
    driver.send_signal(signal.SIGINT)
    out, _ = driver.communicate(timeout=300)
    assert driver.returncode == 0 and "code 130 2" in out, "".join(lines) + out
    pids = counts.read_text().split()
    assert len(pids) == len(set(pids)) == 2  # each started report got one SIGINT; the third never started
    assert "report c" not in "".join(lines) + out


def zombie(pid: int) -> bool:
    """Whether `pid` has ended but is not reaped yet (its parent is gone: init reaps it soon)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def test_a_second_report_on_one_run_is_refused_naming_the_first(tmp_path):
    from eval import report as eval_report

    run = train_tiny_run(tmp_path)
    (run / "eval").mkdir(parents=True)
    first = hold_lock(run / "eval" / eval_report.REPORT_LOCK, "eval.report pid 7 on host test")
    try:
        with pytest.raises(SystemExit, match=f"error: {run / 'eval'} is in use by eval.report pid 7 on host test: "
                                             "wait for it to finish, or stop it"):
            eval_report.main(["--run", str(run), "--out", str(run / "eval"), "--skip-missing"])
    finally:
        first.close()


def test_grid_status_into_a_closed_pipe_is_one_true_line(tmp_path):
    """`python -m grid status DIR | head` where head has gone: the line says the output pipe closed, not that the
    grid directory failed."""
    directory = tmp_path / "g"
    Journal(directory).path.parent.mkdir()
    Journal(directory).append({"event": "start", "runs": [{"name": f"seed={i}", "path": str(directory / f"s{i}"),
                                                          "steps": 3, "batch_tokens": 32} for i in range(3)]})
    read, write = os.pipe()
    os.close(read)  # the reader has ended before the first line
    result = subprocess.run([sys.executable, "-m", "grid", "status", str(directory)], cwd=ROOT, env=GRID_ENV,
                            stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)
    os.close(write)
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("error: could not write to the output: the pipe it goes to was closed (a reader such as "
                             "`| head` ended before the tool did); let the output go to a terminal or a file\n")


@pytest.mark.parametrize("flag, value, message", [
    ("--slurm-account", "lab\n#SBATCH --array=0-9999", "--slurm-account 'lab\\n#SBATCH --array=0-9999': '\\n' would "
     "break the #SBATCH line"),
    ("--slurm-partition", 'gpu" --qos="high', "--slurm-partition 'gpu\" --qos=\"high': '\"' would break the #SBATCH"),
    ("--slurm-qos", "high prio", "--slurm-qos 'high prio': ' ' would break the #SBATCH line"),
    ("--slurm-option", "--comment=x#SBATCH", "--slurm-option '--comment=x#SBATCH': '#' would break the #SBATCH line"),
    ("--slurm-option", "--array=0-3", "--slurm-option --array=0-3: the grid's script sets --array itself"),
    ("--slurm-option", "constraint=h100", "--slurm-option constraint=h100: give one long sbatch option with its value"),
    ("--slurm-partition", "--qos=high", "--slurm-partition --qos=high: a value, not an option"),
    ("--slurm-time", "2h", "--slurm-time 2h: give a time limit as sbatch reads it"),
    ("--slurm-stop-before", "0", "--slurm-stop-before 0: seconds before the time limit, at least 1"),
])
def test_a_slurm_flag_whose_value_would_break_the_script_is_refused_naming_it(tmp_path, capsys, flag, value,
                                                                                message):
    for command in ("--print-slurm", "--submit"):
        assert main(["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1,2", command, f"{flag}={value}",
                     "--", "--device", "cpu"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert not (tmp_path / "g").exists()  # refused before anything is written


def test_a_slurm_flag_without_a_slurm_script_is_refused(tmp_path, capsys):
    assert main(["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1", "--slurm-time", "1:00:00"]) == 2
    assert "error: --slurm-time: a flag of the Slurm script; give it with --print-slurm or --submit\n" == \
        capsys.readouterr().err


def fake_sbatch(tmp_path: Path, monkeypatch) -> Path:
    """An sbatch first on PATH that records its arguments (one call a line in the returned file), answers job ids
    from 101 on as `sbatch --parsable` does, and refuses the partition `nope` as Slurm's sbatch does."""
    folder, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    folder.mkdir()
    (folder / "sbatch").write_text(f"""#!/bin/bash
echo "$*" >> {calls}
if grep -q -- '--partition=nope' "${{@: -1}}"; then
    echo "sbatch: error: invalid partition specified: nope" >&2
    echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2
    exit 1
fi
echo "$((100 + $(wc -l < {calls})));cluster"
""")
    (folder / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_submit_sends_the_array_then_its_report_as_a_job_that_waits_for_it(tmp_path, capsys, monkeypatch):
    calls = fake_sbatch(tmp_path, monkeypatch)
    args = ["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1,2", "--submit", "--slurm-account", "lab",
            "--quick", "--", "--device", "cpu"]
    assert main(args) == 0
    directory = tmp_path / "g"
    out = capsys.readouterr().out
    assert "2 runs submitted as Slurm array job 101" in out and "the report runs when it has ended, as job 102" in out
    assert calls.read_text().splitlines() == [f"--parsable {directory / 'grid.sbatch'}",
                                              f"--parsable --dependency=afterany:101 {directory / 'report.sbatch'}"]
    report = (directory / "report.sbatch").read_text()
    assert "#SBATCH --account=lab" in report and "#SBATCH --gpus-per-task" not in report
    assert f"-m grid report {directory} --quick" in report
    assert subprocess.run(["bash", "-n", str(directory / "report.sbatch")]).returncode == 0
    assert Journal(directory).records()[-1] | {"time": None} == {"time": None, "event": "submitted", "array": "101",
                                                                 "report": "102"}

    assert main([*args[:6], "--no-report", *args[6:]]) == 0  # the array alone
    assert calls.read_text().splitlines()[2:] == [f"--parsable {directory / 'grid.sbatch'}"]
    assert "as job 104" not in capsys.readouterr().out


def test_submit_names_sbatchs_refusal_and_a_missing_sbatch_names_the_package(tmp_path, capsys, monkeypatch):
    fake_sbatch(tmp_path, monkeypatch)
    args = ["--name", "g", "--run-dir", str(tmp_path), "--axis", "seed=1", "--submit", "--", "--device", "cpu"]
    assert main([*args[:6], "--slurm-partition", "nope", *args[6:]]) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # after the line on preparing the default data
    assert error.startswith(f"error: sbatch {tmp_path / 'g' / 'grid.sbatch'} refused it (exit 1): sbatch: error: "
                            "Batch job submission failed: Invalid partition name specified"), error
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main([*args[:2], "--run-dir", str(tmp_path / "other"), *args[4:]]) == 2
    assert capsys.readouterr().err == ("error: --submit: sbatch is not on PATH here: submit from a machine of the "
                                       "Slurm cluster, or install Slurm's client commands (Debian and Ubuntu: "
                                       "apt-get install slurm-client)\n")
    assert not (tmp_path / "other").exists()
