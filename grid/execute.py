"""Running a grid: one process at a time owns its directory (a lock), each run goes to a free slot (a GPU, N GPUs
under torchrun, or a CPU worker with its share of the cores) when its turn in the queue comes, every transition is
appended to `grid.jsonl`, a failed run is reported with the last lines of its output and never stops the others,
and SIGINT/SIGTERM stop every run cleanly (each writes its checkpoint) so the same command continues
(docs/grid.md#running)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from fileio import LockHeldError, hold_lock, lock_holder
from grid.plan import GridError, Run, train_command
from grid.progress import Display, run_finished, run_row, summary_line, table
from run.directory import run_holds_checkpoint
from run.log import format_duration

JOURNAL = "grid.jsonl"
LOCK = ".grid.lock"
TAIL_LINES = 12  # lines of a failed run's output in the report


def claim(directory: Path):
    """Lock the grid directory for this process (released when it ends, however it ends); GridError naming the
    owner when another grid process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        return hold_lock(directory / LOCK, f"grid pid {os.getpid()} on host {socket.gethostname()}")
    except LockHeldError as exc:
        raise GridError(f"{directory} is in use by {exc.holder}: wait for it to finish (`python -m grid status "
                        f"{directory}` shows it) or stop it") from None


def owner(directory: Path) -> str | None:
    """Who holds the grid directory's lock (None when no grid process runs there)."""
    return lock_holder(directory / LOCK)


class Journal:
    """`grid.jsonl`: one JSON record per line, appended and flushed: each invocation's plan ("event": "start"),
    every run's transitions ("run", "state", ...) and each invocation's end."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / JOURNAL

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **record}) + "\n")

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a crash
        return records

    def states(self) -> dict[str, dict]:
        """The last transition of every run."""
        return {r["run"]: r for r in self.records() if "run" in r}

    def plan(self) -> dict:
        """The last invocation's plan record; GridError where there is none (not a grid directory)."""
        plan = next((r for r in reversed(self.records()) if r.get("event") == "start"), None)
        if plan is None:
            raise GridError(f"{self.path.parent}: no {self.path.name} here: not a grid directory")
        return plan


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


def initial_state(run: Run, previous: dict, retry_failed: bool) -> str:
    """What a run needs now: invalid (its flags are refused), finished, failed (an earlier attempt failed; skipped
    without --retry-failed), resume (it holds a checkpoint) or new."""
    if run.problem is not None:
        return "invalid"
    if run_finished(run.path, run.steps, run.stop_at_target):
        return "finished"
    if previous.get("state") == "failed" and not retry_failed:
        return "failed"
    return "resume" if run_holds_checkpoint(run.path) else "new"


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
    run: Run
    slot: Slot
    process: subprocess.Popen
    output: Path
    started: float


class Scheduler:
    """Runs the queue of a grid: each free slot takes the next run of its kind; transitions go to the journal and
    the display; the first SIGINT/SIGTERM is passed to every run (each checkpoints and exits), a second one again
    (each stops at once)."""

    def __init__(self, directory: Path, name: str, runs: list[Run], slots: list[Slot], journal: Journal,
                 display: Display) -> None:
        self.directory, self.name, self.runs, self.slots = directory, name, runs, slots
        self.journal, self.display = journal, display
        self.states = {run.name: dict(journal.states().get(run.name, {})) for run in runs}
        self.active: dict[int, Active] = {}
        self.signals: list[int] = []
        self.started = time.time()

    def transition(self, run: Run, state: str, line: str | None = None, **fields) -> None:
        self.states[run.name] = {"state": state, **fields}
        self.journal.append({"run": run.name, "state": state, **fields})
        if line:
            self.display.event(f"grid: {run.name}: {line}")

    def rows(self) -> list[str]:
        lines = table([run_row(r.record(), self.states.get(r.name, {})) for r in self.runs])
        return [summary_line(self.name, [self.states.get(r.name, {}).get("state", "queued") for r in self.runs],
                             self.started)] + lines

    def _on_signal(self, signum: int, frame) -> None:
        self.signals.append(signum)
        for active in list(self.active.values()):
            try:
                active.process.send_signal(signum if len(self.signals) == 1 else signal.SIGINT)
            except ProcessLookupError:
                pass

    def start(self, run: Run, slot: Slot, resume: bool) -> Active:
        command = train_command(run, slot.processes if slot.kind == "cuda" else 1, resume)
        output = self.directory / "logs" / f"{run.name}.log"
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(output, "ab") as f:
            f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {slot.label}: {' '.join(command)}\n".encode())
            f.flush()  # the child appends through its own copy of the descriptor: the header goes first
            process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                       env={**os.environ, **slot.env, "PYTHONUNBUFFERED": "1"})
        self.transition(run, "running", f"{'resumed' if resume else 'started'} on {slot.label} (pid {process.pid})",
                        placement=slot.label, pid=process.pid, resume=resume, command=command)
        return Active(run, slot, process, output, time.time())

    def settle(self, active: Active, code: int) -> None:
        run, took = active.run, format_duration(time.time() - active.started)
        if run_finished(run.path, run.steps, run.stop_at_target):
            self.transition(run, "finished", f"finished in {took}", placement=active.slot.label, rc=code)
        elif self.signals or code in (128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM):
            kept = "checkpoint kept" if run_holds_checkpoint(run.path) else "no checkpoint yet: it starts again"
            self.transition(run, "interrupted", f"interrupted after {took} (exit {code}; {kept})",
                            placement=active.slot.label, rc=code)
        else:
            tail = output_tail(active.output)
            self.transition(run, "failed", f"FAILED (exit {code}) after {took}; output {active.output}, ending:\n"
                            + "\n".join("    " + line for line in tail.splitlines()),
                            placement=active.slot.label, rc=code, error=tail)

    def execute(self, todo: list[tuple[Run, bool]]) -> int:
        """Train every (run, resume) of `todo`; returns 0, or 128 + the signal that stopped the grid."""
        queue = list(todo)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while queue or self.active:
                for index, slot in enumerate(self.slots):
                    if self.signals or index in self.active:
                        continue
                    pick = next((item for item in queue if item[0].device == slot.kind), None)
                    if pick is not None:
                        queue.remove(pick)
                        self.active[index] = self.start(pick[0], slot, pick[1])
                for index, active in list(self.active.items()):
                    code = active.process.poll()
                    if code is not None:
                        del self.active[index]
                        self.settle(active, code)
                if self.signals and not self.active:
                    break
                self.display.refresh(self.rows())
                time.sleep(0.25)
        finally:
            for active in self.active.values():  # an error in the grid itself: leave no run behind
                active.process.send_signal(signal.SIGTERM)
                active.process.wait()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.display.refresh(self.rows(), force=True)
        return 128 + self.signals[0] if self.signals else 0
