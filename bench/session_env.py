"""The GPU session's environment check, run by the interpreter the session will use (bench/gpu_session.py).

    python -m bench.session_env --out env.json

Writes one JSON object: the interpreter, torch, CUDA, the GPU, Triton, the driver, whether the tokenizer ranks are
cached (a machine without network cannot fetch them: carry data/cache), and `problem`, why the session cannot run
(no torch, no CUDA, a failed CUDA matmul or Triton kernel), absent when it can. Exits 0 when it can run, 3 when not.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

from cli import ArgumentParser
from fileio import atomic_write, exits_on_filesystem_errors

REPO = Path(__file__).resolve().parents[1]


def check() -> dict:
    """What the session needs, with the first `problem` found."""
    out: dict = {"python": sys.executable, "python_version": platform.python_version()}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 (a broken install can raise anything)
        return {**out, "problem": f"import torch failed: {type(exc).__name__}: {exc}"}
    out.update(torch=torch.__version__, cuda=torch.version.cuda)
    ranks = REPO / "data" / "cache" / "tiktoken"
    out["tokenizer_ranks"] = any(ranks.glob("*.tiktoken"))
    if not torch.cuda.is_available():
        return {**out, "problem": f"torch {torch.__version__} sees no CUDA device (CUDA build {torch.version.cuda})"}
    props = torch.cuda.get_device_properties(0)
    out.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count(),
               memory_gib=round(props.total_memory / 2**30, 1), driver=_nvidia_smi())
    try:
        x = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close((x @ x).float(), x.float() @ x.float(), rtol=3e-2, atol=1.0)
    except Exception as exc:  # noqa: BLE001
        return {**out, "problem": f"a bf16 matrix product on the GPU failed: {type(exc).__name__}: {exc}"}
    try:
        import triton

        out["triton"] = triton.__version__
        _triton_add(torch)
    except Exception as exc:  # noqa: BLE001
        return {**out, "problem": f"a Triton kernel failed to build or run: {type(exc).__name__}: {exc}"}
    return out


def _triton_add(torch) -> None:
    """Build and run a small Triton kernel and check its result."""
    import triton
    import triton.language as tl

    @triton.jit
    def add(X, Y, OUT, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + offs, tl.load(X + offs, mask=offs < N) + tl.load(Y + offs, mask=offs < N), mask=offs < N)

    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    add[(triton.cdiv(1000, 256),)](x, y, out, 1000, BLOCK=256)
    torch.testing.assert_close(out, x + y)


def _nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(module="bench.session_env", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    args = parser.parse_args(argv)
    result = check()
    atomic_write(args.out, json.dumps(result).encode())
    print(json.dumps(result))
    return 3 if "problem" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
