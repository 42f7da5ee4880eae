"""The grid's Slurm path and one run over several nodes, against a real one-node Slurm cluster (tests/slurm_cluster.py;
skipped with the reason where Slurm, munge or root is missing; `.ci/run` installs them):
- a shipped grid at the CPU scale (one of its runs), submitted with --submit (the script --print-slurm prints),
  trains its run, and the report job that waits for the array writes compare.md and scorecard.md;
- a printed grid script submitted with sbatch: a task stopped by its real time limit's warning writes a checkpoint
  and requeues itself, a task stopped by scancel writes one and stays stopped, the script submitted again skips the
  finished and the failed runs and resumes the stopped one with the losses of an uninterrupted run, and
  `grid status` names each state on the way (finished, failed, running, interrupted, queued);
- slurm/multinode.sbatch: one run whose torchrun agents meet at a rendezvous on the job's first node, stopped by
  the time limit's warning (requeued) and by scancel on one agent and resumed on two, with the losses of one
  process."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import train_gpt
from grid.execute import Journal
from tests.helpers import ENV, ROOT, held_env, tiny_args, train_losses
from tests.slurm_cluster import Cluster, free_port

pytestmark = [pytest.mark.slurm, pytest.mark.waits]

GRID = (sys.executable, "-m", "grid")


def run(cluster: Cluster, *command: str) -> subprocess.CompletedProcess:
    """A command from the repository's directory, as a user on the cluster's login node runs it."""
    done = subprocess.run(command, cwd=ROOT, env={**cluster.env, **ENV}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def status(cluster: Cluster, directory: Path) -> dict[str, str]:
    """Each run's state as `python -m grid status DIR` prints it."""
    lines = run(cluster, *GRID, "status", str(directory)).stdout.splitlines()
    runs = len(Journal(directory).plan()["runs"])
    return {line.split()[0]: line.split()[1] for line in lines[2:2 + runs]}


def flags(corpus: Path, *left_out: str, **overrides) -> list[str]:
    """tiny_args' flags without the run's directory and name (the grid and the script give those) and the flags
    `left_out` (an axis gives those)."""
    return [word for word in tiny_args(corpus, Path(), "", **overrides)
            if not word.startswith(tuple(f"--{name}=" for name in ("run-dir", "run-name", *left_out)))]


def test_a_shipped_grid_submitted_to_slurm_trains_and_its_report_job_writes_the_pages(slurm_cluster, tmp_path):
    grid = [*GRID, "--grid", "grids/table1-sgdm-at-rest.toml", "--scale", "cpu", "--axis", "seed=42", "--run-dir",
            str(tmp_path)]  # one of its two runs: the path is the same, the test half as long
    printed = run(slurm_cluster, *grid, "--print-slurm").stdout
    directory = tmp_path / "table1-sgdm-at-rest-cpu"
    # before any sbatch: the plan the tasks read, and the directory Slurm opens each task's output in
    assert (directory / "logs").is_dir() and len(Journal(directory).plan()["runs"]) == 1
    submitted = run(slurm_cluster, *grid, "--submit").stdout
    array, report = re.search(r"array job (\d+) .* as job (\d+)", submitted).groups()
    assert (directory / "grid.sbatch").read_text() == printed
    assert slurm_cluster.wait(array) == {"0": "COMPLETED"}, slurm_cluster.log()
    assert slurm_cluster.wait(report) == {report: "COMPLETED"}, \
        (directory / "logs" / f"slurm-{report}-report.log").read_text()[-3000:]
    assert "| sgdm | " in (directory / "compare.md").read_text()
    assert "every one of the 1 cells with runs is not comparable" in (directory / "scorecard.md").read_text()
    assert status(slurm_cluster, directory) == {"seed=42": "finished"}


def test_a_grid_stopped_by_its_time_limit_and_by_scancel_continues_bit_exactly_when_submitted_again(
        slurm_cluster, corpus, tmp_path, one_thread):
    shared = flags(corpus, "lr", steps=12)
    script = tmp_path / "life.sbatch"
    script.write_text(run(slurm_cluster, *GRID, "--name", "life", "--run-dir", str(tmp_path), "--axis", "seed=1,2",
                          "--axis", "lr=0.003,1e30", "--slurm-stop-before", "15", "--print-slurm", "--",
                          *shared).stdout)
    directory, stopped = tmp_path / "life", "seed=2,lr=0.003"
    output = directory / "logs" / f"{stopped}.log"

    first = slurm_cluster.sbatch(script, "--array=0-1", env=ENV)
    assert slurm_cluster.wait(first) == {"0": "COMPLETED", "1": "FAILED"}  # lr 1e30 diverges at step 2
    assert "FAILED (exit 2)" in (directory / "logs" / "seed=1,lr=1e30.log").read_text().splitlines()[-1]

    # Under a time limit of one minute, Slurm warns the task 15 s before it (--slurm-stop-before; up to 30 s
    # earlier, when its periodic check comes): the trainer, held after step 3 meanwhile, stops with a checkpoint
    # and the task requeues itself.
    task = slurm_cluster.sbatch(script, "--array=2", "--time=1", env=held_env(3)) + "_2"
    slurm_cluster.requeued(task)
    assert "SIGTERM at step 3: checkpoint written" in (directory / stopped / "log.txt").read_text()
    assert f"{stopped}: stopped before the time limit with a checkpoint; requeued" in \
        (directory / "logs" / f"slurm-{task}.log").read_text()
    assert status(slurm_cluster, directory) == {"seed=1,lr=0.003": "finished", "seed=1,lr=1e30": "failed",
                                                stopped: "interrupted", "seed=2,lr=1e30": "queued"}
    # Started now (not in the two minutes Slurm waits) and without the time limit, it resumes and holds after its
    # third step; then scancel stops it with a checkpoint.
    slurm_cluster.start_requeued(task, "TimeLimit=10")
    slurm_cluster.until(lambda: output.read_text().count("held after step 3") == 2, "the resumed run to hold", 300)
    assert status(slurm_cluster, directory)[stopped] == "running"
    slurm_cluster.run("scancel", task)
    assert slurm_cluster.wait(task) == {"2": "CANCELLED"}
    assert status(slurm_cluster, directory)[stopped] == "interrupted"

    again = slurm_cluster.sbatch(script, env=ENV)
    assert slurm_cluster.wait(again) == {"0": "COMPLETED", "1": "FAILED", "2": "COMPLETED", "3": "FAILED"}
    logs = {task: (directory / "logs" / f"slurm-{again}_{task}.log").read_text() for task in range(2)}
    assert "seed=1,lr=0.003: finished: nothing to do" in logs[0] and "failed before: skipped" in logs[1]
    assert status(slurm_cluster, directory) == {"seed=1,lr=0.003": "finished", "seed=1,lr=1e30": "failed",
                                                stopped: "finished", "seed=2,lr=1e30": "failed"}
    log = (directory / stopped / "log.txt").read_text()
    assert "resumed from step 3" in log and "SIGTERM at step 6: checkpoint written" in log
    assert "resumed from step 6" in log
    train_gpt.main([*shared, "--seed=2", "--lr=0.003", "--run-dir", str(tmp_path), "--run-name", "uninterrupted"])
    losses = train_losses(directory / stopped)
    assert sorted(losses) == list(range(1, 13)) and losses == train_losses(tmp_path / "uninterrupted")


def test_one_run_on_two_agents_of_the_multinode_script_stops_requeues_and_resumes_on_another_count(
        slurm_cluster, corpus, tmp_path, one_thread):
    script, big = ROOT / "slurm" / "multinode.sbatch", tmp_path / "big"
    shared = flags(corpus)
    env = {**ENV, "PYTHON": sys.executable, "RDZV_PORT": str(free_port())}
    output = tmp_path / "multinode.log"

    def submit(agents: int, **extra: str) -> str:
        return slurm_cluster.sbatch(script, "--nodes=1", f"--ntasks={agents}", f"--ntasks-per-node={agents}",
                                    f"--output={output}", arguments=(str(big), *shared), env={**env, **extra},
                                    cwd=ROOT)

    job = submit(1, **held_env(3, env))
    slurm_cluster.until(lambda: output.exists() and "held after step 3" in output.read_text(), "the run to hold", 300)
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job)  # what Slurm sends before the time limit
    slurm_cluster.start_requeued(job)
    slurm_cluster.until(lambda: output.read_text().count("held after step 3") == 2, "the resumed run to hold", 300)
    slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait(job) == {job: "CANCELLED"}

    job = submit(2)
    assert slurm_cluster.wait(job) == {job: "COMPLETED"}, output.read_text()[-3000:]
    node = slurm_cluster.job(job)["NodeList"]
    started = f"job {job}: 2 agents on {node}, rendezvous at {node}:{env['RDZV_PORT']}: --resume {big}"
    assert started in output.read_text()
    log = (big / "log.txt").read_text()
    assert "SIGTERM at step 3: checkpoint written" in log and "SIGTERM at step 6: checkpoint written" in log
    assert "resumed from step 6" in log and log.count("| world 1") == 2 and log.count("| world 2") == 1
    train_gpt.main([*shared, "--run-dir", str(tmp_path), "--run-name", "one"])
    single, losses = train_losses(tmp_path / "one"), train_losses(big)
    assert sorted(losses) == list(range(1, 9))
    for step in single:
        assert losses[step] == pytest.approx(single[step], rel=1e-5, abs=1e-6)
