"""Gauge post-processing benchmark: time of one optimizer step with each `--gauge` mode against the bare step.

    python -m bench.gauge                                           # the gpt2-124m shapes, AdamW, CUDA if available
    python -m bench.gauge --optimizer muon --modes correct,project  # another optimizer, some modes
    python -m bench.gauge --n-layer 2 --n-embd 256 --n-head 4       # a small model

As bench/optim.py: builds `train_gpt.GPT(GPTConfig(...))` (default: 12 layers, 12 heads, C = 768, d = 64), fills its
gradients with one real forward/backward on random tokens, builds the optimizer from the registry with its
defaults, then times (median over --steps after --warmup, CUDA synchronised) the bare `step()` and, per mode,
snapshot + `step()` + `GaugeUpdates.after_step` (docs/gauge.md). Modes: correct[:full|diagonal], project[:gl|o],
dress, hyperball. `dress` is timed as one dressing per step (state_dict/load_state_dict included); the trainer
dresses every --gauge-every steps, so its per-step overhead is that time divided by --gauge-every (printed too).
"""
from __future__ import annotations

import statistics
import time

import torch

from bench.optim import add_step_flags
from cli import ArgumentParser
import train_gpt
from optim import OPTIMIZERS
from gauge.updates import GaugeUpdates
from fileio import exits_on_filesystem_errors


def time_steps(model, optimizer, spec, grads, loss, gauge: GaugeUpdates | None, args, device) -> float:
    """Median seconds of one step (gradients fixed) with the gauge's post-processing after it."""
    times = []
    for i in range(args.warmup + args.steps):
        with torch.no_grad():
            for p, g in grads.items():
                p.grad.copy_(g)
        torch.get_device_module(device).synchronize(device)
        start = time.perf_counter()
        before = gauge.snapshot(model) if gauge else None
        optimizer.step(loss) if spec.needs_loss else optimizer.step()
        if gauge:
            gauge.after_step(model, optimizer, before, step=i + 1)
        torch.get_device_module(device).synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[args.warmup:])


@exits_on_filesystem_errors("location")
def main() -> None:
    parser = ArgumentParser(module="bench.gauge", description=__doc__)
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS),
                        help="optimizer whose step is timed")
    parser.add_argument("--modes", default="correct,correct:diagonal,project,project:o,dress,hyperball",
                        help="comma-separated --gauge modes to time (mode:variant as in the module's docstring)")
    parser.add_argument("--gauge-every", type=int, default=10, help="dressing period used for the amortised figure")
    add_step_flags(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = train_gpt.GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = train_gpt.GPT(cfg).to(device)
    spec = OPTIMIZERS[args.optimizer]
    optimizer = spec.build(model, spec.config())
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), device=device)
    _, loss = model(idx, idx)
    loss.backward()
    loss = loss.detach()
    grads = {p: p.grad.clone() for p in model.parameters()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device {where} | torch {torch.__version__} | L={args.n_layer} H={args.n_head} C={args.n_embd} "
          f"d={cfg.head_dim} | {args.optimizer} | median of {args.steps} steps after {args.warmup} warm-up")
    bare = time_steps(model, optimizer, spec, grads, loss, None, args, device)
    print(f"{'bare step':>18}: {1e3 * bare:9.1f} ms")
    for variant in args.modes.split(","):
        mode, _, option = variant.partition(":")
        kwargs = {"correction": option} if mode == "correct" and option else {}
        kwargs.update({"group": option} if mode == "project" and option else {})
        gauge = GaugeUpdates(mode, cfg.n_head, every=1, **kwargs)
        total = time_steps(model, optimizer, spec, grads, loss, gauge, args, device)
        overhead = total - bare
        line = (f"{variant:>18}: {1e3 * total:9.1f} ms | overhead {1e3 * overhead:8.1f} ms = "
                f"{overhead / bare:6.2f}x bare")
        if mode == "dress":
            amortised = overhead / args.gauge_every
            line += f" | every {args.gauge_every} steps: {1e3 * amortised:.1f} ms/step = {amortised / bare:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
