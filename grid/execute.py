"""Running a grid: one process at a time owns its directory (a lock), each run goes to a free slot (a GPU, N GPUs
under torchrun, or a CPU worker with its share of the cores) when its turn in the queue comes (SlotLoop, the grid's
one loop, which runs its reports too), every transition is appended to `grid.jsonl`, a failed run is reported with
the last lines of its output and never stops the others, SIGINT/SIGTERM stop every run cleanly (each writes its
checkpoint) so the same command continues, and a trainer never outlives its grid process unseen: it stops with a
checkpoint when the grid dies, and a run still held by a trainer is waited for, never started beside it
(docs/grid.md#running)."""
from __future__ import annotations

import abc
import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fileio import LockHeldError, doing, hold_lock, lock_holder, make_directory
from grid.plan import GridError, PlannedRun, train_command
from grid.progress import Display, progress_row, progress_table, run_finished, summary_line
from run.directory import run_holder, run_holds_checkpoint
from run.log import format_duration

JOURNAL = "grid.jsonl"
LOCK = ".grid.lock"
TAIL_LINES = 12  # lines of a failed run's output in the report


def claim(directory: Path):
    """Lock the grid directory for this process (released when it ends, however it ends); GridError naming the
    owner when another grid process holds it."""
    make_directory(directory)
    try:
        return hold_lock(directory / LOCK, f"grid pid {os.getpid()} on host {socket.gethostname()}")
    except LockHeldError as exc:
        raise GridError(f"{directory} is in use by {exc.holder}: wait for it to finish (`python -m grid status "
                        f"{directory}` shows it) or stop it") from None


def grid_holder(directory: Path) -> str | None:
    """Who holds the grid directory's lock (None when no grid process runs there)."""
    return lock_holder(directory / LOCK)


class Journal:
    """`grid.jsonl`: one JSON record per line, appended and flushed: each invocation's plan ("event": "start"),
    every run's transitions ("run", "state", ...) and each invocation's end."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / JOURNAL

    def append(self, record: dict) -> None:
        """Append `record` on a line of its own (after a line a crash cut short, on the next one)."""
        line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **record}) + "\n"
        with doing("append to", self.path), open(self.path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # Slurm array tasks append at once
            end = f.seek(0, os.SEEK_END)
            if end:
                f.seek(end - 1)
                line = ("" if f.read(1) == b"\n" else "\n") + line
            f.write(line.encode())

    def records(self) -> list[dict]:
        """Every record, a line a crash cut short left out; GridError naming the line where the file is damaged
        otherwise (bytes that are not UTF-8, a line that is not a JSON object, a plan without its runs)."""
        if not self.path.is_file():
            return []
        records = []
        for number, line in enumerate(self.path.read_bytes().split(b"\n"), 1):
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                raise self.damaged(number, "bytes that are not UTF-8 text") from None
            except ValueError:
                continue  # a line cut by a crash
            if problem := journal_record_problem(record):
                raise self.damaged(number, problem)
            records.append(record)
        return records

    def damaged(self, number: int, problem: str) -> GridError:
        return GridError(f"{self.path} line {number}: {problem}: the grid's journal is damaged; move it aside (the "
                         "runs' own directories keep their results) and run the grid command again")

    def states(self) -> dict[str, dict]:
        """The last transition of every run."""
        return {r["run"]: r for r in self.records() if "run" in r}

    def plan(self) -> dict:
        """The last invocation's plan record; GridError where there is none (not a grid directory)."""
        plan = next((r for r in reversed(self.records()) if r.get("event") == "start"), None)
        if plan is None:
            raise GridError(f"{self.path.parent}: no {self.path.name} here: not a grid directory")
        return plan


def journal_record_problem(record: object) -> str | None:
    """What a grid.jsonl record lacks that `status`, `report` and the next invocation read; None when complete."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if "run" in record and not (isinstance(record["run"], str) and isinstance(record.get("state"), str)):
        return "a run's transition without the run's name and state"
    if record.get("event") == "start":
        runs = record.get("runs")
        if not isinstance(runs, list):
            return "a plan (\"event\": \"start\") without its runs"
        for run in runs:
            if not (isinstance(run, dict) and isinstance(run.get("name"), str) and isinstance(run.get("path"), str)
                    and isinstance(run.get("steps"), int) and isinstance(run.get("batch_tokens"), int)):
                return "a planned run without its name, path, steps or batch_tokens"
    return None


@dataclass
class Slot:
    """Where one run at a time trains: `kind` "cuda" or "cpu", its label and the environment it sets."""

    kind: str
    label: str
    env: dict[str, str]
    processes: int = 1


def make_slots(gpus: list[str], gpus_per_run: int, workers: int, cpus: int, kinds: set[str],
               runs_per_gpu: int = 1) -> list[Slot]:
    """For the kinds of run the grid has ("cuda", "cpu"): `runs_per_gpu` slots on each group of `gpus_per_run`
    consecutive GPUs (CUDA_VISIBLE_DEVICES; labelled "GPU 0 #2" when runs share it; in the order that fills every GPU
    once before any twice), and `workers` CPU slots; the cores divided between every process (OMP_NUM_THREADS)."""
    groups = [gpus[i:i + gpus_per_run] for i in range(0, len(gpus) - gpus_per_run + 1, gpus_per_run)]
    groups = groups if "cuda" in kinds else []
    workers = workers if "cpu" in kinds else 0
    processes = len(groups) * gpus_per_run * runs_per_gpu + workers
    threads = str(max(1, cpus // max(processes, 1)))
    share = [f" #{k + 1}" for k in range(runs_per_gpu)] if runs_per_gpu > 1 else [""]
    slots = [Slot("cuda", ("GPU " if len(g) == 1 else "GPUs ") + ",".join(g) + mark,
                  {"CUDA_VISIBLE_DEVICES": ",".join(g), "OMP_NUM_THREADS": threads}, gpus_per_run)
             for mark in share for g in groups]
    slots += [Slot("cpu", f"CPU worker {i + 1}", {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": threads})
              for i in range(workers)]
    return slots


def initial_state(run: PlannedRun, previous: dict, retry_failed: bool) -> str:
    """What a run needs now: invalid (its flags are refused), finished, held (a trainer still runs it, one that a
    grid process which ended left behind: the grid waits for it), failed (an earlier attempt failed; skipped without
    --retry-failed), resume (it holds a checkpoint) or new."""
    if run.problem is not None:
        return "invalid"
    if run_finished(run.path, run.steps, run.stop_at_target):
        return "finished"
    if run_holder(run.path):
        return "held"
    if previous.get("state") == "failed" and not retry_failed:
        return "failed"
    return "resume" if run_holds_checkpoint(run.path) else "new"


def current_state(run: dict, last: dict, grid_running: bool) -> str:
    """A planned run's state (`run`: its record in the plan; `last`: its last transition) as it stands now:
    finished when its log says so, missing when the journal says finished but the run's directory is gone, running
    while its trainer holds it, interrupted where the journal says running but neither a trainer nor a grid process
    runs it (the grid process was killed, or could not write the end); otherwise the journal's."""
    state = last.get("state", "invalid" if run.get("problem") else "queued")
    if run_finished(Path(run["path"]), run["steps"], run.get("stop_at_target", False)):
        return "finished"
    if state == "finished" and not Path(run["path"]).is_dir():
        return "missing"
    if run_holder(Path(run["path"])):
        return "running"
    return "interrupted" if state == "running" and not grid_running else state


def stop_with_grid() -> Callable[[], None] | None:
    """For Popen's preexec_fn on Linux: the child gets SIGTERM when the grid process dies, however it dies
    (prctl PR_SET_DEATHSIG), so a trainer whose grid was killed stops at the end of its step with a checkpoint,
    as on Ctrl-C. None elsewhere: there the next invocation waits for such a trainer (initial_state's held)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl, grid = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()
    pr_set_deathsig = 1

    def arm() -> None:
        prctl(pr_set_deathsig, signal.SIGTERM)
        if os.getppid() != grid:  # the grid died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


class LeftTrainer:
    """A trainer that an earlier grid process started and left running: polled through its run directory's lock,
    signalled through its pid when it runs on this host (the Popen-like part the scheduler uses)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        self.path, self.pid = path, pid

    def poll(self) -> int | None:
        return None if run_holder(self.path) else 0

    def send_signal(self, signum: int) -> None:
        if self.pid is not None and self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.25)
        return 0


def output_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last lines of a run's output (progress bars' carriage returns as line ends)."""
    try:
        text = path.read_bytes()[-65536:].decode(errors="replace")
    except OSError:
        return ""
    kept = [line.rstrip() for line in text.replace("\r", "\n").split("\n") if line.strip()]
    return "\n".join(kept[-lines:])


@dataclass
class Active:
    """A process the loop started on a slot: a run's trainer (or one it waits for) or a finished run's report."""

    run: PlannedRun | Path
    slot: Slot
    process: subprocess.Popen | LeftTrainer
    output: Path
    started: float


class SlotLoop(abc.ABC):
    """The grid's one loop (docs/grid.md#running): each free slot takes the next queued item that `fits` it, which
    `start` starts there; an item whose process has exited goes to `finish`, which may queue items again. The first
    SIGINT/SIGTERM is passed to every process (each finishes its work and exits: a trainer its step and checkpoint,
    docs/runs.md#signals, a report its page) and nothing starts after it; a later one is not passed on again.
    Subclasses say what an item is: the Scheduler's runs, grid.report's reports."""

    POLL_S = 0.25  # between two looks at the processes
    STOPPING = "each process still finishes its work"  # what a second signal is told

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.active: dict[int, Active] = {}
        self.signals: list[int] = []

    @abc.abstractmethod
    def start(self, item, slot: Slot) -> Active:
        """Start the queued `item` on `slot`."""

    @abc.abstractmethod
    def finish(self, active: Active, code: int) -> list:
        """Record how `active` ended (exit status `code`); the items to queue again, first."""

    def fits(self, item, slot: Slot) -> bool:
        return True

    def refresh(self, force: bool = False) -> None:
        """Show where the queue stands (each pass, and at the end with `force`)."""

    def _on_signal(self, signum: int, frame) -> None:
        self.signals.append(signum)
        if len(self.signals) > 1:  # os.write: safe in a handler, which may interrupt a print
            os.write(2, f"grid: {signal.Signals(signum).name} again: {self.STOPPING}; the grid waits for them\n"
                     .encode())
            return
        for active in list(self.active.values()):
            with contextlib.suppress(ProcessLookupError):
                active.process.send_signal(signum)

    def run(self, queue: list) -> int:
        """Run every item of `queue`, in order as slots free; 0, or 128 + the signal that stopped the loop. On an
        error of the loop itself every process it started is stopped (SIGTERM) and waited for."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while queue or self.active:
                for index, slot in enumerate(self.slots):
                    if self.signals or index in self.active:
                        continue
                    if (pick := next((item for item in queue if self.fits(item, slot)), None)) is not None:
                        queue.remove(pick)
                        self.active[index] = self.start(pick, slot)
                for index, active in list(self.active.items()):
                    if (code := active.process.poll()) is not None:
                        del self.active[index]
                        queue[:0] = self.finish(active, code)
                if self.signals and all(active.process.pid is None for active in self.active.values()):
                    break  # every process of ours has stopped (a trainer left on another host is not ours to stop)
                self.refresh()
                time.sleep(self.POLL_S)
        finally:
            for active in self.active.values():
                if active.process.pid is not None:
                    active.process.send_signal(signal.SIGTERM)
                    active.process.wait()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.refresh(force=True)
        return 128 + self.signals[0] if self.signals else 0


class Scheduler(SlotLoop):
    """Runs the queue of a grid's runs on the SlotLoop: each free slot takes the next run of its kind; transitions
    go to the journal and the display."""

    STOPPING = "each run still finishes its step and writes its checkpoint"

    def __init__(self, directory: Path, name: str, runs: list[PlannedRun], slots: list[Slot], journal: Journal,
                 display: Display) -> None:
        super().__init__(slots)
        self.directory, self.name, self.runs = directory, name, runs
        self.journal, self.display = journal, display
        self.states = {run.name: dict(journal.states().get(run.name, {})) for run in runs}
        self.started = time.time()
        self.launched = 0  # runs this process started or waited for

    def transition(self, run: PlannedRun, state: str, line: str | None = None, **fields) -> None:
        self.states[run.name] = {"state": state, **fields}
        self.journal.append({"run": run.name, "state": state, **fields})
        if line:
            self.display.event(f"grid: {run.name}: {line}")

    def rows(self) -> list[str]:
        lines = progress_table([progress_row(r.record(), self.states.get(r.name, {})) for r in self.runs])
        return [summary_line(self.name, [self.states.get(r.name, {}).get("state", "queued") for r in self.runs],
                             self.started)] + lines

    def start(self, item: tuple[PlannedRun, str], slot: Slot) -> Active:
        run, state = item
        return self.adopt(run, slot) if state == "held" else self.train(run, slot, state == "resume")

    def train(self, run: PlannedRun, slot: Slot, resume: bool) -> Active:
        """Start the run's trainer in `slot` (resuming it from its checkpoint), its output appended to its log."""
        command = train_command(run, slot.processes if slot.kind == "cuda" else 1, resume)
        output = self.directory / "logs" / f"{run.name}.log"
        make_directory(output.parent)
        with open(output, "ab") as f:
            f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {slot.label}: {' '.join(command)}\n".encode())
            f.flush()  # the child appends through its own copy of the descriptor: the header goes first
            process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=stop_with_grid(),
                                       env={**os.environ, **slot.env, "PYTHONUNBUFFERED": "1"})
        self.launched += 1
        try:
            self.transition(run, "running", f"{'resumed' if resume else 'started'} on {slot.label} (pid "
                            f"{process.pid})", placement=slot.label, pid=process.pid, host=socket.gethostname(),
                            resume=resume, command=command)
        except BaseException:  # the journal cannot be written (a full disk): no run goes on unrecorded
            process.send_signal(signal.SIGTERM)
            process.wait()
            raise
        return Active(run, slot, process, output, time.time())

    def adopt(self, run: PlannedRun, slot: Slot) -> Active:
        """Wait in `slot` for the trainer an earlier grid process left running on `run` (its pid is signalled
        with the others when it runs on this host)."""
        last = self.states.get(run.name, {})
        pid = last.get("pid") if last.get("host") == socket.gethostname() else None
        self.launched += 1
        self.transition(run, "running", f"its trainer still runs ({run_holder(run.path)}; an earlier grid process "
                        f"started it): waiting for it on {slot.label}", placement=slot.label, pid=pid,
                        host=last.get("host"), adopted=True)
        return Active(run, slot, LeftTrainer(run.path, pid), self.directory / "logs" / f"{run.name}.log",
                      time.time())

    def record_outcome(self, active: Active, code: int) -> None:
        """Record how the run's attempt ended (finished, interrupted or failed), in the journal and on the display,
        and on a last line of the run's output file, so that its own log says it too."""
        run, took = active.run, format_duration(time.time() - active.started)
        if run_finished(run.path, run.steps, run.stop_at_target):
            verdict = f"finished in {took}"
            self.transition(run, "finished", verdict, placement=active.slot.label, rc=code)
        elif isinstance(active.process, LeftTrainer) or self.signals or code in (
                128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM):
            kept = "checkpoint kept" if run_holds_checkpoint(run.path) else "no checkpoint yet: it starts again"
            how = "its trainer stopped" if isinstance(active.process, LeftTrainer) else f"exit {code}"
            verdict = f"interrupted after {took} ({how}; {kept})"
            self.transition(run, "interrupted", verdict, placement=active.slot.label, rc=code)
        else:
            tail = output_tail(active.output)
            verdict = f"FAILED (exit {code}) after {took}"
            self.transition(run, "failed", f"{verdict}; output {active.output}, ending:\n"
                            + "\n".join("    " + line for line in tail.splitlines()),
                            placement=active.slot.label, rc=code, error=tail)
        active.output.parent.mkdir(parents=True, exist_ok=True)  # an adopted run's trainer may have written none
        with open(active.output, "a") as f:
            f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {active.slot.label}: {verdict}\n")

    def finish(self, active: Active, code: int) -> list[tuple[PlannedRun, str]]:
        """record_outcome; a trainer waited for that stopped before the end is queued again, to resume."""
        self.record_outcome(active, code)
        if isinstance(active.process, LeftTrainer) and not self.signals \
                and self.states[active.run.name]["state"] == "interrupted":
            return [(active.run, "resume" if run_holds_checkpoint(active.run.path) else "new")]
        return []

    def refresh(self, force: bool = False) -> None:
        self.display.refresh(self.rows(), force=force)

    def fits(self, item: tuple[PlannedRun, str], slot: Slot) -> bool:
        """Whether `slot` takes the queued (run, state): one of its kind; a held run's trainer already runs in the
        slot it was placed in (when this grid has a slot of that label)."""
        run, state = item
        placed = self.states.get(run.name, {}).get("placement")
        return run.device == slot.kind and (state != "held" or placed == slot.label
                                            or placed not in {s.label for s in self.slots})

    def execute(self, todo: list[tuple[PlannedRun, str]]) -> int:
        """Train every (run, state) of `todo` (state: new, resume, or held, which is waited for first and resumed
        when its trainer stopped before the end); returns 0, or 128 + the signal that stopped the grid."""
        return self.run(sorted(todo, key=lambda item: item[1] != "held"))
