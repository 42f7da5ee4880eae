"""The expected wall time of a grid (docs/grid.md#wall-time): the tokens each run has left, placed on the slots in
the grid's order (each run to the slot that frees first), at the training throughput the grid's runs measured where
any has (log.jsonl's tokens/s), else at the one bench/throughput.json holds for this GPU and the runs' setting (the
GPU session measures it), else as a formula in that throughput."""
from __future__ import annotations

import heapq
import statistics
from pathlib import Path

from bench.throughput import read_rows
from grid.execute import Slot
from grid.plan import PlannedRun
from grid.progress import tail_records
from run.log import format_duration


def measured_throughput(path: Path) -> float | None:
    """The median training tokens/s of the last records of a run's log.jsonl (None before its first logged step)."""
    speeds = [r["tokens_per_s"] for r in tail_records(path / "log.jsonl") if r.get("train_loss") is not None
              and r.get("tokens_per_s")]
    return statistics.median(speeds) if speeds else None


def table_throughput(run: PlannedRun, gpu: str | None, runs_per_gpu: int, rows: list[dict]) -> float | None:
    """One run's tokens/s on `gpu` while `runs_per_gpu` runs share it, from the row of bench/throughput.json for the
    run's preset, optimizer, tokens per step and compile mode (None without such a row)."""
    if gpu is None or run.config is None:
        return None
    key = {"gpu": gpu, "preset": run.config.preset, "optimizer": run.config.train.optimizer,
           "batch_tokens": run.batch_tokens, "compile_mode": run.config.train.compile_mode,
           "runs_per_gpu": runs_per_gpu}
    row = next((r for r in rows if all(r.get(k) == v for k, v in key.items())), None)
    return row["tokens_per_s"] / runs_per_gpu if row else None


def remaining_tokens(run: PlannedRun, state: str) -> int:
    """The tokens `run` has left to train: none when finished or refused, else its total less what it logged."""
    if state not in ("new", "resume"):
        return 0
    done = next((r.get("tokens", 0) for r in reversed(tail_records(run.path / "log.jsonl")) if "tokens" in r), 0)
    return max(run.steps * run.batch_tokens - done, 0)


def busiest_slot(loads: list[float], slots: int) -> float:
    """The largest total on any of `slots` slots when each load in order goes to the slot that frees first."""
    heap = [0.0] * max(slots, 1)
    for load in loads:
        heapq.heappush(heap, heapq.heappop(heap) + load)
    return max(heap)


def wall_time_lines(runs: list[PlannedRun], states: dict[str, str], slots: list[Slot], gpu: str | None = None,
                    runs_per_gpu: int = 1, rows: list[dict] | None = None) -> list[str]:
    """Per kind of slot (GPUs, CPU workers): how long the runs still to train take there. In seconds where some run
    of the grid measured its throughput (each run at its own, else at the grid's median), or, for GPU runs, where
    `rows` (bench/throughput.json's) hold every run's setting on `gpu` with `runs_per_gpu` runs per GPU; otherwise
    the formula: the busiest slot's tokens / R, with R a run's tokens/s, and how to measure R."""
    speeds = {r.name: measured_throughput(r.path) for r in runs}
    measured = [s for s in speeds.values() if s]
    fallback = statistics.median(measured) if measured else None
    rows = read_rows() if rows is None else rows
    left = {r.name: remaining_tokens(r, states[r.name]) for r in runs}
    lines = []
    for kind in ("cuda", "cpu"):
        todo = [r for r in runs if r.device == kind and left[r.name]]
        count = sum(s.kind == kind for s in slots)
        if not todo or not count:
            continue
        where = f"{len(todo)} runs on {count} {'GPU' if kind == 'cuda' else 'CPU worker'} slot{'s' * (count > 1)}"
        tokens = [left[r.name] for r in todo]
        if fallback is not None:
            seconds = busiest_slot([t / (speeds[r.name] or fallback) for r, t in zip(todo, tokens)], count)
            lines.append(f"expected wall time: {format_duration(seconds)} ({where}; from the tokens/s the grid's "
                         f"runs measured, median {fallback:,.0f})")
            continue
        tabled = [table_throughput(r, gpu, runs_per_gpu, rows) for r in todo] if kind == "cuda" else [None]
        if all(tabled):
            seconds = busiest_slot([t / speed for t, speed in zip(tokens, tabled)], count)
            lines.append(f"expected wall time: {format_duration(seconds)} ({where}; from bench/throughput.json's "
                         f"tokens/s on {gpu} with {runs_per_gpu} run{'s' * (runs_per_gpu > 1)} per GPU)")
            continue
        busiest = busiest_slot(tokens, count)
        lines.append(f"expected wall time: {busiest:,.0f} tokens / R ({where}; the busiest trains {busiest:,.0f} "
                     "tokens), R = one run's training tokens/s on one slot, which no run of this grid has measured "
                     "yet: `python -m bench.e2e` with the runs' preset and optimizer measures it (docs/grid.md"
                     "#wall-time-on-an-8-gpu-node)")
    return lines or ["expected wall time: none (every run finished or refused)"]
