"""Attention kernel benchmark: the Triton kernel against PyTorch SDPA backends and FlexAttention (CUDA only).

    python -m bench.attention                                  # GPT-2 shapes + T=2048, writes runs/bench/attention.json
    python -m bench.attention --shapes 16x12x1024x64 --out my.json
    SYMGPT_ATTENTION_AUTOTUNE=1 python -m bench.attention      # autotuned tiles instead of the shipped ones

For each shape (B x H x T x d; causal; bf16) it times, forward and forward+backward (median of
triton.testing.do_bench, CUDA events, after a warm-up that also runs autotuning and compilation):
- `triton`: kernels.attention.attention_triton without biases; `triton+bias`: with sampled b_Q, b_V of shape (d,)
  (docs/model.md defaults, no gradient); `triton+learned`: the same biases as trainable parameters;
- `sdpa-<backend>` for flash, efficient and cuDNN, plain and `+bias` with the biases applied outside
  (q + b_Q before, + b_V after);
- `flex` (torch.compile'd FlexAttention, causal block mask) plain and `+bias` with b_Q as a key-bias score_mod
  ((q + b_Q)·k = q·k + b_Q·k) and b_V added outside.
FLOPs follow the FlashAttention convention: forward 4·B·H·T²·d, halved when causal; backward 2.5× forward.
Every variant's forward output is checked against a float32 SDPA reference before it is timed; `first_s` is the
wall time of that first forward+backward call, compilation (and autotuning, if on) included: the cold start.
Goals (H100/H200): triton+bias forward+backward >= 1.0x the fastest SDPA+bias backend and forward >= 1.2x, and
bias injection overhead (triton+bias over triton) <= 3% forward+backward.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import kernels.attention as attn  # noqa: E402

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_flops(B: int, H: int, T: int, d: int, causal: bool) -> float:
    """Forward FLOPs of attention: two (T x T x d) matrix products per head, half of them masked when causal."""
    return 4.0 * B * H * T * T * d * (0.5 if causal else 1.0)


def make_variants(d: int, T: int, causal: bool, b_q: torch.Tensor, b_v: torch.Tensor,
                  b_q_learned: torch.Tensor, b_v_learned: torch.Tensor) -> dict[str, Variant]:
    """Every implementation under test, as f(q, k, v) -> (B, H, T, d) output."""
    variants: dict[str, Variant] = {
        "triton": lambda q, k, v: attn.attention_triton(q, k, v, causal=causal),
        "triton+bias": lambda q, k, v: attn.attention_triton(q, k, v, b_q, b_v, causal=causal),
        "triton+learned": lambda q, k, v: attn.attention_triton(q, k, v, b_q_learned, b_v_learned, causal=causal),
    }
    for name, backend in SDPA_BACKENDS.items():
        def plain(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def biased(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q + b_q.to(q.dtype), k, v, is_causal=causal)
            return out + b_v.to(out.dtype)

        variants[f"sdpa-{name}"], variants[f"sdpa-{name}+bias"] = plain, biased

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, T, T,
                                       device=b_q.device)
    scale = d ** -0.5

    def flex_plain(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask)

    def flex_biased(q, k, v):
        key_bias = (k.float() @ b_q.float()) * scale  # (B, H, T): b_Q·k/√d, a per-key logit bias

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + key_bias[b, h, kv_idx]

        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
        return out + b_v.to(out.dtype)

    variants["flex"] = torch.compile(flex_plain, fullgraph=True)
    variants["flex+bias"] = torch.compile(flex_biased, fullgraph=True)
    return variants


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench_shape(B: int, H: int, T: int, d: int, causal: bool, warmup_ms: int, rep_ms: int,
                device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Check and time every variant on fresh random inputs of one shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad_out = (torch.randn(B, H, T, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    b_q = 0.5 + torch.linspace(0.05, 0.15, d, device=device) * torch.randn(d, device=device, generator=gen)
    b_v = 0.5 + 0.02 * torch.randn(d, device=device, generator=gen)
    b_q_learned, b_v_learned = (b.clone().requires_grad_() for b in (b_q, b_v))
    ref_plain = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    ref_bias = attn.attention_reference(q.float(), k.float(), v.float(), b_q, b_v, causal=causal)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    fwd_flops = attention_flops(B, H, T, d, causal)
    rows: dict[str, dict] = {}
    for name, fn in make_variants(d, T, causal, b_q, b_v, b_q_learned, b_v_learned).items():
        inputs = [q, k, v] + ([b_q_learned, b_v_learned] if name == "triton+learned" else [])
        try:
            start = time.perf_counter()
            with torch.no_grad():
                err = relative_error(fn(q, k, v), ref_bias if "+" in name else ref_plain)
            torch.autograd.grad(fn(q, k, v), inputs, grad_out)  # compile / autotune the backward too
            if q.is_cuda:
                torch.cuda.synchronize()  # surface asynchronous launch errors here, inside the try
            first_s = time.perf_counter() - start
        except Exception as exc:  # a backend this GPU or build lacks: report it, keep going
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            continue

        def forward(fn=fn):
            with torch.no_grad():
                fn(q, k, v)

        def forward_backward(fn=fn, inputs=inputs):
            torch.autograd.grad(fn(q, k, v), inputs, grad_out)

        fwd_ms = do_bench(forward, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        fb_ms = do_bench(forward_backward, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        rows[name] = {"rel_err": err, "first_s": first_s, "fwd_ms": fwd_ms, "fwd_tflops": fwd_flops / fwd_ms * 1e-9,
                      "fwd_bwd_ms": fb_ms, "fwd_bwd_tflops": 3.5 * fwd_flops / fb_ms * 1e-9}

    if os.environ.get(attn.AUTOTUNE_ENV) == "1":  # which tiles autotuning picked (private autotuner objects)
        tiles = {name: str(getattr(getattr(attn, name), "best_config", None))
                 for name in ("_attn_fwd_tuned", "_attn_bwd_dkdv_tuned", "_attn_bwd_dq_tuned")}
    else:
        tiles = {name: str(attn.tile_for(name, q)) for name in ("fwd", "dkdv", "dq")}
    return {"B": B, "H": H, "T": T, "d": d, "causal": causal, "dtype": str(dtype).removeprefix("torch."),
            "variants": rows, "tiles": tiles, "goals": goals(rows)}


def _fastest(rows: dict, names: list[str], key: str) -> tuple[str | None, float]:
    timed = [(rows[n][key], n) for n in names if "error" not in rows.get(n, {"error": ""})]
    return (min(timed)[1], min(timed)[0]) if timed else (None, float("nan"))


def goals(rows: dict) -> dict:
    """The issue's two goals, computed from one shape's rows (None where a needed variant failed)."""
    out: dict = {}
    for key in ("fwd_ms", "fwd_bwd_ms"):
        best_name, best = _fastest(rows, [f"sdpa-{b}+bias" for b in SDPA_BACKENDS], key)
        ok = "error" not in rows["triton+bias"] and "error" not in rows["triton"]
        out[key] = {
            "fastest_sdpa_bias": best_name,
            "speedup_vs_fastest_sdpa_bias": best / rows["triton+bias"][key] if ok and best_name else None,
            "bias_overhead": rows["triton+bias"][key] / rows["triton"][key] - 1.0 if ok else None,
        }
    fb, fwd = out["fwd_bwd_ms"], out["fwd_ms"]
    out["met"] = (fb["speedup_vs_fastest_sdpa_bias"] is not None and fb["speedup_vs_fastest_sdpa_bias"] >= 1.0
                  and fwd["speedup_vs_fastest_sdpa_bias"] is not None and fwd["speedup_vs_fastest_sdpa_bias"] >= 1.2
                  and fb["bias_overhead"] is not None and fb["bias_overhead"] <= 0.03)
    return out


def print_table(result: dict) -> None:
    rows = result["variants"]
    _, best_fwd = _fastest(rows, [f"sdpa-{b}+bias" for b in SDPA_BACKENDS], "fwd_ms")
    _, best_fb = _fastest(rows, [f"sdpa-{b}+bias" for b in SDPA_BACKENDS], "fwd_bwd_ms")
    print(f"\nB={result['B']} H={result['H']} T={result['T']} d={result['d']} causal={result['causal']} "
          f"{result['dtype']}"
          f"   (x = fastest sdpa+bias time / this time)")
    print(f"{'variant':18s} {'rel_err':>8s} {'first s':>8s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'x':>6s} "
          f"{'f+b ms':>8s} {'TFLOP/s':>8s} {'x':>6s}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:18s} unavailable: {r['error'][:90]}")
            continue
        print(f"{name:18s} {r['rel_err']:8.1e} {r['first_s']:8.2f} {r['fwd_ms']:8.3f} {r['fwd_tflops']:8.1f} "
              f"{best_fwd / r['fwd_ms']:6.2f} {r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_tflops']:8.1f} "
              f"{best_fb / r['fwd_bwd_ms']:6.2f}")
    g, gf = result["goals"]["fwd_bwd_ms"], result["goals"]["fwd_ms"]
    speedup, overhead, fwd_speedup = g["speedup_vs_fastest_sdpa_bias"], g["bias_overhead"], \
        gf["speedup_vs_fastest_sdpa_bias"]
    print(f"goals: triton+bias vs {g['fastest_sdpa_bias']} fwd+bwd "
          f"{'n/a' if speedup is None else format(speedup, '.2f') + 'x'} (want >= 1.00x), forward "
          f"{'n/a' if fwd_speedup is None else format(fwd_speedup, '.2f') + 'x'} (want >= 1.20x); bias overhead "
          f"{'n/a' if overhead is None else format(overhead, '+.1%')} (want <= +3%): "
          f"{'MET' if result['goals']['met'] else 'NOT MET'}   tiles {result['tiles']}")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    try:
        B, H, T, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} must be BxHxTxd, e.g. 16x12x1024x64") from None
    return B, H, T, d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shape, nargs="+",
                        default=[(16, 12, 1024, 64), (64, 12, 512, 64), (8, 12, 2048, 64)],
                        help="BxHxTxd shapes (default: the two GPT-2 shapes and T = 2048 with the same tokens)")
    parser.add_argument("--non-causal", action="store_true", help="time non-causal attention instead")
    parser.add_argument("--warmup-ms", type=int, default=100, help="do_bench warm-up per measurement (ms)")
    parser.add_argument("--rep-ms", type=int, default=500, help="do_bench timed repetitions per measurement (ms)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/attention.json"), help="JSON results path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py needs a CUDA GPU and torch.cuda.is_available() is False here; "
                         "run it on a GPU machine (the kernel's CPU tests are tests/test_attention_kernel.py)")

    results = [bench_shape(*shape, causal=not args.non_causal, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
               for shape in args.shapes]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(), "shapes": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  -> {args.out}")
    for result in results:
        print_table(result)


if __name__ == "__main__":
    main()
