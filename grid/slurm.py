"""A grid on a Slurm cluster (docs/grid.md#on-a-slurm-cluster): the job-array script, one task per run, with the
options every cluster needs passed through and checked; its submission, with the report as a job that waits for
the array; and what each array task runs, `python -m grid task DIR RUN`: the run trained or resumed by the grid's
own scheduler (grid.jsonl, the run's log in DIR/logs, signals passed on), and requeued when the time limit's
warning stopped it with a checkpoint."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from cli import option
from fileio import LockHeldError, atomic_write, hold_lock, lock_holder
from grid.execute import Journal, Scheduler, Slot, initial_state
from grid.plan import TRAIN_SCRIPT, GridError, GridSpec, PlannedRun
from grid.progress import Display

# Slurm's warning before a task's time limit (#SBATCH --signal=B:USR1@SECONDS): the task stops its run with a
# checkpoint and requeues itself. A cancellation (scancel) sends SIGTERM: the run stops with a checkpoint and stays
# stopped until the script is submitted again.
TIME_LIMIT_SIGNAL = signal.SIGUSR1
ARRAY_SCRIPT, REPORT_SCRIPT = "grid.sbatch", "report.sbatch"
# sbatch options the script sets itself (the grid's logs, the array, the warning signal)
OWN_OPTIONS = ("--array", "--output", "--error", "--open-mode", "--signal")
UNSAFE = re.compile(r"[\s\"'`\\#]|[^\x20-\x7e]")  # what would end or split an #SBATCH line, or start a comment
TIME = re.compile(r"(?:\d+-)?\d+(?::\d+){0,2}|infinite|unlimited", re.IGNORECASE)  # sbatch --time's formats


def sbatch_quote(value: str) -> str:
    """`value` as one argument of an #SBATCH line: sbatch splits those lines at whitespace outside quotes and
    reads a backslash as an escape, also inside quotes."""
    if not re.search(r'[\s"\'\\#]', value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class SlurmOptions:
    """The grid's Slurm flags (--slurm-FIELD): each task's time limit, partition, account and QoS (each the
    `#SBATCH` option its metadata names), other #SBATCH options, and how long before the time limit Slurm warns a
    task (which then stops its run with a checkpoint and requeues itself)."""

    time: str | None = field(default=None, metadata={"sbatch": "--time"})
    partition: str | None = field(default=None, metadata={"sbatch": "--partition"})
    account: str | None = field(default=None, metadata={"sbatch": "--account"})
    qos: str | None = field(default=None, metadata={"sbatch": "--qos"})
    option: list[str] = field(default_factory=list)
    stop_before: int = 300

    @classmethod
    def from_args(cls, args) -> SlurmOptions:
        """The options of the grid's parsed flags; GridError naming the flag whose value would break the script."""
        options = cls(**{f.name: getattr(args, f"slurm_{f.name}") for f in fields(cls)})
        for f in fields(cls):
            given = getattr(options, f.name)
            for value in given if isinstance(given, list) else [given] if isinstance(given, str) else []:
                if problem := option_problem(option(f"slurm_{f.name}"), value):
                    raise GridError(problem)
        if options.time is not None and not TIME.fullmatch(options.time):
            raise GridError(f"--slurm-time {options.time}: give a time limit as sbatch reads it: MINUTES, "
                            "HOURS:MINUTES:SECONDS or DAYS-HOURS[:MINUTES[:SECONDS]], e.g. 24:00:00")
        if options.stop_before < 1:
            raise GridError(f"--slurm-stop-before {options.stop_before}: seconds before the time limit, at least 1 "
                            "(long enough for a step and a checkpoint), e.g. 300")
        return options

    def lines(self) -> list[str]:
        """The #SBATCH lines of these options (the warning signal's is the array's own)."""
        return [f"#SBATCH {f.metadata['sbatch']}={getattr(self, f.name)}" for f in fields(self)
                if "sbatch" in f.metadata and getattr(self, f.name) is not None] \
            + [f"#SBATCH {line}" for line in self.option]


def option_problem(flag: str, value: str) -> str | None:
    """Why `value` of the Slurm flag `flag` cannot go on an #SBATCH line (None when it can): a quote, a backslash,
    whitespace, a line break, a `#`; for --slurm-option also a value that is not one long sbatch option, or one the
    script sets itself."""
    if match := UNSAFE.search(value):
        return (f"{flag} {value!r}: {match.group()!r} would break the #SBATCH line (quotes, backslashes, "
                "whitespace, line breaks and # are refused); give one plain value"
                + (" per --slurm-option, e.g. --slurm-option=--constraint=h100" if flag == "--slurm-option" else ""))
    if not value:
        return f"{flag}: an empty value; give one or leave the flag out"
    if flag == "--slurm-option":
        name = value.partition("=")[0]
        if not re.fullmatch(r"--[a-z][a-z0-9-]*", name):
            return (f"--slurm-option {value}: give one long sbatch option with its value, e.g. "
                    "--slurm-option=--constraint=h100 (write it with =: --slurm-option=--OPTION=VALUE)")
        if name in OWN_OPTIONS:
            return (f"--slurm-option {value}: the grid's script sets {name} itself "
                    f"({', '.join(OWN_OPTIONS)}: the array, its logs and the time limit's warning)")
    elif value.startswith("-"):
        return f"{flag} {value}: a value, not an option; e.g. {flag} gpu"
    return None


def array_script(spec: GridSpec, runs: list[PlannedRun], gpus_per_run: int, options: SlurmOptions,
                 retry_failed: bool) -> str:
    """A Slurm job-array script with one task per valid run. Every task runs `python -m grid task DIR RUN`, which
    skips a finished run, resumes one that holds a checkpoint and trains a new one, as the grid command does."""
    valid = [r for r in runs if r.problem is None]
    directory = spec.directory.absolute()
    output = str(directory / "logs").replace("%", "%%") + "/slurm-%A_%a.log"  # %% is sbatch's %
    lines = ["#!/bin/bash",
             f"# Grid {spec.name}: {len(valid)} runs, one array task each (docs/grid.md#on-a-slurm-cluster). Submit it",
             "# with sbatch, and again to continue: finished runs are skipped, stopped ones resumed.",
             f"# DIR={shlex.quote(str(directory))} (`python -m grid status DIR`); each task's output goes to",
             "# DIR/logs/slurm-<job>_<task>.log, its trainer's to DIR/logs/<run>.log.",
             f"#SBATCH --job-name={sbatch_quote('grid-' + spec.name)}",
             f"#SBATCH --array=0-{max(len(valid) - 1, 0)}",
             f"#SBATCH --output={sbatch_quote(output)}",
             "#SBATCH --open-mode=append",
             "#SBATCH --ntasks=1"]
    lines += [f"#SBATCH --gpus-per-task={gpus_per_run}"] if any(r.device == "cuda" for r in valid) else []
    lines += [f"#SBATCH --signal=B:{TIME_LIMIT_SIGNAL.name[3:]}@{options.stop_before}", "#SBATCH --requeue",
              *options.lines()]
    lines += [f"# not run: {r.name}: {r.problem}" for r in runs if r.problem is not None]
    task = ["-m", "grid", "task", str(directory)]
    lines += ["set -euo pipefail", f"cd {shlex.quote(str(TRAIN_SCRIPT.parent))}",
              f'PYTHON="${{PYTHON:-{shlex.quote(sys.executable)}}}"',
              "runs=(" + " ".join(shlex.quote(r.name) for r in valid) + ")",
              'exec "$PYTHON" ' + shlex.join(task) + ' "${runs[$SLURM_ARRAY_TASK_ID]}"'
              + " --retry-failed" * retry_failed, ""]
    return "\n".join(lines)


def report_script(spec: GridSpec, uses_gpus: bool, options: SlurmOptions, budget: list[str]) -> str:
    """The job that reports and compares the grid's finished runs (`python -m grid report DIR`) once the array has
    ended, on one GPU when the runs train on GPUs."""
    directory = spec.directory.absolute()
    output = str(directory / "logs").replace("%", "%%") + "/slurm-%j-report.log"
    lines = ["#!/bin/bash", f"# The report of grid {spec.name}, submitted to run when its array has ended.",
             f"#SBATCH --job-name={sbatch_quote('grid-' + spec.name + '-report')}",
             f"#SBATCH --output={sbatch_quote(output)}", "#SBATCH --ntasks=1"]
    lines += ["#SBATCH --gpus-per-task=1"] if uses_gpus else []
    lines += [*options.lines(), "set -euo pipefail", f"cd {shlex.quote(str(TRAIN_SCRIPT.parent))}",
              f'exec "${{PYTHON:-{shlex.quote(sys.executable)}}}" '
              + shlex.join(["-m", "grid", "report", str(directory), *budget]), ""]
    return "\n".join(lines)


def sbatch_command() -> str:
    """Where sbatch is; GridError naming the package that brings it when it is not on PATH."""
    command = shutil.which("sbatch")
    if command is None:
        raise GridError("--submit: sbatch is not on PATH here: submit from a machine of the Slurm cluster, or install "
                        "Slurm's client commands (Debian and Ubuntu: apt-get install slurm-client)")
    return command


def sbatch(script: Path, *options: str) -> str:
    """Submit `script` (sbatch --parsable) and return its job id; GridError with sbatch's own message when sbatch
    is missing or refuses it."""
    done = subprocess.run([sbatch_command(), "--parsable", *options, str(script)], capture_output=True, text=True)
    if done.returncode:
        said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise GridError(f"sbatch {script} refused it (exit {done.returncode}): "
                        + (said[-1] if said else "no message") + "; the script is kept there")
    return done.stdout.strip().split(";")[0]


def submit(spec: GridSpec, array_text: str, report_text: str | None) -> tuple[str, str | None]:
    """Write the array's script (and the report's) into the grid directory and submit them, the report to start
    when the array has ended however its tasks ended (--dependency=afterany); (array job id, report job id)."""
    scripts = spec.directory / ARRAY_SCRIPT, spec.directory / REPORT_SCRIPT
    atomic_write(scripts[0], array_text.encode())
    array = sbatch(scripts[0])
    if report_text is None:
        return array, None
    atomic_write(scripts[1], report_text.encode())
    return array, sbatch(scripts[1], f"--dependency=afterany:{array}")


def task_label() -> str:
    """Where this task runs, for the journal and the logs: `Slurm job 12_3 on HOST` (array job and task)."""
    job = (f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
           if "SLURM_ARRAY_TASK_ID" in os.environ else os.environ.get("SLURM_JOB_ID"))
    return (f"Slurm job {job} on " if job else "") + socket.gethostname()


def note_in_run_log(directory: Path, name: str, line: str) -> None:
    """Append `=== TIME WHERE: line` to the run's own log (DIR/logs/RUN.log), where the grid's attempts are."""
    path = directory / "logs" / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {task_label()}: {line}\n")


def task_lock(directory: Path, name: str) -> Path:
    """The lock a task holds on its run while it runs (status counts the run as running; a second task skips it)."""
    return directory / "logs" / f".{name}.task.lock"


def task_holder(directory: Path, name: str) -> str | None:
    """Who runs the run `name` of the grid in `directory` as a task (None when no task does)."""
    return lock_holder(task_lock(directory, name))


def planned_run(journal: Journal, name: str) -> tuple[PlannedRun, dict]:
    """The run `name` as the journal's last plan keeps it, and that plan; GridError when the plan lacks it."""
    plan = journal.plan()
    record = next((r for r in plan["runs"] if r["name"] == name), None)
    if record is None:
        raise GridError(f"{journal.path}: its last plan has no run {name}")
    if "flags" not in record:
        raise GridError(f"{journal.path}: its plan does not keep the runs' flags (an older grid wrote it): print the "
                        "Slurm script again (python -m grid ... --print-slurm) and submit that")
    return PlannedRun.from_record(record), plan


def run_task(directory: Path, name: str, retry_failed: bool) -> int:
    """One array task: train, resume or skip the run `name` of the grid in `directory` as the last plan in its
    grid.jsonl gives it, as the grid command would (the same journal, log and signals). When Slurm's warning
    before the time limit arrives, the run stops with a checkpoint and the task requeues itself. Returns 0 when
    the run has finished (or another task runs it), 128 + the signal when one stopped it, 1 when it failed (now or
    before)."""
    journal = Journal(directory)
    run, plan = planned_run(journal, name)
    try:
        lock = hold_lock(task_lock(directory, name), f"grid task pid {os.getpid()} ({task_label()})")
    except LockHeldError as exc:
        print(f"grid: {name}: another task runs it ({exc.holder}): nothing to do here", flush=True)
        return 0
    warned = []

    def time_limit_near(signum: int, frame) -> None:  # stop as on SIGTERM, which the scheduler passes on
        warned.append(signum)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(TIME_LIMIT_SIGNAL, time_limit_near)
    try:
        state = initial_state(run, journal.states().get(name, {}), retry_failed)
        if state in ("finished", "failed", "invalid"):
            print(f"grid: {name}: {state}" + {"finished": ": nothing to do",
                                              "failed": " before: skipped (--retry-failed runs it again)",
                                              "invalid": f": {run.problem}"}[state], flush=True)
            return 0 if state == "finished" else 1
        slot = Slot(run.device, task_label(), {}, plan.get("gpus_per_run", 1))
        scheduler = Scheduler(directory, directory.name, [run], [slot], journal, Display(plain_every=600))
        before = checkpoint_written(run)
        code = scheduler.execute([(run, state)])
        outcome = scheduler.states[name]["state"]
        if warned and outcome == "interrupted":
            requeue(run, progressed=checkpoint_written(run) != before)
        return code or (0 if outcome == "finished" else 1)
    finally:
        signal.signal(TIME_LIMIT_SIGNAL, previous)
        lock.close()


def checkpoint_written(run: PlannedRun) -> int | None:
    """When the run's checkpoints/latest.pt was last written (ns; None before the first)."""
    try:
        return (run.path / "checkpoints" / "latest.pt").stat().st_mtime_ns
    except FileNotFoundError:
        return None


def requeue(run: PlannedRun, progressed: bool) -> None:
    """Put this task back in Slurm's queue (scontrol requeue) when this attempt wrote a checkpoint: it starts
    again, resuming from it, once Slurm lets it (Slurm holds a requeued job for about two minutes). A task whose
    run wrote none would start where it did and meet the same time limit again: it is not requeued."""
    job, scontrol = os.environ.get("SLURM_JOB_ID"), shutil.which("scontrol")
    if not progressed:
        why = "it wrote no checkpoint before the warning: give the tasks more time (--slurm-time)"
    elif job is None or scontrol is None:
        why = "not a Slurm job" if job is None else "no scontrol on PATH"
    elif (done := subprocess.run([scontrol, "requeue", job], capture_output=True, text=True)).returncode:
        why = f"scontrol requeue {job}: {(done.stderr or done.stdout).strip()}"
    else:
        print(f"grid: {run.name}: stopped before the time limit with a checkpoint; requeued as job {job}, which "
              "resumes it", flush=True)
        return
    print(f"grid: {run.name}: stopped by the warning before the time limit, not requeued ({why}); submitting the "
          "script again continues it", file=sys.stderr, flush=True)
