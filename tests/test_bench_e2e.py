"""bench.e2e on the CPU with a tiny model: the benchmark's run ends without the final checkpoint and validation, a
--profile-steps window's summary lands in its JSON and the intervals it slowed are left out of the timing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import train_gpt
from bench import e2e

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--seq-len", "32",
        "--batch-tokens", "64", "--micro-batch", "2", "--device", "cpu"]


def test_a_benchmark_run_skips_the_final_checkpoint_and_reports_its_profile(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    saves = []
    monkeypatch.setattr(train_gpt.Trainer, "save", lambda self: saves.append(self.progress.step))
    out = tmp_path / "e2e.json"
    e2e.main(["--preset", "smoke", "--steps", "8", "--log-every", "2", "--warmup", "0", "--out", str(out), "--",
              *TINY, "--profile-steps", "4:5"])
    result = json.loads(out.read_text())
    assert saves == [] and result["final_val_loss"] is None
    assert result["profile"]["steps"] == [5, 5] and result["profile"]["host_ms_per_step"] > 0
    assert result["tokens_per_s"] > 0 and result["batch_tokens"] == 64


def test_intervals_overlapping_the_profile_window_are_left_out() -> None:
    records = [{"step": s, "tokens_per_s": 1.0} for s in (2, 4, 6, 8, 10)] + [{"summary": True, "tokens_per_s": 1}]
    kept = [r["step"] for r in e2e.steady_intervals(records, 0, [5, 6])]
    assert kept == [2, 4, 8, 10]  # (4, 6] holds the profiled steps 5 and 6
    assert [r["step"] for r in e2e.steady_intervals(records, 1, [7, 8])] == [4, 6, 10]
    assert [r["step"] for r in e2e.steady_intervals(records, 2, None)] == [6, 8, 10]
