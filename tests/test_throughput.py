"""bench/throughput.py (docs/grid.md#wall-time-on-an-8-gpu-node): the grid's wall time from measured tokens/s per
GPU (waves that fill every GPU once before any twice), the fastest setting, the aggregate tokens/s of runs that share
a GPU from their log records' wall times, the table's rows replaced by key, and docs/grid.md's wall-time lines equal
to what bench/throughput.json gives (today: none)."""
from __future__ import annotations

import json

import pytest

from bench import throughput
from tests.helpers import ROOT


def row(mode: str, n: int, tokens_per_s: float, gpu: str = "NVIDIA H100 80GB HBM3") -> dict:
    return {"gpu": gpu, "preset": "gpt2-124m", "optimizer": "adamw", "batch_tokens": 4096, "compile_mode": mode,
            "runs_per_gpu": n, "tokens_per_s": tokens_per_s, "step_ms": 1e3 * 4096 * n / tokens_per_s, "source": "t"}


def test_the_paper_grid_runs_in_waves_that_fill_every_gpu_once_before_any_twice():
    tokens = 500e6
    assert throughput.grid_wall_time_s(24, tokens, 8, {1: 2e5}) == pytest.approx(3 * tokens / 2e5)
    # two per GPU: 16 runs sharing, then the last 8 alone on their GPUs
    assert throughput.grid_wall_time_s(24, tokens, 8, {1: 2e5, 2: 3e5}) == pytest.approx(
        2 * tokens / 3e5 + tokens / 2e5)
    assert throughput.grid_wall_time_s(24, tokens, 8, {1: 2e5, 2: 3e5, 3: 3.6e5}) == pytest.approx(3 * tokens / 3.6e5)
    assert throughput.grid_wall_time_s(4, tokens, 8, {1: 2e5, 2: 3e5}) == pytest.approx(tokens / 2e5)  # one wave


def test_the_fastest_setting_needs_every_smaller_runs_per_gpu_measured():
    rows = [row("default", 1, 2e5), row("default", 2, 3.5e5), row("reduce-overhead", 1, 2.5e5),
            row("reduce-overhead", 3, 9e5)]  # 3 without 2 measured: not a setting
    by_mode = throughput.gpu_rows(rows, "NVIDIA H100 80GB HBM3")
    mode, n, seconds = throughput.fastest_setting(by_mode)
    assert (mode, n) == ("default", 2) and seconds == pytest.approx(500e6 * 2 / 3.5e5 + 500e6 / 2e5)
    assert throughput.fastest_setting({}) is None
    line = throughput.wall_time_line("NVIDIA H100 80GB HBM3", by_mode)
    assert line.startswith(f"NVIDIA H100 80GB HBM3: {seconds / 3600:.1f} h for the 24 runs of 500M tokens on 8 GPUs, "
                           "with --compile-mode default and --runs-per-gpu 2 (350,000 tokens/s per GPU)")


def test_runs_sharing_a_gpu_are_counted_over_the_seconds_they_overlapped():
    fast = [[10.0 + t, t, 100.0 * t] for t in range(0, 11)]  # 100 tokens/s, from t = 10 to 20
    slow = [[14.0 + t, t, 50.0 * t] for t in range(0, 11)]  # 50 tokens/s, from t = 14 to 24
    total, seconds = throughput.concurrent_tokens_per_s([fast, slow], warmup=2)
    assert total == pytest.approx(150.0) and seconds == pytest.approx(20.0 - 16.0)
    assert throughput.concurrent_tokens_per_s([fast, [[30.0, 0, 0], [31.0, 1, 50]]]) is None  # never side by side


def test_new_rows_replace_the_rows_of_the_same_setting(tmp_path):
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps({"rows": [row("default", 1, 1e5), row("default", 2, 1.5e5)]}))
    rows = json.loads(throughput.table_text([row("default", 1, 2e5)], path))["rows"]
    assert [(r["runs_per_gpu"], r["tokens_per_s"]) for r in rows] == [(1, 2e5), (2, 1.5e5)]


def test_docs_grid_gives_the_wall_time_that_the_measured_figures_give():
    doc = (ROOT / "docs" / "grid.md").read_text()
    rows = throughput.read_rows()
    assert throughput.with_wall_times(doc, rows) == doc
    if not rows:
        assert throughput.NONE_YET in doc
    updated = throughput.with_wall_times(doc, [row("default", 1, 2e5)])
    assert throughput.NONE_YET not in updated and "- NVIDIA H100 80GB HBM3: 2.1 h for the 24 runs" in updated
