"""The grid's results: `eval.report` for every finished run (the quick evaluation set for small runs), one per slot at
a time on the loop that trained the runs (grid.execute.SlotLoop: a process each, on its slot's GPU or threads), then eval's comparison over them into
the grid directory: `compare.md` with the optimizer × attention-bias table (best validation loss, mean ± std over
seeds, Δ against the symmetric baseline with its standard error), the per-run table and the loss curves, and, when
runs match cells of the paper's tables, `scorecard.md` (docs/grid.md#the-report, docs/reproduce.md)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from fileio import atomic_write, make_directory
from grid.execute import Active, Slot, SlotLoop, output_tail, stop_with_grid
from grid.plan import TRAIN_SCRIPT
from run.log import format_duration


class Reports(SlotLoop):
    """`python -m eval.report` for each finished run on the grid's one loop: as many at once as there are slots, each
    with its slot's GPU or threads, output in DIR/logs/<run>.report.log. Like a trainer, each report runs in a session
    of its own (a signal reaches it through the grid, once: it then writes its partial page) and ends with the grid
    process, however that ends (stop_with_grid). `failures`: each failed report with the end of its output."""

    STOPPING = "each report still writes its page"

    def __init__(self, directory: Path, budget: list[str], slots: list[Slot]) -> None:
        super().__init__(slots)
        self.directory, self.budget = directory, budget
        self.failures: list[str] = []

    def start(self, run: Path, slot: Slot) -> Active:
        output = self.directory / "logs" / f"{run.name}.report.log"
        make_directory(output.parent)
        env = {**os.environ, **slot.env, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(TRAIN_SCRIPT.parent), os.environ.get("PYTHONPATH")]))}
        with open(output, "ab") as f:
            process = subprocess.Popen([sys.executable, "-m", "eval.report", "--run", str(run), *self.budget],
                                       stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                       preexec_fn=stop_with_grid())
        print(f"grid: report {run.name} on {slot.label} (output {output})", flush=True)
        return Active(run, slot, process, output, time.time())

    def finish(self, active: Active, code: int) -> list:
        took, name = format_duration(time.time() - active.started), active.run.name
        if code == 0:
            print(f"grid: report {name} done in {took}", flush=True)
        else:
            self.failures.append(f"{name}: exit {code}; output {active.output}, ending:\n    "
                                 + output_tail(active.output).replace("\n", "\n    "))
            print(f"grid: report {name} FAILED (exit {code}) after {took}", flush=True)
        return []


def report_runs(directory: Path, run_dirs: list[Path], budget: list[str], slots: list[Slot]) -> tuple[list[str], int]:
    """Report each run (Reports); (the failures, 0 or 128 + the signal that interrupted the reports)."""
    reports = Reports(directory, budget, slots)
    code = reports.run(list(run_dirs))
    return reports.failures, code


def report_grid(directory: Path, run_dirs: list[Path], budget: list[str], failed: list[str],
                slots: list[Slot]) -> int:
    """Report every run of `run_dirs` (finished runs), then compare them into `directory` (compare.md, and
    scorecard.md when runs match published cells); `failed` names the runs that did not finish: the comparison and
    the scorecard leave out those that started and say why, compare.md names the others at its end. Returns 0, 1
    when a report or the scorecard failed, or 128 + the signal that interrupted the reports."""
    from eval import compare, paper_data, scorecard  # the trainer's modules (torch): not imported by `status`

    if not run_dirs:
        print("grid: no finished run to report", flush=True)
        return 0
    failures, code = report_runs(directory, run_dirs, budget, slots)
    if code:
        print(f"grid: reports interrupted; `python -m grid report {directory}` finishes them", file=sys.stderr)
        return code
    started = [directory / name for name in failed if (directory / name / "config.json").is_file()]
    compare.compare_runs(run_dirs + started, directory)  # which left out, and why: eval.samples.run_outcome
    try:
        scorecard.write_scorecard(run_dirs + started, directory, source=f"the {len(run_dirs)} finished runs of the "
                                  f"grid in {directory}", only_if_matched=True)
    except paper_data.PublishedDataError as exc:  # named with the other failures below, on one line
        failures.append(f"scorecard: {exc}")
    if never := [name for name in failed if directory / name not in started]:
        page = directory / "compare.md"
        atomic_write(page, (page.read_text() + "Runs of the grid that never started (no config.json): "
                            + ", ".join(f"`{name}`" for name in never) + f" (`python -m grid status {directory}` "
                            "says why).\n").encode())
    for failure in failures:
        print(f"grid: report incomplete: {failure}", file=sys.stderr)
    return 1 if failures else 0
