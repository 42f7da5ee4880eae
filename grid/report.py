"""The grid's results: `eval.report` for every finished run (the quick evaluation set for small runs), one per slot at
a time as the runs were trained (a process each, on its slot's GPU or threads), then eval's comparison over them into
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
from grid.execute import Slot, output_tail, stop_with_grid
from grid.plan import TRAIN_SCRIPT
from run.log import format_duration


def _start(run: Path, slot: Slot, directory: Path, budget: list[str]) -> tuple[subprocess.Popen, Path]:
    output = directory / "logs" / f"{run.name}.report.log"
    make_directory(output.parent)
    env = {**os.environ, **slot.env, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TRAIN_SCRIPT.parent), os.environ.get("PYTHONPATH")]))}
    with open(output, "ab") as f:  # the report ends with the grid process, however that ends (stop_with_grid)
        process = subprocess.Popen([sys.executable, "-m", "eval.report", "--run", str(run), *budget], stdout=f,
                                   stderr=subprocess.STDOUT, env=env, preexec_fn=stop_with_grid())
    print(f"grid: report {run.name} on {slot.label} (output {output})", flush=True)
    return process, output


def report_runs(directory: Path, run_dirs: list[Path], budget: list[str], slots: list[Slot]) -> tuple[list[str], bool]:
    """`python -m eval.report` for each run, as many at once as there are slots (each with its slot's GPU or
    threads); (the failures, each with the end of its output; whether Ctrl-C interrupted them: each report then
    writes its partial page)."""
    queue, active, failures = list(run_dirs), {}, []
    try:
        while queue or active:
            for index, slot in enumerate(slots):
                if index not in active and queue:
                    run = queue.pop(0)
                    active[index] = (run, *_start(run, slot, directory, budget), time.time())
            for index, (run, process, output, started) in list(active.items()):
                code = process.poll()
                if code is None:
                    continue
                del active[index]
                took = format_duration(time.time() - started)
                if code == 0:
                    print(f"grid: report {run.name} done in {took}", flush=True)
                else:
                    tail = output_tail(output)
                    failures.append(f"{run.name}: exit {code}; output {output}, ending:\n    "
                                    + tail.replace("\n", "\n    "))
                    print(f"grid: report {run.name} FAILED (exit {code}) after {took}", flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:  # the terminal's Ctrl-C reached each report too
        for _, process, _, _ in active.values():
            process.wait()
        return failures, True
    return failures, False


def report_grid(directory: Path, run_dirs: list[Path], budget: list[str], failed: list[str],
                slots: list[Slot]) -> int:
    """Report every run of `run_dirs` (finished runs), then compare them into `directory` (compare.md, and
    scorecard.md when runs match published cells); `failed` names the runs that did not finish: the comparison and
    the scorecard leave out those that started and say why, compare.md names the others at its end. Returns 0, 1
    when a report or the scorecard failed, or 130 when interrupted."""
    from eval import compare, paper_data, scorecard  # the trainer's modules (torch): not imported by `status`

    if not run_dirs:
        print("grid: no finished run to report", flush=True)
        return 0
    failures, interrupted = report_runs(directory, run_dirs, budget, slots)
    if interrupted:
        print(f"grid: reports interrupted; `python -m grid report {directory}` finishes them", file=sys.stderr)
        return 130
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
