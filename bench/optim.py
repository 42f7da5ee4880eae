"""Optimizer step benchmark: time of one `opt.step()` and optimizer state bytes per parameter, per optimizer.

    python -m bench.optim                                        # the 124M preset on CUDA if available
    python -m bench.optim --n-layer 2 --n-embd 256 --n-head 4    # a small model (what a 2-core CPU can time)

Builds `train_gpt.GPT(GPTConfig(...))`, fills its gradients with one real forward/backward, then for each
optimizer builds it from the registry with its SPEC §2 defaults and times `step()` alone (gradients fixed,
median over --steps after --warmup steps; CUDA synchronised around each step). ECD gets the measured loss.
The first SOAP step only builds its eigenbases, so warm-up must be >= 2 for SOAP's steady state.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_gpt  # noqa: E402
from optim import OPTIMIZERS, optimizer_state_bytes  # noqa: E402


def time_optimizer(name: str, model_cfg: train_gpt.GPTConfig, device: torch.device, args) -> dict:
    torch.manual_seed(0)
    model = train_gpt.GPT(model_cfg).to(device)
    spec = OPTIMIZERS[name]
    sharded = "optim_state_dtype" in {f.name for f in dataclasses.fields(spec.config)}
    opt_cfg = spec.config(optim_state_dtype=args.state_dtype) if sharded else spec.config()
    optimizers = spec.build(model, opt_cfg)
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
    return {"optimizer": name, "step_ms": 1e3 * statistics.median(times),
            "state_bytes_per_param": optimizer_state_bytes(optimizers) / num_params, "params": num_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", default="ecd,soap,muon,adamw,sgdm")
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    model_cfg = train_gpt.GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device {where} | torch {torch.__version__} | L={args.n_layer} H={args.n_head} C={args.n_embd} "
          f"| state dtype {args.state_dtype} | median of {args.steps} steps after {args.warmup} warm-up")
    for name in args.optimizers.split(","):
        r = time_optimizer(name, model_cfg, device, args)
        print(f"{r['optimizer']:>6}: {r['step_ms']:9.1f} ms/step | {r['state_bytes_per_param']:5.2f} bytes/param "
              f"of optimizer state | {r['params']:,} parameters")


if __name__ == "__main__":
    main()
