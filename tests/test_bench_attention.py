"""bench.attention's bookkeeping on the CPU (the timings need a GPU): which variants it times, the ratio to the
fastest library path, and what auto would pick."""
from __future__ import annotations

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
