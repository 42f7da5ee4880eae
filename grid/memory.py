"""How much GPU memory one run of a grid takes, and whether --runs-per-gpu of them fit on a GPU
(docs/grid.md#several-runs-per-gpu).

What the run allocates is asked of the trainer's own code, not modelled beside it: the parameters, gradients and
optimizer state of its model and optimizer (train_gpt.GPT, optim.OPTIMIZERS) built on the meta device, and the
activations its forward pass keeps for the backward pass, counted by running that forward pass (activation_bytes).
What the GPU adds is the grid's: a CUDA graph's own copy of a step's activations and an allowance for the CUDA context,
the libraries' workspaces and the allocator's slack. It is an estimate (torch.compile keeps fewer activations, the
attention path and the backward pass's temporaries differ): `bench/gpu_session.sh` measures the peak of real runs.
The trainer's modules (torch) are imported by the functions that build the model, not by this module."""
from __future__ import annotations

import dataclasses
import functools
import json

GIB = 2**30
CONTEXT_BYTES = int(1.5 * GIB)  # the CUDA context, cuBLAS/cuDNN workspaces, compiled kernels
SLACK = 1.1  # the caching allocator's fragmentation
USABLE = 0.95  # of a GPU's memory, what runs may plan to take


def run_memory(cfg, gpus_per_run: int = 1) -> dict[str, int]:
    """The bytes one process of a run (a train_gpt RunConfig) takes on its GPU, by part."""
    import torch

    import train_gpt
    from optim import OPTIMIZERS, optimizer_state_bytes
    from run.process import batch_layout

    hp = cfg.train
    with torch.device("meta"):
        model = train_gpt.GPT(cfg.model)
    optimizer = OPTIMIZERS[hp.optimizer].build(model, cfg.optim)  # its state on the model's (meta) device
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    micro_batch, _ = batch_layout(hp, gpus_per_run)
    activations = activation_bytes(json.dumps(dataclasses.asdict(cfg.model)), micro_batch, hp.seq_len,
                                   hp.dtype == "bf16")
    parts = {"parameters": weights, "gradients": weights,
             "optimizer state": optimizer_state_bytes(optimizer) + optimizer.first_step_state_bytes(),
             "activations": activations}
    if hp.compile_mode != "default":
        parts["CUDA graph"] = activations
    parts["context and slack"] = CONTEXT_BYTES + int((SLACK - 1) * sum(parts.values()))
    return parts


@functools.cache
def activation_bytes(model_json: str, micro_batch: int, seq_len: int, bf16: bool) -> int:
    """The bytes the trainer's forward pass of one micro-batch keeps for the backward pass (saved_tensor_sizes), and
    the first gradient the backward pass makes beside them (as large as the largest kept tensor, the loss's
    log-probabilities): counted by running train_gpt.GPT with the configuration `model_json` (a GPTConfig as JSON)
    on `micro_batch` sequences of `seq_len` tokens on fake tensors, which allocate nothing. With `bf16` under bf16
    autocast, as a CUDA run computes: the CPU's autocast stands in for CUDA's, so the fake tensors are CPU tensors
    (the meta device has no autocast; torch's FakeTensorMode gives tensors of any device without memory)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import train_gpt

    with FakeTensorMode():
        model = train_gpt.GPT(train_gpt.GPTConfig(**json.loads(model_json)))
        sizes = saved_tensor_sizes(model, torch.zeros(micro_batch, seq_len, dtype=torch.long), bf16)
    return sum(sizes) + max(sizes, default=0)


def saved_tensor_sizes(model, tokens, bf16: bool) -> list[int]:
    """The bytes of each storage that `model`'s forward pass and loss on `tokens` (as inputs and targets, with biases
    of the sampler's shape) keep for the backward pass, each storage once (views of it too) and the weights not (they
    are the parameters); with `bf16` under the CPU's bf16 autocast."""
    import torch

    def identity(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage()._cdata  # the storage's, shared by its views (a fake tensor has no address)

    weights = {identity(t) for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if identity(tensor) not in weights:
            saved[identity(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(tokens, tokens, torch.zeros_like(model.mean_biases))
    return list(saved.values())


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def grid_memory(runs: list, gpus_per_run: int) -> dict[str, dict[str, int]]:
    """`run_memory` of every CUDA run of a grid that the trainer accepts (grid.plan.PlannedRun: its configuration as
    the plan parsed it), by run name."""
    return {run.name: run_memory(run.config, gpus_per_run) for run in runs
            if run.problem is None and run.device == "cuda"}


def heaviest(memory: dict[str, dict[str, int]]) -> tuple[str, int]:
    """(name, bytes) of the run that needs the most."""
    name = max(memory, key=lambda run: sum(memory[run].values()))
    return name, sum(memory[name].values())


def fit_problem(memory: dict[str, dict[str, int]], runs_per_gpu: int, gpu_memory: int) -> str | None:
    """Why `runs_per_gpu` runs as heavy as the heaviest of `memory` (grid_memory's) do not fit in `gpu_memory` bytes,
    with the numbers; None when they do."""
    if not memory:
        return None
    name, need = heaviest(memory)
    usable = USABLE * gpu_memory
    if runs_per_gpu * need <= usable:
        return None
    fits = int(usable // need)
    parts = ", ".join(f"{part} {gib(n)}" for part, n in memory[name].items())
    return (f"--runs-per-gpu {runs_per_gpu}: {runs_per_gpu} runs of about {gib(need)} each ({name}: {parts}) need "
            f"{gib(runs_per_gpu * need)}, more than {USABLE:.0%} of a GPU's {gib(gpu_memory)}; use "
            + (f"--runs-per-gpu {fits}" if fits else "a smaller --micro-batch or model") + " (docs/grid.md)")


def memory_line(memory: dict[str, dict[str, int]], runs_per_gpu: int, gpu_memory: int | None) -> str:
    """The plan's memory line: the heaviest run's estimate, and what `runs_per_gpu` of them take of a GPU."""
    if not memory:
        return "memory: no CUDA run"
    name, need = heaviest(memory)
    head = f"memory: about {gib(need)} per run at most ({name})"
    if gpu_memory is None:
        return head + "; not checked against a GPU (none here: --gpu-memory GIB gives its size)"
    return head + f"; {runs_per_gpu} per GPU: {gib(runs_per_gpu * need)} of {gib(gpu_memory)}"
