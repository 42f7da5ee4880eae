"""Measured training throughput on GPUs, and the wall time of a grid it gives (docs/grid.md#wall-time-on-an-8-gpu-node).

bench/throughput.json holds one row per (GPU, preset, optimizer, tokens per step, compile mode, runs per GPU): the
tokens per second of the whole GPU with that many runs sharing it, and each run's ms per step, as `bash
bench/gpu_session.sh` measured them (its report ends with the rows to add). `grid_wall_time_s` turns a GPU's rows
into the wall time of a grid, `fastest_setting` picks the setting to run. `table_text` adds measured rows to a table
file, this one or kernels/attention_table.json (bench.attention's). Standard library only: the GPU session's driver,
which any python3 runs, reads and writes these rows too.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

TABLE = Path(__file__).with_name("throughput.json")
KEY = ("gpu", "preset", "optimizer", "batch_tokens", "compile_mode", "runs_per_gpu")
PAPER_GRID = {"runs": 24, "tokens_per_run": 500_000_000, "gpus": 8}  # Table 1: 4 optimizers x 3 bias modes x 2 seeds


def read_rows(path: Path = TABLE) -> list[dict]:
    """The measured rows: {gpu, preset, optimizer, batch_tokens, compile_mode, runs_per_gpu, tokens_per_s, step_ms,
    source} each."""
    return json.loads(path.read_text())["rows"]


def table_text(new_rows: list[dict], path: Path = TABLE, key: tuple[str, ...] = KEY) -> str:
    """The JSON of a table file of measured rows (this one, or kernels/attention_table.json with its TABLE_KEY) with
    `new_rows` added, each replacing any row of the same `key`, in key order; the file's other entries are kept, and
    a file not yet written is an empty table."""
    document = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    keys = {tuple(r[k] for k in key) for r in new_rows}
    rows = [r for r in document["rows"] if tuple(r[k] for k in key) not in keys] + new_rows
    document["rows"] = sorted(rows, key=lambda r: tuple(str(r[k]) for k in key))
    return json.dumps(document, indent=1) + "\n"


def gpu_rows(rows: list[dict], gpu: str, preset: str = "gpt2-124m", optimizer: str = "adamw",
             batch_tokens: int = 4096) -> dict[str, dict[int, float]]:
    """{compile mode: {runs per GPU: the GPU's tokens/s}} of one GPU's rows for one run setting."""
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        if (r["gpu"], r["preset"], r["optimizer"], r["batch_tokens"]) == (gpu, preset, optimizer, batch_tokens):
            out.setdefault(r["compile_mode"], {})[r["runs_per_gpu"]] = r["tokens_per_s"]
    return out


def grid_wall_time_s(runs: int, tokens_per_run: float, gpus: int, gpu_tokens_per_s: dict[int, float]) -> float:
    """Seconds for `runs` runs of `tokens_per_run` tokens on `gpus` GPUs, up to max(gpu_tokens_per_s) runs per GPU at
    once: the grid's waves fill every GPU once before any twice, and a GPU with n runs gives each
    gpu_tokens_per_s[n] / n tokens per second (runs of one wave end together)."""
    most = max(gpu_tokens_per_s)
    left, seconds = runs, 0.0
    while left > 0:
        wave = min(left, gpus * most)
        per_gpu = math.ceil(wave / gpus)
        seconds += tokens_per_run * per_gpu / gpu_tokens_per_s[per_gpu]
        left -= wave
    return seconds


def fastest_setting(by_mode: dict[str, dict[int, float]], runs: int = PAPER_GRID["runs"],
                    tokens_per_run: float = PAPER_GRID["tokens_per_run"], gpus: int = PAPER_GRID["gpus"]
                    ) -> tuple[str, int, float] | None:
    """(compile mode, runs per GPU, seconds) of the setting that finishes the grid soonest, from `gpu_rows`;
    None without rows. A setting with n runs per GPU needs measurements for 1..n."""
    best = None
    for mode, measured in by_mode.items():
        for n in sorted(measured):
            if all(k in measured for k in range(1, n + 1)):
                seconds = grid_wall_time_s(runs, tokens_per_run, gpus, {k: measured[k] for k in range(1, n + 1)})
                if best is None or seconds < best[2]:
                    best = (mode, n, seconds)
    return best


def wall_time_line(gpu: str, by_mode: dict[str, dict[int, float]]) -> str:
    """The paper grid's expected wall time on an 8-GPU node of `gpu`, as docs/grid.md and the session's report say
    it."""
    mode, n, seconds = fastest_setting(by_mode)
    grid = PAPER_GRID
    return (f"{gpu}: {seconds / 3600:.1f} h for the {grid['runs']} runs of {grid['tokens_per_run'] / 1e6:,.0f}M tokens "
            f"on {grid['gpus']} GPUs, with --compile-mode {mode} and --runs-per-gpu {n} "
            f"({by_mode[mode][n]:,.0f} tokens/s per GPU)")


def concurrent_tokens_per_s(runs: list[list[list[float]]], warmup: int = 2) -> tuple[float, float] | None:
    """(tokens/s of all runs together, seconds they overlapped) from each run's log records [wall time, step, tokens]
    (bench.e2e's `records`), over the window in which every run was past its first `warmup` records and still
    training; None when the window holds fewer than two records of some run."""
    start = max(records[min(warmup, len(records) - 1)][0] for records in runs)
    end = min(records[-1][0] for records in runs)
    total = 0.0
    for records in runs:
        inside = [r for r in records if start <= r[0] <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        total += (inside[-1][2] - inside[0][2]) / (inside[-1][0] - inside[0][0])
    return total, end - start


MEASURED = "Measured so far"  # docs/grid.md's line above the wall-time bullets that `with_wall_times` rewrites
NONE_YET = ("- none yet: no GPU has run `bash bench/gpu_session.sh` on this code, so the grid's wall time on a node is "
            "not known (CPU timings do not transfer)")


def wall_time_bullets(rows: list[dict]) -> list[str]:
    """docs/grid.md's bullets: the paper grid's wall time on each GPU of `rows` (AdamW at the paper's batch)."""
    gpus = sorted({r["gpu"] for r in rows})
    lines = [f"- {wall_time_line(gpu, gpu_rows(rows, gpu))}" for gpu in gpus if fastest_setting(gpu_rows(rows, gpu))]
    return lines or [NONE_YET]


def with_wall_times(doc: str, rows: list[dict]) -> str:
    """`doc` (docs/grid.md's text) with the first bullets after the paragraph that starts with MEASURED replaced by
    `wall_time_bullets(rows)`."""
    lines = doc.split("\n")
    heading = next(i for i, line in enumerate(lines) if line.startswith(MEASURED))
    first = next(i for i in range(heading, len(lines)) if lines[i].startswith("- "))
    last = first
    while last < len(lines) and lines[last].startswith("- "):
        last += 1
    return "\n".join(lines[:first] + wall_time_bullets(rows) + lines[last:])
