"""Offline sm_90 (Hopper) build of the attention kernels: registers, spills, shared memory, tensor-core instructions.

    python -m bench.attention_sass                 # the shipped Hopper tiles (kernels.attention.TILES)
    python -m bench.attention_sass --all           # also every autotuning config

Needs no GPU: Triton compiles each pass for sm_90 (bf16, causal, b_Q and b_V present) to PTX, `ptxas -v` reports
registers and spill bytes, and the SASS from `cuobjdump -sass` is searched for HGMMA (wgmma) instructions. A config
that spills or has no HGMMA is flagged; speed still has to be measured on a GPU (bench/attention.py).
"""
from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from cli import ArgumentParser
from kernels import attention as attn

TARGET = GPUTarget("cuda", 90, 128)
POINTERS = {"LSE": "*fp32", "DELTA": "*fp32", "C": "*fp32", "BQ": "*fp32", "BV": "*fp32"}  # others: *bf16
FLOATS = {"qk_scale", "sm_scale"}
PASSES = {"fwd": attn._attn_fwd, "dkdv": attn._attn_bwd_dkdv, "dq": attn._attn_bwd_dq}
TUNED = {"fwd": attn._attn_fwd_tuned, "dkdv": attn._attn_bwd_dkdv_tuned, "dq": attn._attn_bwd_dq_tuned}


def compile_pass(name: str, head_dim: int, block_m: int, block_n: int, warps: int, stages: int) -> dict:
    """Build one pass for sm_90 and report what ptxas and the SASS say about it."""
    kernel = PASSES[name]
    params = list(inspect.signature(kernel.fn).parameters)
    constants = {"HEAD_DIM": head_dim, "CAUSAL": True, "HAS_BQ": True, "HAS_BV": True, "INPUT_PRECISION": "tf32",
                 "BLOCK_M": block_m, "BLOCK_N": block_n}
    signature = {}
    for p in params:
        if p in constants:
            signature[p] = "constexpr"
        elif p in FLOATS:
            signature[p] = "fp32"
        elif p[0].isupper() and p not in ("H", "T"):
            signature[p] = POINTERS.get(p, "*bf16")
        else:
            signature[p] = "i32"
    constants = {k: v for k, v in constants.items() if k in params}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=TARGET, options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(compiled.asm["ptx"])
        cubin.write_bytes(compiled.asm["cubin"])
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp) / "v")],
                                capture_output=True, text=True).stderr
        sass = subprocess.run([str(Path(get_ptxas(90).path).parent / "cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True).stdout
    registers = re.search(r"Used (\d+) registers", report)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    return {"pass": name, "d": head_dim, "tile": f"{block_m}x{block_n}", "warps": warps, "stages": stages,
            "registers": int(registers.group(1)) if registers else None, "spill_bytes": sum(spills),
            "shared_bytes": compiled.metadata.shared, "hgmma": len(re.findall(r"\bHGMMA\b", sass))}


def main() -> None:
    parser = ArgumentParser(module="bench.attention_sass", description=__doc__)
    parser.add_argument("--all", action="store_true", help="also every config the autotuner would try")
    args = parser.parse_args()
    jobs = [(name, d, t.block_m, t.block_n, t.num_warps, t.num_stages)
            for (gpu, name, d), t in attn.TILES.items() if gpu == "hopper"]
    if args.all:
        jobs += [(name, d, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                 for name, tuned in TUNED.items() for d in attn.HEAD_DIMS for c in tuned.configs]
    print(f"triton {triton.__version__}, target sm_90, bf16, causal, b_Q and b_V")
    print(f"{'pass':>5} {'d':>4} {'tile':>8} {'warps':>5} {'stages':>6} {'regs':>5} {'spill B':>8} {'smem KiB':>9} "
          f"{'HGMMA':>6}")
    for job in jobs:
        r = compile_pass(*job)
        flag = "  <- spills" if r["spill_bytes"] else ("  <- no wgmma" if not r["hgmma"] else "")
        print(f"{r['pass']:>5} {r['d']:>4} {r['tile']:>8} {r['warps']:>5} {r['stages']:>6} {r['registers']:>5} "
              f"{r['spill_bytes']:>8} {r['shared_bytes'] / 1024:>9.1f} {r['hgmma']:>6}{flag}")


if __name__ == "__main__":
    main()
