"""Optimizer step benchmark: time of one `opt.step()` and optimizer state bytes per parameter, per optimizer.

    python -m bench.optim                                        # the 124M preset on CUDA if available
    python -m bench.optim --n-layer 2 --n-embd 256 --n-head 4    # a small model (what a 2-core CPU can time)
    python -m bench.optim --optimizers ecd,ecd:unfused,adamw     # NAME:unfused turns the fused kernels off

Builds `train_gpt.GPT(GPTConfig(...))`, fills its gradients with one real forward/backward, then for each
optimizer builds it from the registry with its defaults and times `step()` alone (gradients fixed, median over
--steps after --warmup steps, with the fastest and slowest step beside it; CUDA synchronised around each step).
ECD gets the measured loss. The first SOAP step only builds its eigenbases, so warm-up must be >= 2 for SOAP's
steady state.

For the elementwise optimizers (ECD, SGDM, AdamW) it also prints the memory floor: the bytes a step must move at
least (read θ and g, write θ, read and write each state vector) over the copy bandwidth measured in the same run
(`dst.copy_(src)` of a 256 MiB buffer), and the step's fraction of it.

On a CPU the header names the instruction set and whether the CPU multiplies bf16 matrices natively (AVX512-BF16 or
AMX): Muon's Newton-Schulz iteration runs in bf16, and without native support those products are several times
slower. A wide spread between the fastest and the median step means other processes were competing for the cores;
small matrix products suffer most (each waits for every thread), and `OMP_NUM_THREADS=1` is then often faster.
BENCHMARKS.md records both effects on Muon.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cli import ArgumentParser  # noqa: E402
import train_gpt  # noqa: E402
from optim import OPTIMIZERS, optimizer_state_bytes  # noqa: E402


STATE_VECTORS = {"ecd": 1, "sgdm": 1, "adamw": 2}  # state tensors per parameter of the elementwise optimizers


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of `dst.copy_(src)` (read + write) on a 256 MiB fp32 buffer, median of 5."""
    src = torch.randn(1 << 26, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times[1:])


def cpu_description() -> str:
    """Threads, instruction set and native bf16 matrix support of this CPU (the latter matters for Muon)."""
    native_bf16 = any(getattr(torch.cpu, probe, lambda: False)()
                      for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return (f"cpu ({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, bf16 matmul "
            f"{'native' if native_bf16 else 'emulated: bf16 products (Muon) are slow'})")


def time_optimizer(variant: str, model_cfg: train_gpt.GPTConfig, device: torch.device, args) -> dict:
    torch.manual_seed(0)
    model = train_gpt.GPT(model_cfg).to(device)
    name, _, mode = variant.partition(":")
    spec = OPTIMIZERS[name]
    fields = {f.name for f in dataclasses.fields(spec.config)}
    overrides = {"optim_state_dtype": args.state_dtype} if "optim_state_dtype" in fields else {}
    if mode == "unfused":
        if "fused" not in fields:
            raise SystemExit(f"--optimizers {variant}: {name} has no fused path to turn off")
        overrides["fused"] = False
    optimizers = spec.build(model, spec.config(**overrides))
    idx = torch.randint(0, model_cfg.vocab_size, (args.batch, args.seq_len), device=device)
    _, loss = model(idx, idx)
    loss.backward()
    loss = loss.detach()
    grads = {p: p.grad.clone() for p in model.parameters()}

    def step() -> float:
        with torch.no_grad():
            for p, g in grads.items():  # the same gradient every step: only the optimizer is timed
                p.grad.copy_(g)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for opt in optimizers:
            opt.step(loss) if spec.needs_loss else opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    times = [step() for _ in range(args.steps)]
    num_params = model.get_num_params()
    state_bytes = optimizer_state_bytes(optimizers) / num_params
    floor_bytes = None
    if name in STATE_VECTORS:  # θ read and written, g read, each state vector read and written
        param_bytes = next(model.parameters()).element_size()
        floor_bytes = num_params * (3 * param_bytes + 2 * state_bytes)
    return {"optimizer": variant, "step_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "max_ms": 1e3 * max(times), "state_bytes_per_param": state_bytes, "params": num_params,
            "floor_bytes": floor_bytes}


def add_step_flags(parser: ArgumentParser) -> None:
    """The flags of an optimizer-step benchmark (this one and bench.gauge): the model's shape, the batch whose
    gradients are stepped, how many steps are timed, the device."""
    parser.add_argument("--n-layer", type=int, default=12, help="model layers (12: the 124M preset)")
    parser.add_argument("--n-head", type=int, default=12, help="attention heads")
    parser.add_argument("--n-embd", type=int, default=768, help="model width")
    parser.add_argument("--batch", type=int, default=2, help="sequences of the forward/backward giving the gradients")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence of that pass")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each variant (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 2 for SOAP)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda if available, else cpu")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="bench.optim", description=__doc__)
    parser.add_argument("--optimizers", default="ecd,soap,muon,adamw,sgdm",
                        help="comma-separated registry names; NAME:unfused turns a fused path off")
    add_step_flags(parser)
    parser.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16"], help="--optim-state-dtype")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model_cfg = train_gpt.GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    print(f"device {where} | torch {torch.__version__} | L={args.n_layer} H={args.n_head} C={args.n_embd} "
          f"| state dtype {args.state_dtype} | median of {args.steps} steps after {args.warmup} warm-up")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    for name in args.optimizers.split(","):
        r = time_optimizer(name, model_cfg, device, args)
        floor = ""
        if r["floor_bytes"]:
            floor_ms = 1e3 * r["floor_bytes"] / bandwidth
            share = 100 * floor_ms / r["step_ms"]
            floor = f" | floor {floor_ms:.2f} ms ({r['floor_bytes'] / 1e9:.2f} GB): {share:.0f}%"
        print(f"{r['optimizer']:>12}: {r['step_ms']:9.1f} ms/step (min {r['min_ms']:.1f}, max {r['max_ms']:.1f}) | "
              f"{r['state_bytes_per_param']:5.2f} bytes/param of optimizer state | {r['params']:,} parameters{floor}")


if __name__ == "__main__":
    main()
