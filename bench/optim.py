"""Optimizer step benchmark: time of `opt.step()` and optimizer state bytes per parameter, per optimizer, beside the
published implementations it is measured against.

    python -m bench.optim                                        # the 124M preset on CUDA if available
    python -m bench.optim --n-layer 2 --n-embd 256 --n-head 4    # a small model (what a 2-core CPU can time)
    python -m bench.optim --optimizers ecd,ecd:unfused,adamw     # NAME:unfused turns the fused kernels off
    python -m bench.optim --n-layer 6 --n-head 6 --n-embd 384 --optimizers soap,soap:bf16,soap:published \\
        --published-soap SOAP/soap.py                            # ours against the published SOAP

Variants: a registry name (ecd, soap, muon, adamw, sgdm) with its defaults, optionally with `:unfused` (its fused
path off) or `:bf16` (--optim-state-dtype bf16); and two peers, run from a checkout given on the command line (this
repository does not carry their code):
- `soap:published`: the SOAP class of github.com/nikhilvyas/SOAP's soap.py (`--published-soap FILE`), with our
  SOAP's default hyperparameters (the paper's);
- `muon:modded`: modded-nanogpt's Muon (`--modded-nanogpt FILE`: a train_gpt.py whose Muon is plain PyTorch, as up
  to commit 1b51e26d of github.com/KellerJordan/modded-nanogpt; its `zeropower_via_newtonschulz5` and `Muon` are
  loaded from the file without their decorators, so neither side is torch.compile'd, and its collectives run on a
  one-process stand-in) on the hidden matrices, the fused QKV matrix as three C×C blocks as its own attention does,
  plus torch's AdamW on the rest, each with our Muon's defaults.

Builds `train_gpt.GPT(GPTConfig(...))` per variant (same seed), fills its gradients with one real forward/backward
(the same gradients for every variant), then warms each variant up (--warmup steps; the first SOAP step only builds
its eigenbases) and times `step()` alone (the gradients are put back before each step, outside the timing; CUDA
synchronised around each step). The variants are interleaved: each of --rounds rounds runs every variant for
--steps consecutive steps (20 steps hold two of SOAP's refreshes at its frequency 10), in alternating order, and a
variant's figure is the median over rounds of its mean step, with the fastest and slowest round beside it. Each
variant is then compared with the references of its own optimizer in the run (--ratio-to) and with --baseline: the
median of its per-round ratios, with their range. The 1-minute load average is printed at the start and the end:
on a shared machine compare only figures measured together.

For the elementwise optimizers (ECD, SGDM, AdamW) it also prints the memory floor: the bytes a step must move at
least (read θ and g, write θ, read and write each state vector) over the copy bandwidth measured in the same run
(`dst.copy_(src)` of a 256 MiB buffer), and the step's fraction of it.

On a CPU the header names the instruction set and whether the CPU multiplies bf16 matrices natively (AVX512-BF16 or
AMX): Muon's Newton-Schulz iteration runs in bf16, and without native support those products are several times
slower. A wide spread between the fastest and the median round means other processes were competing for the cores;
small matrix products suffer most (each waits for every thread), and `OMP_NUM_THREADS=1` is then often faster.
BENCHMARKS.md records both effects on Muon.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist

from cli import ArgumentParser
import train_gpt
from optim import OPTIMIZERS
from optim.muon import MuonConfig, muon_groups
from optim.soap import SOAPConfig
from fileio import exits_on_filesystem_errors

ELEMENTWISE = ("ecd", "sgdm", "adamw")  # the optimizers a memory floor is printed for
PEERS = {"soap:published": "--published-soap", "muon:modded": "--modded-nanogpt"}


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of `dst.copy_(src)` (read + write) on a 256 MiB fp32 buffer, median of 5."""
    src = torch.randn(1 << 26, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        torch.get_device_module(device).synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.get_device_module(device).synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times[1:])


def cpu_description() -> str:
    """Threads, instruction set and native bf16 matrix support of this CPU (the latter matters for Muon)."""
    native_bf16 = any(getattr(torch.cpu, probe, lambda: False)()
                      for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return (f"cpu ({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, bf16 matmul "
            f"{'native' if native_bf16 else 'emulated: bf16 products (Muon) are slow'})")


class OneProcess:
    """The torch.distributed calls of modded-nanogpt's Muon.step for a single process: every collective is the
    identity and completes at once."""

    ReduceOp = dist.ReduceOp

    @staticmethod
    def get_rank() -> int:
        return 0

    @staticmethod
    def get_world_size() -> int:
        return 1

    @staticmethod
    def _done() -> SimpleNamespace:
        future = torch.futures.Future()
        future.set_result(None)
        return SimpleNamespace(get_future=lambda: future, wait=lambda: None)

    def reduce_scatter(self, output, inputs, op=None, async_op=False):
        if inputs[0] is not output:
            output.copy_(inputs[0])
        return self._done()

    def all_gather(self, outputs, tensor, async_op=False):
        if outputs[0] is not tensor:
            outputs[0].copy_(tensor)
        return self._done()


def load_published_soap(path: Path) -> type:
    """The SOAP class of the published soap.py at `path`."""
    spec = importlib.util.spec_from_file_location("published_soap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SOAP


def published_soap_settings(cfg: SOAPConfig) -> dict:
    """Our SOAP's hyperparameters as the published SOAP's keyword arguments."""
    return dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                precondition_frequency=cfg.soap_precondition_frequency, max_precond_dim=cfg.soap_max_precond_dim)


def load_modded_muon(path: Path) -> type:
    """modded-nanogpt's Muon class from its train_gpt.py at `path`: only `zeropower_via_newtonschulz5` and `Muon` are
    executed (the script itself starts a training run), without decorators, with `OneProcess` as torch.distributed."""
    wanted = {"zeropower_via_newtonschulz5", "Muon"}
    nodes = [node for node in ast.parse(path.read_text()).body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in wanted]
    if {node.name for node in nodes} != wanted:
        raise SystemExit(f"--modded-nanogpt {path}: no plain-PyTorch zeropower_via_newtonschulz5 and Muon in it; use "
                         "modded-nanogpt's train_gpt.py up to commit 1b51e26d")
    for node in nodes:
        node.decorator_list = []
    namespace = {"torch": torch, "Tensor": torch.Tensor, "dist": OneProcess()}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace["Muon"]


def state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor in the optimizers' state, also inside lists (the published SOAP keeps its factors so)."""
    def walk(value) -> int:
        if torch.is_tensor(value):
            return value.numel() * value.element_size()
        return sum(map(walk, value)) if isinstance(value, (list, tuple)) else 0
    return sum(walk(value) for opt in optimizers for state in opt.state.values() for value in state.values())


@dataclasses.dataclass
class Variant:
    name: str
    step: Callable[[], None]
    optimizers: list
    params: int
    floor_bytes: float | None = None


def peer_optimizers(name: str, model: train_gpt.GPT, args) -> list[torch.optim.Optimizer]:
    """The published SOAP, or modded-nanogpt's Muon + torch's AdamW, on `model` with our defaults."""
    if name == "soap:published":
        cfg = SOAPConfig()
        soap = load_published_soap(Path(args.published_soap))
        return [soap(model.parameters(), **published_soap_settings(cfg))]
    cfg = MuonConfig()
    muon = load_modded_muon(Path(args.modded_nanogpt))
    groups, matrices = muon_groups(model, cfg), []
    for group in (g for g in groups if g["use_muon"]):
        for param_name, p in zip(group["names"], group["params"]):
            if param_name.endswith("attn.c_attn.weight"):  # q, k, v: one (3, C, C) tensor
                blocks = torch.nn.Parameter(p.detach().view(3, -1, p.shape[-1]))
                blocks.grad = p.grad.view(blocks.shape)
                p = blocks
            matrices.append(p)
    adam = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups if not g["use_muon"]]
    return [muon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum),
            torch.optim.AdamW(adam, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)]


def build_variant(variant: str, model_cfg: train_gpt.GPTConfig, device: torch.device, args) -> Variant:
    torch.manual_seed(0)
    model = train_gpt.GPT(model_cfg).to(device)
    name, _, mode = variant.partition(":")
    if variant not in PEERS and (name not in OPTIMIZERS or mode not in ("", "unfused", "bf16")):
        raise SystemExit(f"--optimizers {variant}: expected NAME, NAME:unfused, NAME:bf16 (NAME one of "
                         f"{', '.join(OPTIMIZERS)}) or one of {', '.join(PEERS)}")
    spec = OPTIMIZERS[name]
    idx = torch.randint(0, model_cfg.vocab_size, (args.batch, args.seq_len), device=device)
    if variant in PEERS:
        _, loss = model(idx, idx)
        loss.backward()
        optimizers = peer_optimizers(variant, model, args)
    else:
        fields = {f.name for f in dataclasses.fields(spec.config)}
        overrides = {"optim_state_dtype": "bf16" if mode == "bf16" else args.state_dtype} \
            if "optim_state_dtype" in fields else {}
        if mode == "unfused":
            if "fused" not in fields:
                raise SystemExit(f"--optimizers {variant}: {name} has no fused path to turn off")
            overrides["fused"] = False
        optimizers = [spec.build(model, spec.config(**overrides))]
        _, loss = model(idx, idx)
        loss.backward()
    loss = loss.detach()
    grads = [(opt_p, opt_p.grad.clone()) for opt in optimizers for group in opt.param_groups
             for opt_p in group["params"]]

    def step() -> float:
        with torch.no_grad():
            for p, g in grads:  # the same gradient every step (a step may consume it): only the optimizer is timed
                p.grad.copy_(g)
        torch.get_device_module(device).synchronize(device)
        start = time.perf_counter()
        for opt in optimizers:
            opt.step(loss) if spec.needs_loss and variant not in PEERS else opt.step()
        torch.get_device_module(device).synchronize(device)
        return time.perf_counter() - start

    num_params = model.get_num_params()
    floor_bytes = None
    if name in ELEMENTWISE and variant not in PEERS:  # θ read and written, g read, each state vector both ways
        floor_bytes = 3 * num_params * next(model.parameters()).element_size() + 2 * state_bytes(optimizers)
    return Variant(variant, step, optimizers, num_params, floor_bytes)


def measure(variants: list[Variant], args) -> dict[str, list[float]]:
    """Mean step time per round and variant, the variants interleaved (alternating order) after the warm-up; each
    round's figures go to stderr as it ends (long runs keep what they measured)."""
    for v in variants:
        for _ in range(args.warmup):
            v.step()
    rounds: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            rounds[v.name].append(sum(v.step() for _ in range(args.steps)) / args.steps)
        print(f"round {r + 1}/{args.rounds} (load {load()}): " + ", ".join(
            f"{name} {1e3 * times[-1]:.1f} ms" for name, times in rounds.items()), file=sys.stderr, flush=True)
    return rounds


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def add_step_flags(parser: ArgumentParser, steps: int = 5,
                   steps_help: str = "timed steps of each variant (the median is reported)") -> None:
    """The flags of an optimizer-step benchmark (this one and bench.gauge): the model's shape, the batch whose
    gradients are stepped, how many steps are timed, the device."""
    parser.add_argument("--n-layer", type=int, default=12, help="model layers (12: the 124M preset)")
    parser.add_argument("--n-head", type=int, default=12, help="attention heads")
    parser.add_argument("--n-embd", type=int, default=768, help="model width")
    parser.add_argument("--batch", type=int, default=2, help="sequences of the forward/backward giving the gradients")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence of that pass")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 2 for SOAP)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda if available, else cpu")


@exits_on_filesystem_errors("location")
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="bench.optim", description=__doc__)
    parser.add_argument("--optimizers", default="ecd,soap,muon,adamw,sgdm",
                        help="comma-separated variants: NAME, NAME:unfused, NAME:bf16, soap:published, muon:modded")
    parser.add_argument("--published-soap", metavar="FILE", help="soap.py of github.com/nikhilvyas/SOAP (for "
                        "soap:published)")
    parser.add_argument("--modded-nanogpt", metavar="FILE", help="train_gpt.py of github.com/KellerJordan/"
                        "modded-nanogpt with a plain-PyTorch Muon, up to commit 1b51e26d (for muon:modded)")
    parser.add_argument("--ratio-to", default="soap:published,muon:modded",
                        help="references: each variant is compared with those of its own optimizer present in the run")
    parser.add_argument("--baseline", default="adamw", help="every variant is also compared with this one, if run")
    add_step_flags(parser, steps=20, steps_help="consecutive timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of interleaved variants (median reported)")
    parser.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16"],
                        help="--optim-state-dtype of the variants without :bf16")
    args = parser.parse_args(argv)
    names = args.optimizers.split(",")
    for peer, flag in PEERS.items():
        path = getattr(args, flag[2:].replace("-", "_"))
        if peer in names and not (path and Path(path).is_file()):
            parser.error(f"{peer} needs {flag} FILE (a checkout of the peer's repository); got {path!r}")
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")
    device = torch.device(args.device)
    model_cfg = train_gpt.GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    print(f"device {where} | torch {torch.__version__} | L={args.n_layer} H={args.n_head} C={args.n_embd} "
          f"| state dtype {args.state_dtype} | {args.rounds} interleaved rounds of {args.steps} steps after "
          f"{args.warmup} warm-up | load {load()}")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    variants = [build_variant(name, model_cfg, device, args) for name in names]
    rounds = measure(variants, args)
    references = [name for name in args.ratio_to.split(",") if name in rounds]
    family = lambda name: name.partition(":")[0]  # noqa: E731
    for v in variants:
        times = rounds[v.name]
        median = 1e3 * statistics.median(times)
        floor = ""
        if v.floor_bytes:
            floor_ms = 1e3 * v.floor_bytes / bandwidth
            floor = f" | floor {floor_ms:.2f} ms ({v.floor_bytes / 1e9:.2f} GB): {100 * floor_ms / median:.0f}%"
        print(f"{v.name:>15}: {median:9.1f} ms/step (min {1e3 * min(times):.1f}, max {1e3 * max(times):.1f}) | "
              f"{state_bytes(v.optimizers) / v.params:5.2f} bytes/param of optimizer state | {v.params:,} "
              f"parameters{floor}")
        compared = [ref for ref in references if family(ref) == family(v.name)]
        compared += [args.baseline] if args.baseline in rounds and args.baseline not in compared else []
        ratios = [(ref, [a / b for a, b in zip(times, rounds[ref])]) for ref in compared if ref != v.name]
        if ratios:
            print(" " * 17 + "; ".join(f"{statistics.median(r):.2f}x {ref} ({min(r):.2f}-{max(r):.2f})"
                                       for ref, r in ratios))
    print(f"load {load()} at the end")


if __name__ == "__main__":
    main()
