"""How much GPU memory one run of a grid takes, estimated from its configuration, and whether --runs-per-gpu of them
fit on a GPU (docs/grid.md#several-runs-per-gpu).

The estimate adds what a run holds for its whole length (parameters, gradients and the optimizer's state, counted on
the model and optimizer built on the meta device) and what a step needs on top: the activations kept for the backward
pass, per layer 34 bytes per token and unit of width in bf16 (Korthikanti et al., *Reducing Activation Recomputation
in Large Transformer Models*, arXiv:2205.05198, without the attention scores, which no attention path here stores),
twice that in fp32, and the logits (bf16, their fp32 copy for the loss and its gradient); a CUDA graph keeps its own
copy of a step's activations; and a fixed allowance for the CUDA context, the libraries' workspaces and the
allocator's slack. It is an estimate: `bench/gpu_session.sh` measures the peak of real runs."""
from __future__ import annotations

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

    hp, model_cfg = cfg.train, cfg.model
    with torch.device("meta"):
        model = train_gpt.GPT(model_cfg)
    optimizer = OPTIMIZERS[hp.optimizer].build(model, cfg.optim)  # its state on the model's (meta) device
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    micro_batch, _ = batch_layout(hp, gpus_per_run)
    tokens = micro_batch * hp.seq_len
    width = 2 if hp.dtype == "bf16" else 4  # bytes per activation value
    activations = int(model_cfg.n_layer * 17 * width * tokens * model_cfg.n_embd
                      + tokens * model_cfg.vocab_size * (width + 8))
    parts = {"parameters": weights, "gradients": weights,
             "optimizer state": optimizer_state_bytes(optimizer) + optimizer.first_step_state_bytes(),
             "activations": activations}
    if hp.compile_mode != "default":
        parts["CUDA graph"] = activations
    parts["context and slack"] = CONTEXT_BYTES + int((SLACK - 1) * sum(parts.values()))
    return parts


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def grid_memory(runs: list, gpus_per_run: int) -> dict[str, dict[str, int]]:
    """`run_memory` of every CUDA run of a grid that the trainer accepts (grid.plan.PlannedRun: its configuration as the
    plan parsed it), by run name."""
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
