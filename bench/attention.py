"""Attention benchmark: every implementation side by side, as a ratio to the fastest library path (CUDA only).

    python -m bench.attention                                  # five shapes, writes runs/bench/attention.json
    python -m bench.attention --shapes 16x12x1024x64 --out my.json
    SYMGPT_ATTENTION_AUTOTUNE=1 python -m bench.attention      # autotuned kernel tiles instead of the shipped ones
    python -m bench.attention --write-table                    # also write this GPU's rows of the attention table

For each shape (B x H x T x d; causal; bf16) it times, forward and forward+backward (median of
triton.testing.do_bench, CUDA events, after a warm-up that also compiles and autotunes), the three implementations
that --attention-impl chooses between (kernels/attention_paths.py: `triton`, `sdpa` = SDPA on q + b_Q with b_V added
after, whichever backend PyTorch dispatches to, and `flex` = FlexAttention with the per-key score term) and SDPA
pinned to each of its backends (`sdpa-flash`, `sdpa-efficient`, `sdpa-cudnn`), each without biases, `+bias` with
sampled b_Q, b_V of shape (d,) (docs/model.md defaults, no gradient) and, for the three implementations, `+learned`
with the same biases as trainable parameters. The library paths are SDPA (every backend) and FlexAttention; each row's
`x` is the fastest library path's time with the same biases over this row's time (above 1: faster than the library).
`auto` is the fastest of the three on these timings (`fastest_path`: within 2% the library wins). --write-table turns
them into this GPU's rows of kernels/attention_table.json, which --attention-impl auto reads (`table_rows`: per head
dim, the fastest by forward+backward time with sampled biases summed over the shapes of that head dim).
FLOPs follow the FlashAttention convention: forward 4·B·H·T²·d, halved when causal; backward 2.5× forward.
Every variant's forward output is checked against a float32 reference before it is timed; `first_s` is the wall time
of that first forward+backward call, compilation (and autotuning, if on) included: the cold start. The JSON is
rewritten after every variant (a shape still in progress has "complete": false), so a run cut short keeps what it
measured.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import triton
from triton.testing import do_bench

from bench import throughput
from bench.gpu_session import commit
from cli import ArgumentParser
import kernels.attention as attn
import kernels.attention_paths as paths
from fileio import atomic_write, exits_on_filesystem_errors

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
IMPLEMENTATIONS = {"triton": attn.attention_triton, "sdpa": paths.attention_reference, "flex": paths.attention_flex}
LIBRARY = ("sdpa", *(f"sdpa-{b}" for b in SDPA_BACKENDS), "flex")
BIASES = ("", "+bias", "+learned")
DEFAULT_SHAPES = [(16, 12, 1024, 64), (8, 12, 512, 64), (64, 12, 512, 64), (8, 12, 2048, 64), (4, 16, 1024, 128)]
PREFERENCE = ("sdpa", "triton", "flex")  # among timings within TIE of the fastest, the earliest wins: the library
TIE = 0.02
Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_flops(B: int, H: int, T: int, d: int, causal: bool) -> float:
    """Forward FLOPs of attention: two (T x T x d) matrix products per head, half of them masked when causal."""
    return 4.0 * B * H * T * T * d * (0.5 if causal else 1.0)


def _sdpa_on(backend: SDPBackend, q, k, v, b_q, b_v, causal):
    with sdpa_kernel([backend]):
        return paths.attention_reference(q, k, v, b_q, b_v, causal)


def make_variants(causal: bool, biases: dict[str, tuple]) -> dict[str, Variant]:
    """Every implementation with every bias setting it is timed with, as f(q, k, v) -> (B, H, T, d) output;
    `biases` maps each of BIASES to its (b_q, b_v)."""
    fns = {**IMPLEMENTATIONS, **{f"sdpa-{name}": functools.partial(_sdpa_on, backend)
                                 for name, backend in SDPA_BACKENDS.items()}}
    return {name + suffix: functools.partial(fn, b_q=biases[suffix][0], b_v=biases[suffix][1], causal=causal)
            for name, fn in fns.items() for suffix in (BIASES if name in IMPLEMENTATIONS else BIASES[:2])}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench_shape(B: int, H: int, T: int, d: int, causal: bool, warmup_ms: int, rep_ms: int,
                device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                progress: Callable[[dict], None] = lambda shape: None) -> dict:
    """Check and time every variant on fresh random inputs of one shape; `progress` gets the shape's result so far
    after every variant."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad_out = (torch.randn(B, H, T, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    b_q = 0.5 + torch.linspace(0.05, 0.15, d, device=device) * torch.randn(d, device=device, generator=gen)
    b_v = 0.5 + 0.02 * torch.randn(d, device=device, generator=gen)
    biases = {"": (None, None), "+bias": (b_q, b_v), "+learned": tuple(b.clone().requires_grad_() for b in (b_q, b_v))}
    ref_plain = paths.attention_reference(q.float(), k.float(), v.float(), causal=causal)
    ref_bias = paths.attention_reference(q.float(), k.float(), v.float(), b_q, b_v, causal=causal)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    fwd_flops = attention_flops(B, H, T, d, causal)
    rows: dict[str, dict] = {}
    result = {"B": B, "H": H, "T": T, "d": d, "causal": causal, "dtype": paths.dtype_name(dtype),
              "variants": rows, "complete": False}
    for name, fn in make_variants(causal, biases).items():
        inputs = [q, k, v] + (list(biases["+learned"]) if name.endswith("+learned") else [])
        try:
            start = time.perf_counter()
            with torch.no_grad():
                err = relative_error(fn(q, k, v), ref_bias if "+" in name else ref_plain)
            torch.autograd.grad(fn(q, k, v), inputs, grad_out)  # compile / autotune the backward too
            torch.get_device_module(q.device).synchronize()  # asynchronous launch errors surface here, in the try
            first_s = time.perf_counter() - start
        except Exception as exc:  # a backend this GPU or build lacks: report it, keep going
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            progress(result)
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
        progress(result)
    add_ratios(rows)

    if os.environ.get(attn.AUTOTUNE_ENV) == "1":  # which tiles autotuning picked (private autotuner objects)
        tiles = {name: str(getattr(getattr(attn, name), "best_config", None))
                 for name in ("_attn_fwd_tuned", "_attn_bwd_dkdv_tuned", "_attn_bwd_dq_tuned")}
    else:
        tiles = {name: str(attn.tile_for(name, q)) for name in ("fwd", "dkdv", "dq")}
    result.update(tiles=tiles, auto=auto_choices(rows), complete=True)
    return result


def _timed(rows: dict, names, key: str) -> dict[str, float]:
    return {n: rows[n][key] for n in names if n in rows and "error" not in rows[n]}


def add_ratios(rows: dict) -> None:
    """x_fwd, x_fwd_bwd: the fastest library path with the same biases over this variant's time."""
    for suffix in BIASES:
        for key in ("fwd_ms", "fwd_bwd_ms"):
            library = _timed(rows, [name + suffix for name in LIBRARY], key)
            for name, row in rows.items():
                if name.endswith(suffix) and (suffix or "+" not in name) and "error" not in row:
                    row["x_" + key[:-3]] = min(library.values()) / row[key] if library else None


def auto_choices(rows: dict) -> dict[str, str | None]:
    """What --attention-impl auto picks from these forward+backward timings, per bias setting."""
    out = {}
    for suffix in BIASES:
        timed = _timed(rows, [name + suffix for name in IMPLEMENTATIONS], "fwd_bwd_ms")
        out[suffix or "none"] = fastest_path({n.removesuffix(suffix): ms for n, ms in timed.items()}) if timed else None
    return out


def fastest_path(timings: dict[str, float]) -> str:
    """The fastest path; timings within TIE (relative) of the best count as ties, won by PREFERENCE order."""
    best = min(timings.values())
    tied = [name for name, ms in timings.items() if ms <= best * (1 + TIE)]
    return min(tied, key=PREFERENCE.index)


def table_rows(report: dict, commit: str) -> list[dict]:
    """This GPU's rows of kernels/attention_table.json from a report of `main`: per (head dim, dtype), the path with
    the least forward+backward time with sampled biases, summed over that head dim's shapes (paths timed at all of
    them), and the timings in its source."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for shape in report["shapes"]:
        if shape and shape.get("complete", True):  # a shape cut short decides nothing
            groups.setdefault((shape["d"], shape["dtype"]), []).append(shape)
    rows = []
    for (d, dtype), shapes in sorted(groups.items()):
        timed = [_timed(shape["variants"], [n + "+bias" for n in IMPLEMENTATIONS], "fwd_bwd_ms") for shape in shapes]
        common = set.intersection(*(set(t) for t in timed))
        if not common:
            continue
        totals = {n.removesuffix("+bias"): sum(t[n] for t in timed) for n in common}
        sizes = ", ".join(f"{s['B']}x{s['H']}x{s['T']}x{s['d']}" for s in shapes)
        rows.append({"gpu": report["device"], "head_dim": d, "dtype": dtype, "impl": fastest_path(totals), "source": (
            f"python -m bench.attention {time.strftime('%Y-%m-%d')}, commit {commit}, torch {report['torch']}, "
            f"Triton {report['triton']}: forward+backward with sampled b_Q, b_V, causal, summed over {sizes}: "
            + ", ".join(f"{n} {ms:.3f} ms" for n, ms in sorted(totals.items(), key=lambda kv: kv[1])))})
    return rows


def _ratio(x: float | None) -> str:
    return f"{x:6.2f}" if x is not None else "   n/a"


def print_table(result: dict) -> None:
    print(f"\nB={result['B']} H={result['H']} T={result['T']} d={result['d']} causal={result['causal']} "
          f"{result['dtype']}   (x = fastest library path's time / this time, same biases)")
    print(f"{'variant':18s} {'rel_err':>8s} {'first s':>8s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'x':>6s} "
          f"{'f+b ms':>8s} {'TFLOP/s':>8s} {'x':>6s}")
    for name, r in result["variants"].items():
        if "error" in r:
            print(f"{name:18s} unavailable: {r['error'][:90]}")
            continue
        print(f"{name:18s} {r['rel_err']:8.1e} {r['first_s']:8.2f} {r['fwd_ms']:8.3f} {r['fwd_tflops']:8.1f} "
              f"{_ratio(r['x_fwd'])} {r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_tflops']:8.1f} {_ratio(r['x_fwd_bwd'])}")
    print("auto picks: " + ", ".join(f"{k} -> {v}" for k, v in result["auto"].items()) + f"   tiles {result['tiles']}")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    try:
        B, H, T, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} must be BxHxTxd, e.g. 16x12x1024x64") from None
    return B, H, T, d


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="bench.attention", description=__doc__)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=DEFAULT_SHAPES,
                        help="BxHxTxd shapes (default: 16x12x1024x64, the paper's batch 8x12x512x64, 64x12x512x64, "
                             "T = 2048 with the same tokens, and d = 128)")
    parser.add_argument("--non-causal", action="store_true", help="time non-causal attention instead")
    parser.add_argument("--warmup-ms", type=int, default=100, help="do_bench warm-up per measurement (ms)")
    parser.add_argument("--rep-ms", type=int, default=500, help="do_bench timed repetitions per measurement (ms)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/attention.json"), help="JSON results path")
    parser.add_argument("--write-table", action="store_true",
                        help=f"write this GPU's rows of {paths.TABLE} (what --attention-impl auto runs here) from "
                             "these timings, replacing its earlier rows")
    parser.add_argument("--table", type=Path, default=paths.TABLE,
                        help="the table --write-table writes (default: the repository's, which auto reads; the GPU "
                             "session writes a copy and reports the change)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py needs a CUDA GPU and torch.cuda.is_available() is False here; "
                         "run it on a GPU machine (the CPU tests are tests/test_attention_kernel.py and "
                         "tests/test_attention_paths.py)")
    torch._dynamo.config.recompile_limit = 64  # FlexAttention compiles once per shape and bias setting

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(), "shapes": []}

    def save(shape: dict) -> None:
        report["shapes"][-1] = shape
        atomic_write(args.out, json.dumps(report, indent=2).encode())

    for shape in args.shapes:
        report["shapes"].append(None)
        result = bench_shape(*shape, causal=not args.non_causal, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                             progress=save)
        save(result)
        print_table(result)
    print(f"\n{report['device']}  torch {report['torch']}  triton {report['triton']}  -> {args.out}")
    if args.write_table:
        if args.non_causal:
            raise SystemExit("--write-table records causal attention (the model's): drop --non-causal")
        rows = table_rows(report, commit())
        atomic_write(args.table, throughput.table_text(rows, args.table, paths.TABLE_KEY).encode())
        for row in rows:
            print(f"{args.table}: {row['gpu']}, head dim {row['head_dim']}, {row['dtype']} -> {row['impl']}")


if __name__ == "__main__":
    main()
