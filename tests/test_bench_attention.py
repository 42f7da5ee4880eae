"""bench.attention's bookkeeping on the CPU (the timings need a GPU): which variants it times, the ratio to the
fastest library path, and what auto would pick."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import attention as bench_attention


def rows(fwd_bwd_ms: dict[str, float]) -> dict:
    """Rows as bench_shape makes them, with forward = forward+backward / 4."""
    return {name: {"fwd_ms": ms / 4, "fwd_bwd_ms": ms} for name, ms in fwd_bwd_ms.items()}


def test_every_implementation_is_timed_with_and_without_biases() -> None:
    b = torch.zeros(4)
    variants = bench_attention.make_variants(True, {"": (None, None), "+bias": (b, b), "+learned": (b, b)})
    for impl in ("triton", "sdpa", "flex"):
        assert {impl, impl + "+bias", impl + "+learned"} <= set(variants)
    for backend in ("flash", "efficient", "cudnn"):
        assert {f"sdpa-{backend}", f"sdpa-{backend}+bias"} <= set(variants)
    assert len(variants) == 15


def test_ratios_are_to_the_fastest_library_path_with_the_same_biases() -> None:
    r = rows({"triton": 2.0, "sdpa": 4.0, "sdpa-cudnn": 3.0, "flex": 5.0, "triton+bias": 6.0, "sdpa+bias": 3.0,
              "flex+bias": 4.0})
    r["sdpa-flash+bias"] = {"error": "not on this GPU"}
    bench_attention.add_ratios(r)
    assert r["triton"]["x_fwd_bwd"] == 1.5 and r["sdpa-cudnn"]["x_fwd_bwd"] == 1.0  # cuDNN is the fastest library
    assert r["triton+bias"]["x_fwd_bwd"] == 0.5 and r["flex+bias"]["x_fwd_bwd"] == 0.75  # SDPA+bias is
    assert r["triton"]["x_fwd"] == r["triton"]["x_fwd_bwd"] and "x_fwd" not in r["sdpa-flash+bias"]
    assert bench_attention.auto_choices(r) == {"none": "triton", "+bias": "sdpa", "+learned": None}


def test_every_variant_is_reported_as_soon_as_it_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (timings faked: do_bench needs CUDA) the variants that run here are checked and timed, the rest
    recorded as errors, and `progress` sees the shape after each of them."""
    monkeypatch.setattr(bench_attention, "do_bench", lambda fn, **kwargs: fn() or 1.0)
    snapshots = []
    result = bench_attention.bench_shape(1, 2, 16, 64, True, 1, 1, device="cpu", dtype=torch.float32,
                                         progress=lambda shape: snapshots.append(json.loads(json.dumps(shape))))
    assert len(snapshots) == len(result["variants"]) == 15
    assert [len(s["variants"]) for s in snapshots] == list(range(1, 16)) and not snapshots[-1]["complete"]
    assert result["complete"] and result["variants"]["sdpa+bias"]["rel_err"] < 1e-5
    assert "error" in result["variants"]["sdpa-cudnn"]  # a CUDA backend


def test_a_run_cut_short_keeps_every_shape_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def bench_shape(B, H, T, d, causal, warmup_ms, rep_ms, progress):
        shape = {"B": B, "variants": {}, "complete": False}
        for name in ("triton", "sdpa"):
            shape["variants"][name] = {"fwd_ms": 1.0}
            progress(shape)
            if B == 8 and name == "triton":
                raise KeyboardInterrupt  # the session's time limit
        return {**shape, "complete": True}

    monkeypatch.setattr(bench_attention, "bench_shape", bench_shape)
    monkeypatch.setattr(bench_attention, "print_table", lambda result: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test GPU")
    out = tmp_path / "attention.json"
    with pytest.raises(KeyboardInterrupt):
        bench_attention.main(["--shapes", "16x12x1024x64", "8x12x512x64", "4x16x1024x128", "--out", str(out)])
    shapes = json.loads(out.read_text())["shapes"]
    assert [(s["B"], s["complete"], list(s["variants"])) for s in shapes] == [
        (16, True, ["triton", "sdpa"]), (8, False, ["triton"])]
