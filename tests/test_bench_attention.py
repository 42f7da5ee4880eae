"""bench.attention's bookkeeping on the CPU (the timings need a GPU): which variants it times, the ratio to the
fastest library path, what auto would pick and the table rows it writes."""
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


def test_the_bench_writes_the_fastest_path_per_head_dim_with_its_timings() -> None:
    def shape(d: int, ms: dict[str, float]) -> dict:
        variants = {f"{name}+bias": {"fwd_bwd_ms": t} for name, t in ms.items()}
        variants["triton"] = {"fwd_bwd_ms": 0.001}  # without biases: not what the table is chosen by
        return {"B": 4, "H": 12, "T": 512, "d": d, "dtype": "bfloat16", "variants": variants}

    report = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6", "shapes": [
        shape(64, {"triton": 1.0, "sdpa": 1.5, "flex": 1.2}), shape(64, {"triton": 2.0, "sdpa": 1.6, "flex": 2.0}),
        shape(128, {"triton": 1.99, "sdpa": 2.0})]}
    rows = bench_attention.table_rows(report, "abc1234")
    assert [(r["gpu"], r["head_dim"], r["dtype"], r["impl"]) for r in rows] == [
        ("NVIDIA H100 80GB HBM3", 64, "bfloat16", "triton"),  # 3.0 ms summed against sdpa 3.1, flex 3.2
        ("NVIDIA H100 80GB HBM3", 128, "bfloat16", "sdpa")]  # within 2%: the library
    assert "commit abc1234" in rows[0]["source"]
    assert "triton 3.000 ms, sdpa 3.100 ms, flex 3.200 ms" in rows[0]["source"]
    assert bench_attention.fastest_path({"sdpa": 1.0, "triton": 0.8, "flex": 0.9}) == "triton"
    assert bench_attention.fastest_path({"flex": 0.5, "triton": 0.5}) == "triton"


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
