"""Every shipped Triton kernel configuration built offline for Hopper (sm_90) and Ampere (sm_80), as it runs.

    python -m bench.kernels                    # every configuration for both targets
    python -m bench.kernels --subset           # the GPT-2 training configuration of each kernel (what CI builds)
    python -m bench.kernels --targets sm_90 --json kernels.json
    python -m bench.kernels --subset --autotune-tiles   # also every tile SYMGPT_ATTENTION_AUTOTUNE=1 would try

Needs no GPU: Triton ships ptxas, cuobjdump and nvdisasm. The launches are captured from the real host code with
the launch replaced by a recorder: kernels.attention's forward and backward on q, k, v viewed out of one (B, T, 3C)
projection as the model does (head dims 64 and 128, bf16 and fp16, with and without b_Q and b_V, causal and not, each
target's shipped tiles), kernels.ecd's two kernels on a GPT-2-shaped chunk (fp32 and bf16 Π, with and without noise,
and one chunk off the 16-element grid to show the alignment hint), kernels.soap's step on such a chunk (fp32 and bf16
m, v). Each launch is then built with Triton's own
run-time specialisation of its arguments (16-byte divisibility of pointers and integers, integers equal to 1), so
registers, spills and instructions are those of the kernel that runs.

Per build: registers, spill bytes, shared memory, SASS instructions, tensor-core instructions (HGMMA is wgmma, sm_90
only; HMMA the older path), TMA instructions (UTMALDG, UTMASTG, UBLKCP) and the widest global load. Exits 1 on a build
error, a spill or shared memory over the target's limit in a shipped configuration (autotuning candidates are
flagged only); speed has to be measured on a GPU (bench/attention.py).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import tempfile
import time
import dataclasses
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from cli import ArgumentParser
import kernels.attention as attn
from kernels import ATTENTION_HEAD_DIMS
import kernels.ecd as ecd
import kernels.soap as soap
from fileio import atomic_write, exits_on_filesystem_errors

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
SHARED_LIMIT = {90: 232448, 80: 166912}  # bytes of shared memory one block may use (227 KiB, 163 KiB)
TILE_CLASS = {90: "hopper", 80: "other"}  # kernels.attention.TILES' keys
B, T, C = 8, 512, 768  # the paper's batch: 8 sequences of 512 tokens, width 768
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class Launch:
    """One captured kernel launch: what it is (label) and the arguments the host code passed."""

    label: str
    kernel: JITFunction
    args: tuple
    kwargs: dict
    shipped: bool = True  # a configuration that runs (not an autotuning candidate)


@contextlib.contextmanager
def recording(label: str, launches: list[Launch]):
    """Kernel launches inside the block are recorded instead of run."""
    def record(kernel, *args, grid, warmup, **kwargs):
        launches.append(Launch(label, kernel, args, kwargs))

    with mock.patch.object(JITFunction, "run", record):
        yield


def attention_launches(arch: int, d: int, dtype: str, biases: bool, causal: bool,
                       tiles: dict[str, attn.Tile] | None = None) -> list[Launch]:
    """The launches of one forward and backward pass on GPT-2-shaped views, with `arch`'s shipped tiles or, for the
    passes in `tiles`, those."""
    heads = C // d
    qkv = torch.empty(B, T, 3 * C, dtype=DTYPES[dtype], requires_grad=True)
    q, k, v = (t.view(B, T, heads, d).transpose(1, 2) for t in qkv.split(C, dim=2))
    b_q, b_v = (torch.empty(d), torch.empty(d)) if biases else (None, None)
    grad = torch.empty(B, T, heads, d, dtype=qkv.dtype).transpose(1, 2)  # the gradient of y.transpose(1, 2)

    def tile_for(pass_name: str, x: torch.Tensor) -> attn.Tile:
        return (tiles or {}).get(pass_name) or attn.TILES[(TILE_CLASS[arch], pass_name, x.shape[-1])]

    label = f"d{d} {dtype} {'biases' if biases else 'no bias'} {'causal' if causal else 'bidir'}"
    if tiles:
        label += " " + ",".join(f"{t.block_m}x{t.block_n}" for t in tiles.values())
    launches: list[Launch] = []
    with recording(label, launches), mock.patch.object(attn, "tile_for", tile_for), \
            mock.patch.dict(os.environ, {attn.AUTOTUNE_ENV: "0"}):
        out = attn.attention_triton(q, k, v, b_q, b_v, causal)
        torch.autograd.grad(out, qkv, grad)
    return launches


def ecd_launches(pi_dtype: str, noise: bool, aligned: bool = True) -> list[Launch]:
    """The launches of one fused ECD step over a chunk holding a (768, 2304) matrix, a 2304 vector and a 768 one
    (7 elements more when not `aligned`), weight decay on."""
    sizes = [768 * 2304, 2304, 768 + (0 if aligned else 7)]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    table = ecd.block_table([(key, lo, hi) for key, (lo, hi) in enumerate(zip(bounds, bounds[1:]))],
                            torch.device("cpu"))
    n = bounds[-1]
    theta, grad, z = torch.empty(n), torch.empty(n), torch.empty(n) if noise else None
    pi = torch.empty(n, dtype=torch.bfloat16 if pi_dtype == "bf16" else torch.float32)
    coef = {name: torch.empty(3 if name == "A" else (), dtype=torch.float64)
            for name in ("A", "neg_k", "h", "inv_s", "nu")}
    label = f"Π {pi_dtype}{' noise' if noise else ''}{'' if aligned else ' unaligned'}"
    launches: list[Launch] = []
    with recording(label, launches):
        ecd.partial_dots(theta, grad, pi, table)
        ecd.apply_update(theta, grad, pi, z, table, coef, torch.empty(3, dtype=torch.float64), seed=12345)
    return launches


def soap_launches(state_dtype: str) -> list[Launch]:
    """The launch of one fused SOAP step (kernels/soap.py) over a chunk holding a (2304, 768) matrix, a 2304 vector
    and a 768 one, m and v in `state_dtype` (bf16: rounded stochastically)."""
    sizes = [768 * 2304, 2304, 768]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    table = soap.block_table([(lo, lo, hi) for lo, hi in zip(bounds, bounds[1:])], torch.device("cpu"))
    n = bounds[-1]
    g = torch.empty(n)
    m, v = (torch.empty(n, dtype=torch.bfloat16 if state_dtype == "bf16" else torch.float32) for _ in range(2))
    launches: list[Launch] = []
    with recording(f"m, v {state_dtype}", launches):
        soap.moments(g, m, v, g, table, 0.95, 0.95, 1e-8, seed=12345)
    return launches


def autotune_launches(arch: int) -> list[Launch]:
    """The training configuration's attention passes with every tile their autotuner tries."""
    tuned = {"fwd": attn._attn_fwd_tuned, "dkdv": attn._attn_bwd_dkdv_tuned, "dq": attn._attn_bwd_dq_tuned}
    launches = []
    for pass_name, autotuner in tuned.items():
        for config in autotuner.configs:
            tile = attn.Tile(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
            launches += [dataclasses.replace(x, shipped=False)
                         for x in attention_launches(arch, 64, "bf16", True, True, {pass_name: tile})
                         if x.kernel is autotuner.fn]
    return launches


def captured_launches(arch: int, subset: bool, autotune_tiles: bool = False) -> list[Launch]:
    """Every configuration's launches for one target (the training configuration only with `subset`; every
    autotuning tile too with `autotune_tiles`), each distinct build once."""
    attention = [(64, "bf16", True, True)] if subset else [
        (d, dtype, biases, causal) for d in ATTENTION_HEAD_DIMS for dtype in DTYPES for biases in (True, False)
        for causal in (True, False)]
    ecd_configs = [("fp32", False, True), ("bf16", True, True), ("fp32", False, False)]
    if not subset:
        ecd_configs += [("fp32", True, True), ("bf16", False, True)]
    launches = [x for config in attention for x in attention_launches(arch, *config)]
    launches += [x for config in ecd_configs for x in ecd_launches(*config)]
    launches += [x for dtype in (["fp32"] if subset else ["fp32", "bf16"]) for x in soap_launches(dtype)]
    launches += autotune_launches(arch) if autotune_tiles else []
    unique: dict[str, Launch] = {}
    for launch in launches:
        source, options = specialise(launch, TARGETS[f"sm_{arch}"])
        unique.setdefault(f"{source.hash()} {options['num_warps']} {options['num_stages']}", launch)
    return list(unique.values())


def specialise(launch: Launch, target: GPUTarget) -> tuple[ASTSource, dict]:
    """The source and options Triton's JIT would compile for this launch on `target` (its own binder: the
    run-time specialisation of every argument)."""
    backend = make_backend(target)
    binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = launch.kernel._pack_args(backend, launch.kwargs, bound, specialization,
                                                                     options)
    return ASTSource(launch.kernel, signature, constexprs, attrs), options.__dict__


def build(launch: Launch, target: GPUTarget) -> dict:
    """Compile one launch for `target` and read ptxas' report and the SASS."""
    source, options = specialise(launch, target)
    start = time.perf_counter()
    log = io.StringIO()
    with triton.knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed by Triton's build
        compiled = triton.compile(source, target=target, options=options)
    seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        cuobjdump = Path(get_ptxas(target.arch).path).parent / "cuobjdump"
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    report = log.getvalue()
    registers = re.search(r"Used (\d+) registers", report)
    loads = [int(width) for width in re.findall(r"\bLDG\.E(?:\.\w+)*?\.(\d+)\b", sass)]
    return {"kernel": launch.kernel.fn.__name__.lstrip("_"), "config": launch.label, "target": f"sm_{target.arch}",
            "warps": options["num_warps"], "stages": options["num_stages"],
            "registers": int(registers.group(1)) if registers else None,
            "spill_bytes": sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)),
            "shared_bytes": compiled.metadata.shared,
            "instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.MULTILINE)),
            "hgmma": len(re.findall(r"\bHGMMA\b", sass)), "hmma": len(re.findall(r"\bHMMA\b", sass)),
            "tma": len(re.findall(r"\b(?:UTMALDG|UTMASTG|UBLKCP)\b", sass)),
            "widest_load_bits": max(loads, default=32 if re.search(r"\bLDG\b", sass) else 0),
            "build_s": round(seconds, 2)}


def problems(row: dict) -> list[str]:
    """What makes a build unacceptable: spills, shared memory over the target's limit, no registers reported."""
    out = []
    if row["registers"] is None:
        out.append("no ptxas report")
    if row["spill_bytes"]:
        out.append(f"spills {row['spill_bytes']} bytes")
    limit = SHARED_LIMIT[int(row["target"].removeprefix("sm_"))]
    if row["shared_bytes"] > limit:
        out.append(f"shared memory {row['shared_bytes']} > {limit} bytes")
    return out


def print_row(row: dict) -> None:
    flags = "; ".join(row.get("problems", []))
    print(f"{row['target']:>6} {row['kernel']:<20} {row['config']:<28} {row['warps']:>2}w{row['stages']}s "
          f"{row['registers'] or 0:>4} {row['spill_bytes']:>6} {row['shared_bytes'] / 1024:>7.1f} "
          f"{row['instructions']:>6} {row['hgmma']:>5} {row['hmma']:>5} {row['tma']:>3} {row['widest_load_bits']:>4} "
          f"{row['build_s']:>5.1f}{'  <- ' + flags if flags else ''}", flush=True)


def build_all(targets: list[str], subset: bool, autotune_tiles: bool = False,
              show: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Every captured launch (`captured_launches`) built for each of `targets` in a fresh Triton cache, so that every
    build runs ptxas and reports: a row per build (build's, with its `problems`, or the build error: a result too),
    each also marked `shipped` (False for an autotuning candidate) and passed to `show` as it is made."""
    rows = []
    with tempfile.TemporaryDirectory() as cache, triton.knobs.cache.scope():
        triton.knobs.cache.dir = cache
        for name in targets:
            target = TARGETS[name]
            for launch in captured_launches(target.arch, subset, autotune_tiles):
                try:
                    row = build(launch, target)
                except Exception as exc:  # a build error is a result: report it and go on
                    row = {"kernel": launch.kernel.fn.__name__.lstrip("_"), "config": launch.label, "target": name,
                           "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                else:
                    row["problems"] = problems(row)
                row["shipped"] = launch.shipped
                show(row)
                rows.append(row)
    return rows


def show_row(row: dict) -> None:
    """One build's line as it is made: its figures, or its build error."""
    if "error" in row:
        print(f"{row['target']:>6} {row['kernel']:<20} {row['config']:<28} build error: {row['error']}", flush=True)
    else:
        print_row(row)


@exits_on_filesystem_errors("--json")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(module="bench.kernels", description=__doc__)
    parser.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=sorted(TARGETS, reverse=True),
                        help="GPU targets to build for (default: sm_90 sm_80)")
    parser.add_argument("--subset", action="store_true",
                        help="only the GPT-2 training configuration of each kernel (d 64, bf16, biases, causal; "
                             "ECD with fp32 Π, bf16 Π with noise, and one unaligned chunk; SOAP with fp32 m, v)")
    parser.add_argument("--autotune-tiles", action="store_true",
                        help="also the training configuration's attention passes with every tile the autotuner tries")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, {torch.__version__}: B={B} T={T} C={C}; registers, spill bytes, shared KiB, "
          "SASS instructions, HGMMA, HMMA, TMA, widest global load (bits), build seconds")
    print(f"{'target':>6} {'kernel':<20} {'config':<28} {'tile':>5} {'regs':>4} {'spill':>6} {'smem':>7} {'instr':>6} "
          f"{'hgmma':>5} {'hmma':>5} {'tma':>3} {'ld':>4} {'s':>5}")
    rows = build_all(args.targets, args.subset, args.autotune_tiles, show_row)
    failed = sum(row["shipped"] and bool("error" in row or row["problems"]) for row in rows)
    if args.json:
        atomic_write(args.json, json.dumps(rows, indent=1).encode())
    print(f"{len(rows)} builds, {failed} shipped with problems")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
