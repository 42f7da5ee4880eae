"""Train GPT-2 with symmetry-breaking attention biases (docs/model.md), on 1..N GPUs under torchrun or on a CPU.

    python train_gpt.py --preset smoke                                  # CPU, a few minutes, embedded corpus
    torchrun --standalone --nproc_per_node=8 train_gpt.py               # the paper's run on 8 GPUs

Reads top to bottom: configuration (dataclasses, presets, CLI) → model (GPT-2 with per-batch sampled b_Q, b_V)
→ bias sampler → checkpoints and run directories → training (setup, build, restore, loop, finish). Importing this
module has no side effects. References: nanoGPT (model layout and names), modded-nanogpt (trainer shape), arXiv
2601.22257 (the symmetry-breaking protocol), docs/ (every formula and default used here).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import secrets
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from itertools import chain, islice
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from cli import add_flags, flag, option
from data.loader import DistributedTokenLoader, validation_batches
from data.shards import DIGEST_CACHE, atomic_writer, describe_shards
from kernels.attention import attention
from optim import OPTIMIZERS, OptimizerConfig, optimizer_state_bytes, optimizer_state_tensors
from optim.registry import upgrade_saved_config
from optim.distributed import all_reduce_sum, init_process_group
from gauge.dynamics import VELOCITY_OPTIMIZERS, dynamics_summary, velocity_from_optimizers
from gauge.sensitivity import training_summary
from gauge.updates import GAUGE_MODES, GaugeUpdates

REPO_ROOT = Path(__file__).resolve().parent
CHECKPOINT_FORMAT = "symgpt-checkpoint-v1"

# -----------------------------------------------------------------------------------------------------------------
# Configuration. Every field of GPTConfig, Hyperparameters and the chosen optimizer's config is a flag
# `--field-name` (see cli.flag); its default is written once, in the field.


@dataclass
class GPTConfig:
    """GPT-2 architecture and symmetry-breaking biases; defaults are the paper's 124M model (docs/model.md)."""

    vocab_size: int = flag(50304, "vocabulary (50257 GPT-2 tokens padded to a multiple of 64)")
    block_size: int = flag(512, "context length (positional embeddings); the paper uses 512, GPT-2 1024")
    n_layer: int = flag(12, "transformer blocks")
    n_head: int = flag(12, "attention heads per block")
    n_embd: int = flag(768, "model width C; head dim d = C / n_head")
    activation: str = flag("prelu", "MLP activation: prelu (per-feature slope, init N(0.2, 1)) or gelu",
                           choices=("prelu", "gelu"))
    bias_mode: str = flag("bqbv", "symmetry breaking: none, bq, bv, bqbv (sampled per batch) or learned "
                                  "(docs/model.md)",
                          choices=("none", "bq", "bv", "bqbv", "learned"))
    mean_q: float = flag(0.5, "E[b_Q], every component")
    std_q_min: float = flag(0.05, "per-dimension std of b_Q = linspace(std_q_min, std_q_max, d)")
    std_q_max: float = flag(0.15, "see --std-q-min")
    mean_v: float = flag(0.0, "E[b_V], every component (the paper tries 0 and 0.5)")
    std_v_min: float = flag(0.02, "per-dimension std of b_V = linspace(std_v_min, std_v_max, d)")
    std_v_max: float = flag(0.02, "see --std-v-min")
    bias_per_head: bool = flag(False, "sample one vector per head instead of one per layer shared by all heads")
    key_bias: bool = flag(False, "also sample b_K ~ N(mean_q, std_q) on keys: an exact no-op, for parity checks")
    init: str = flag("normal", "attention initialisation: normal, or symmetric (W_K := W_Q, so every head's W_QK is "
                               "symmetric; docs/variants.md#symmetric-initialisation)", choices=("normal", "symmetric"))
    objective: str = flag("clm", "clm (next-token prediction, causal attention) or mlm (masked tokens, attention "
                                 "in both directions; docs/variants.md#masked-lm-objective)", choices=("clm", "mlm"))
    mask_prob: float = flag(0.15, "mlm: fraction of each sequence's positions masked (round(mask_prob x seq_len), "
                                  "at least one)")
    mask_token: int = flag(50257, "mlm: the [MASK] input id; 50257 is the first padded id, which GPT-2 text never "
                                  "holds")
    attention: str = flag("standard", "standard (dot-product heads with the biases) or relational (Gram attention, a "
                                      "pure-PyTorch prototype for small models; docs/variants.md#relational-attention)",
                          choices=("standard", "relational"))
    relational_hidden: int = flag(32, "relational attention: hidden width of the score MLP f")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def sampled_biases(self) -> tuple[bool, bool, bool]:
        """Which of (b_Q, b_K, b_V) are drawn by the sampler in this mode."""
        uses_q = self.bias_mode in ("bq", "bqbv")
        uses_v = self.bias_mode in ("bv", "bqbv")
        return uses_q, self.key_bias and self.bias_mode != "learned", uses_v


@dataclass
class Hyperparameters:
    """Optimizer choice, data, schedule, evaluation, checkpoints, logging and system settings of a run."""

    optimizer: str = flag("adamw", "optimizer (listed below); its hyperparameters are the optimizer flags",
                          choices=tuple(sorted(OPTIMIZERS)))
    train_files: str = flag("", "glob of training shards; empty: FineWeb-Edu if downloaded, else the embedded corpus")
    val_files: str = flag("", "glob of validation shards; empty: --train-files, else the default data's validation")
    seq_len: int = flag(512, "tokens per training sequence (<= block_size)")
    batch_tokens: int = flag(4096, "global batch per optimizer step in tokens (paper: 8 x 512, no accumulation)")
    micro_batch: int = flag(8, "most sequences per forward/backward pass on one rank (a memory bound): each rank "
                               "runs the largest micro-batch up to this that splits its share of the batch, and "
                               "accumulates gradients over the rest")
    align_to_eot: bool = flag(False, "start every training sequence at an <|endoftext|> token")
    steps: int = flag(122070, "optimizer steps (paper: 500M tokens / 4096 tokens per step)")
    lr_schedule: str = flag("constant", "constant, cosine (after warmup) or linear (constant, then linear cooldown)",
                            choices=("constant", "cosine", "linear"))
    warmup_steps: int = flag(0, "linear warmup steps")
    cooldown_frac: float = flag(0.2, "linear schedule: fraction of steps spent decaying to min_lr_frac")
    min_lr_frac: float = flag(0.0, "final learning rate as a fraction of the peak (cosine, linear)")
    grad_clip: float = flag(0.0, "clip the global gradient norm to this value (0: off); also logs the norm")
    val_every: int = flag(1000, "validate every N steps (and at the start and end); 0: only at the end")
    val_tokens: int = flag(1048576, "fixed validation token budget (the same tokens every time)")
    val_batch_estimate: bool = flag(True, "also log the published runs' validation: at each multiple of "
                                          "--val-every the loss on the next batch of --batch-tokens validation "
                                          "tokens, and the minimum of these single-batch estimates "
                                          "(docs/optimizers.md#paper-parity)")
    log_every: int = flag(10, "print and log a line every N steps")
    checkpoint_every: int = flag(5000, "write checkpoints/latest.pt every N steps (0: only at the end, on "
                                       "SIGINT/SIGTERM and at a target stop)")
    keep_checkpoints: bool = flag(False, "also keep checkpoints/step_XXXXXX.pt at every checkpoint")
    target_val_loss: float = flag(0.0, "report the first step and training time reaching this validation loss "
                                       "(0: off)")
    stop_at_target: bool = flag(False, "stop the run once target_val_loss is reached")
    dynamics_every: int = flag(0, "log angular momentum / rotational fraction every N steps (0: off; "
                                  "docs/evaluation.md)")
    gauge_diagnostic_every: int = flag(0, "log the gauge sensitivity of one fresh-optimizer step every N steps "
                                          "(0: off; docs/structure.md#gauge-sensitivity-diagnostic)")
    gauge: str = flag("none", "post-process each step on the attention heads' factor gauge (docs/gauge.md): "
                              "correct (opposite-Gram), project (orbit-transverse), dress (Gram-balanced "
                              "representatives every --gauge-every steps) or hyperball", choices=GAUGE_MODES)
    gauge_correction: str = flag("full", "--gauge correct: full, diagonal (Gram diagonals) or periodic (full every "
                                         "--gauge-every steps, diagonal otherwise)",
                                 choices=("full", "diagonal", "periodic"))
    gauge_every: int = flag(10, "--gauge dress: dress every N steps; --gauge-correction periodic: full every N")
    gauge_damping: float = flag(1e-3, "--gauge correct: damping λ added to the opposite Gram")
    gauge_group: str = flag("gl", "--gauge project: remove motion along GL(d) (gl) or only O(d) rotations (o)",
                            choices=("gl", "o"))
    hyperball_lr: float = flag(0.01, "--gauge hyperball: step length η relative to each head factor's norm (times "
                                     "the learning-rate schedule)")
    run_dir: str = flag("runs", "parent directory of run directories")
    run_name: str = flag("", "run directory name (default: timestamp-preset-optimizer); an existing run is "
                             "never overwritten")
    resume: str = flag("", "checkpoint file or run directory to resume from: its config is the base and flags "
                           "override it; the run continues in the checkpoint's run directory unless --run-name or "
                           "--run-dir name a new one")
    init_from: str = flag("", "start from the model weights of this checkpoint file or run directory, e.g. GPT-2 "
                              "converted by `python -m export from-hf` (docs/export.md#hugging-face); optimizer, "
                              "data and step start fresh; ignored by --resume")
    seed: int = flag(1337, "seed for initialisation and the bias sampler")
    device: str = flag("auto", "auto, cpu or cuda", choices=("auto", "cpu", "cuda"))
    dtype: str = flag("bf16", "autocast dtype on CUDA: bf16 or fp32 (CPU always computes in fp32)",
                      choices=("bf16", "fp32"))
    compile: bool = flag(True, "torch.compile the model on CUDA")
    overlap_reduce: bool = flag(True, "ECD/SOAP/Muon under torchrun: average each gradient bucket while the "
                                      "backward pass computes the others (as DDP does)")
    wandb_project: str = flag("", "also send the config and log.jsonl's numbers to this Weights & Biases project "
                                  "(needs `pip install wandb`; empty: off)")
    wandb_run_name: str = flag("", "Weights & Biases run name (default: the run directory's name)")


# The paper's training run (docs/model.md#the-papers-model): 8 x 512 tokens per step in one pass (no gradient
# accumulation on up to 8 ranks), 500M tokens, constant learning rate. Pinned here, though they are the defaults, so
# that the presets keep reproducing the published runs if a default changes. The optimizers' defaults are their
# published updates with the Table 9 hyperparameters (docs/optimizers.md#paper-parity).
PAPER_RUN: dict[str, object] = {
    "activation": "prelu", "seq_len": 512, "batch_tokens": 4096, "micro_batch": 8, "steps": 122070,
    "lr_schedule": "constant", "warmup_steps": 0, "grad_clip": 0.0,
}
PRESETS: dict[str, dict[str, object]] = {
    "gpt2-124m": PAPER_RUN,
    "gpt2-124m-gelu": {**PAPER_RUN, "activation": "gelu"},
    # A few minutes on a 2-core CPU: a narrow model on the embedded corpus, AdamW with warmup and cosine decay.
    "smoke": {
        "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128,
        "seq_len": 128, "micro_batch": 16, "batch_tokens": 2048, "steps": 100,
        "lr_schedule": "cosine", "warmup_steps": 10, "min_lr_frac": 0.1,
        "val_every": 50, "val_tokens": 16384, "log_every": 10, "device": "cpu", "compile": False,
        "optimizer": "adamw", "lr": 2e-3,  # a preset's optimizer settings apply to its own optimizer only
    },
}
PRESET_NOTES = {
    "gpt2-124m": "the paper's GPT-2 small (PReLU) run: model, 500M tokens, batch 8 x 512 without accumulation, "
                 "constant learning rate, and the optimizer's published update with its Table 9 hyperparameters",
    "gpt2-124m-gelu": "the paper's GPT-2 small run with GELU: as gpt2-124m but the activation",
    "smoke": "no published run (a few minutes on a CPU to check the trainer)",
}
PAPER_OPTIMIZERS = ("adamw", "ecd", "sgdm", "soap")  # Table 9 of the paper
VALIDATION_PROTOCOL_NOTE = ("validation protocol: the published runs report the best validation loss as the minimum "
                            "over single-batch estimates (logged here as val_loss_batch and best_val_loss_batch "
                            "with --val-batch-estimate); val_loss is the mean loss over the same fixed "
                            "--val-tokens budget each time (docs/evaluation.md#validation-loss)")
PRECISION_NOTES = {
    "bf16": "precision: bf16 autocast on CUDA; the published trainer computes in fp32 with TF32 matmuls (bf16 only "
            "with its --use_bf16)",
    "fp32": "precision: fp32 with fp32 matmuls; the published trainer uses TF32 matmuls",
}
# Fields that change the published numbers when they differ from the paper presets (seeds, logging and the choice
# of kernel implementation do not; the precision has its own note).
PAPER_INDIFFERENT = {"dtype", "fused", "optim_seed", "seed", "val_every", "val_batch_estimate", "log_every",
                     "checkpoint_every", "keep_checkpoints", "run_dir", "run_name", "resume", "device", "compile",
                     "overlap_reduce", "dynamics_every", "target_val_loss", "stop_at_target", "train_files",
                     "val_files", "val_tokens"}
# What a resumed run cannot change: the model, and what fixes the data order, the biases and the optimizer state
# (the decay groups are the optimizers' parameter groups).
FIXED_ON_RESUME = ("optimizer", "train_files", "seq_len", "batch_tokens", "align_to_eot", "seed")
FIXED_OPTIM_ON_RESUME = ("decay_groups",)


@dataclass
class RunConfig:
    """A run's whole configuration: model, training and the chosen optimizer's hyperparameters."""

    model: GPTConfig
    train: Hyperparameters
    optim: OptimizerConfig
    preset: str | None = None
    continue_in: Path | None = None  # a resumed run's own directory, when the run goes on there (see resume_home)

    def to_dict(self) -> dict:
        return {"model": asdict(self.model), "train": asdict(self.train), "optim": asdict(self.optim)}


def config_from_dict(d: dict, cls: type = GPTConfig):
    """A config dataclass (GPTConfig, Hyperparameters, ...) from a saved section: missing keys take the defaults,
    unknown keys are ignored (checkpoints of older or newer code)."""
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def config_classes(optimizer: str) -> dict[str, type]:
    return {"model": GPTConfig, "train": Hyperparameters, "optim": OPTIMIZERS[optimizer].config}


def preset_values(preset: str | None, optimizer: str) -> dict[str, dict]:
    """Each config section's values under `preset` for `optimizer`: the defaults, then the preset's entries (those
    of the optimizer section only when the preset names no other optimizer)."""
    entries = PRESETS[preset] if preset else {}
    base = {section: asdict(cls()) for section, cls in config_classes(optimizer).items()}
    for section, values in base.items():
        if section != "optim" or entries.get("optimizer", optimizer) == optimizer:
            values.update({k: v for k, v in entries.items() if k in values})
    base["train"]["optimizer"] = optimizer
    return base


def preset_report(cfg: RunConfig) -> dict:
    """What a run reproduces of the published runs and what differs (config.json's "preset" entry, printed at the
    start of log.txt; docs/optimizers.md#paper-parity). A run without --preset is compared with gpt2-124m, whose
    values are the defaults."""
    name = cfg.preset
    if name is not None and name not in ("gpt2-124m", "gpt2-124m-gelu"):
        return {"name": name, "reproduces": PRESET_NOTES.get(name, ""), "differs": []}
    reference = name or "gpt2-124m"
    optimizer = cfg.train.optimizer
    differs = [] if optimizer in PAPER_OPTIMIZERS else [
        f"--optimizer {optimizer} is not one of the paper's optimizers ({', '.join(PAPER_OPTIMIZERS)})"]
    paper = preset_values(reference, optimizer)
    for section, values in cfg.to_dict().items():
        for field, value in values.items():
            if field not in PAPER_INDIFFERENT and value != paper[section][field]:
                differs.append(f"{option(field)} {value} ({reference}: {paper[section][field]})")
    return {"name": name, "compared_with": reference, "reproduces": PRESET_NOTES[reference],
            "differs": differs + [PRECISION_NOTES[cfg.train.dtype], VALIDATION_PROTOCOL_NOTE]}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def build_arg_parser(optimizer: str, base: dict[str, dict]) -> argparse.ArgumentParser:
    """A parser with one flag per field of the model, training and `optimizer` configs, defaulting to `base`
    (defaults ← preset ← resumed config); the epilog lists every optimizer and the others' flags."""
    lines = ["optimizers (--optimizer NAME; its flags replace the optimizer group above):"]
    shared = {f.name for f in dataclasses.fields(OptimizerConfig)} - {"lr", "weight_decay"}
    for name, spec in sorted(OPTIMIZERS.items()):
        lines.append(f"  {name:6} {spec.description}")
        if name != optimizer:
            own = [f for f in dataclasses.fields(spec.config) if f.name not in shared]
            lines.append("         " + ", ".join(f"{option(f.name)} {f.default}" for f in own))
    parser = argparse.ArgumentParser(
        description="Train GPT-2 with symmetry-breaking attention biases (see README.md).",
        formatter_class=_HelpFormatter, epilog="\n".join(lines))
    parser.add_argument("--preset", choices=sorted(PRESETS), default=argparse.SUPPRESS,
                        help="named configuration; flags override it. gpt2-124m (and -gelu) pin the paper's run, "
                             "whose values are also the defaults (docs/optimizers.md#paper-parity)")
    titles = {"model": "model (GPTConfig)", "train": "training (Hyperparameters)",
              "optim": f"optimizer {optimizer} ({OPTIMIZERS[optimizer].config.__name__})"}
    for section, cls in config_classes(optimizer).items():
        add_flags(parser.add_argument_group(titles[section]), cls, base[section])
    return parser


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """Defaults ← preset ← resumed checkpoint's config ← command-line flags, then validated."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS))
    pre.add_argument("--resume", default="")
    pre.add_argument("--optimizer", choices=sorted(OPTIMIZERS))
    known, _ = pre.parse_known_args(argv)
    saved = None
    if known.resume:
        try:
            checkpoint = load_checkpoint(resolve_checkpoint_path(known.resume), mmap=True)  # reads no tensor
            if "optimizers" not in checkpoint:
                raise CheckpointError(f"--resume {known.resume}: the checkpoint holds only model weights (no "
                                      f"training state); start a new run from them with --init-from {known.resume}")
            saved = checkpoint["config"]
        except CheckpointError as exc:
            pre.error(str(exc))
        saved = {**saved, "optim": upgrade_saved_config(saved.get("optim", {}))}
    optimizer = (known.optimizer or (saved["train"].get("optimizer") if saved else None)
                 or PRESETS.get(known.preset, {}).get("optimizer") or Hyperparameters.optimizer)
    base = preset_values(known.preset, optimizer)
    for section, values in base.items():
        if saved and (section != "optim" or saved["train"].get("optimizer") == optimizer):
            values.update({k: v for k, v in saved.get(section, {}).items() if k in values})
    base["train"]["optimizer"] = optimizer
    parser = build_arg_parser(optimizer, base)
    foreign = _foreign_optimizer_flag(argv, optimizer)
    if foreign:
        parser.error(foreign)
    args = vars(parser.parse_args(argv))
    cfg = RunConfig(*(config_from_dict(args, cls) for cls in config_classes(optimizer).values()), known.preset)
    if saved:
        given = {arg.split("=")[0].removeprefix("--").replace("-", "_") for arg in argv if arg.startswith("--")}
        cfg.continue_in = resume_home(cfg.train, given)
        if cfg.continue_in is None and "run_name" not in given:
            cfg.train.run_name = ""  # a new directory for a resumed run gets a fresh default name
    problem = config_problem(cfg, world_size_from_env()) or (resume_problem(cfg, saved) if saved else None)
    if problem:
        parser.error(problem)
    return cfg


def _foreign_optimizer_flag(argv: list[str], optimizer: str) -> str | None:
    """An error for a flag that belongs to another optimizer's config than the chosen one, or None."""
    own = {f.name for cls in config_classes(optimizer).values() for f in dataclasses.fields(cls)}
    for arg in argv:
        name = arg.split("=")[0].removeprefix("--no-").removeprefix("--").replace("-", "_")
        if not arg.startswith("--") or name in own:
            continue
        owners = [n for n, spec in sorted(OPTIMIZERS.items())
                  if name in {f.name for f in dataclasses.fields(spec.config)}]
        if owners:
            return f"{arg.split('=')[0]} is a flag of --optimizer {' / '.join(owners)}; this run uses {optimizer}"
    return None


def world_size_from_env() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def batch_layout(hp: Hyperparameters, world: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) of each rank: the largest micro-batch <= --micro-batch that splits the rank's
    share of the global batch evenly, and the number of micro-steps it takes. Raises ValueError (naming the flags
    and a fix) when the batch does not split over the ranks."""
    if hp.batch_tokens % hp.seq_len:
        raise ValueError(f"--batch-tokens {hp.batch_tokens} must be a multiple of --seq-len {hp.seq_len}")
    sequences = hp.batch_tokens // hp.seq_len
    if sequences % world:
        raise ValueError(
            f"--batch-tokens {hp.batch_tokens} is {sequences} sequences of --seq-len {hp.seq_len}, which do not split "
            f"over {world} processes: set --batch-tokens to a multiple of {hp.seq_len} x {world} = "
            f"{hp.seq_len * world}, e.g. {hp.seq_len * world * max(1, round(sequences / world))}")
    per_rank = sequences // world
    micro = max(m for m in range(1, min(hp.micro_batch, per_rank) + 1) if per_rank % m == 0)
    return micro, per_rank // micro


def config_problem(cfg: RunConfig, world: int = 1) -> str | None:
    """The first inconsistency between flags, phrased as what to change; None when the config is valid."""
    model, hp, opt = cfg.model, cfg.train, cfg.optim
    positive = {"vocab_size": model.vocab_size, "block_size": model.block_size, "n_layer": model.n_layer,
                "n_head": model.n_head, "n_embd": model.n_embd, "seq_len": hp.seq_len,
                "micro_batch": hp.micro_batch, "batch_tokens": hp.batch_tokens, "steps": hp.steps,
                "val_tokens": hp.val_tokens, "log_every": hp.log_every, "lr": opt.lr}
    for name, value in positive.items():
        if value <= 0:
            return f"{option(name)} must be positive, got {value}"
    for name in ("warmup_steps", "val_every", "checkpoint_every", "dynamics_every", "gauge_diagnostic_every", "seed",
                 "grad_clip"):
        if getattr(hp, name) < 0:
            return f"{option(name)} must be >= 0, got {getattr(hp, name)}"
    for name in ("std_q_min", "std_q_max", "std_v_min", "std_v_max"):
        if getattr(model, name) < 0:
            return f"{option(name)} must be >= 0, got {getattr(model, name)}"
    if opt.weight_decay < 0:
        return f"--weight-decay must be >= 0, got {opt.weight_decay}"
    if model.n_embd % model.n_head:
        return f"--n-embd {model.n_embd} must be divisible by --n-head {model.n_head}"
    if hp.seq_len > model.block_size:
        return f"--seq-len {hp.seq_len} exceeds --block-size {model.block_size}"
    if not 0.0 <= hp.cooldown_frac <= 1.0 or not 0.0 <= hp.min_lr_frac <= 1.0:
        return "--cooldown-frac and --min-lr-frac must lie in [0, 1]"
    if hp.dynamics_every and hp.optimizer not in VELOCITY_OPTIMIZERS:
        return (f"--dynamics-every needs a velocity, which docs/evaluation.md defines for --optimizer "
                f"{', '.join(VELOCITY_OPTIMIZERS)}; {hp.optimizer} has none (set --dynamics-every 0)")
    if hp.init_from and not hp.resume:
        try:
            resolve_checkpoint_path(hp.init_from, flag="--init-from")
        except CheckpointError as exc:
            return str(exc)
    problem = variant_problem(model, hp)
    if problem:
        return problem
    if hp.gauge_diagnostic_every and hp.optimizer == "soap":
        return ("--gauge-diagnostic-every compares one step of a fresh optimizer, and SOAP's first step only builds "
                "its preconditioner (no motion); set --gauge-diagnostic-every 0")
    if hp.gauge_every < 1 or hp.gauge_damping < 0 or hp.hyperball_lr <= 0:
        return "--gauge-every must be >= 1, --gauge-damping >= 0 and --hyperball-lr > 0"
    if hp.gauge == "dress" and model.bias_mode == "learned" and not model.bias_per_head:
        return ("--gauge dress moves each head by its own gauge, which a learned bias shared by the heads cannot "
                "follow: add --bias-per-head")
    if hp.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is available (use --device cpu)"
    if hp.wandb_project and not module_available("wandb"):
        return (f"--wandb-project {hp.wandb_project}: the wandb package is not installed; `pip install wandb` "
                "(then `wandb login`), or leave --wandb-project empty")
    try:
        batch_layout(hp, world)
    except ValueError as exc:
        return str(exc)
    return existing_run_problem(hp, cfg.continue_in)


def module_available(name: str) -> bool:
    """Whether `import name` can succeed, without importing it."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


RELATIONAL_MEMORY_LIMIT = 8 * 2**30  # bytes of score-MLP activations per micro-batch beyond which we refuse


def relational_activation_bytes(model: GPTConfig, micro_batch: int, seq_len: int) -> int:
    """What relational attention keeps for the backward pass per micro-batch: per layer and token pair the three
    Gram features, the score MLP's hidden layer before and after the activation, and per head the score, its
    softmax and the masked score (fp32)."""
    per_pair = 3 + 2 * model.relational_hidden + 3 * model.n_head
    return 4 * model.n_layer * micro_batch * seq_len * seq_len * per_pair


def variant_problem(model: GPTConfig, hp: Hyperparameters) -> str | None:
    """Flags of the model variants (docs/variants.md) that cannot work together; None when they can."""
    if not 0.0 < model.mask_prob <= 1.0:
        return f"--mask-prob must lie in (0, 1], got {model.mask_prob}"
    if model.objective == "mlm" and not 0 <= model.mask_token < model.vocab_size:
        return (f"--mask-token {model.mask_token} is not an id of the vocabulary (--vocab-size {model.vocab_size}): "
                "choose an id below the vocabulary size that the data never holds")
    if model.attention != "relational":
        return None
    if model.bias_mode != "none" or model.key_bias:
        return ("--attention relational has no queries, keys or values to bias: add --bias-mode none (and drop "
                "--key-bias)")
    if model.init == "symmetric":
        return "--init symmetric sets W_K := W_Q, which --attention relational does not have: use --init normal"
    if hp.dynamics_every or hp.gauge != "none" or hp.gauge_diagnostic_every:
        return ("--dynamics-every, --gauge and --gauge-diagnostic-every act on the heads' W_Q, W_K, W_V, W_O, which "
                "--attention relational does not have: leave them off")
    if model.relational_hidden <= 0:
        return f"--relational-hidden must be positive, got {model.relational_hidden}"
    needed = relational_activation_bytes(model, hp.micro_batch, hp.seq_len)
    if needed > RELATIONAL_MEMORY_LIMIT:
        return (f"--attention relational is a prototype for small models: --micro-batch {hp.micro_batch} x "
                f"--seq-len {hp.seq_len} over {model.n_layer} layers would keep {needed / 2**30:.1f} GiB of score "
                f"activations (limit {RELATIONAL_MEMORY_LIMIT / 2**30:.0f} GiB); lower --micro-batch (the batch is "
                "kept by accumulating gradients), --seq-len or --relational-hidden")
    return None


def resume_problem(cfg: RunConfig, saved: dict) -> str | None:
    """A flag given on --resume that cannot take effect (the model, the data order, the biases, the optimizer),
    phrased as what to do; None when every flag can."""
    model = asdict(cfg.model)
    for name, value in saved["model"].items():
        if name in model and model[name] != value:
            return (f"{option(name)} cannot change when resuming (the checkpoint's model has {value}, the flags "
                    f"give {model[name]}); start a new run instead")
    for name in FIXED_ON_RESUME:
        old, new = saved["train"].get(name), getattr(cfg.train, name)
        if old is not None and old != new:
            return (f"{option(name)} cannot change when resuming (the checkpoint has {old!r}, the flags give "
                    f"{new!r}): it fixes the data order, the biases or the optimizer state; start a new run instead")
    for name in FIXED_OPTIM_ON_RESUME:
        old, new = saved["optim"].get(name), getattr(cfg.optim, name)
        if old is not None and old != new:
            return (f"{option(name)} cannot change when resuming (the checkpoint has {old!r}, the flags give "
                    f"{new!r}): it fixes the optimizer's parameter groups; start a new run instead")
    return None


def resume_home(hp: Hyperparameters, given: set[str]) -> Path | None:
    """The directory a resumed run goes on in: the checkpoint's run directory (run_dir_of), unless the flags given
    (`given`) name another with --run-name/--run-dir; None means a new run directory."""
    home = run_dir_of(resolve_checkpoint_path(hp.resume))
    if home is None or not given & {"run_name", "run_dir"}:
        return home
    return home if hp.run_name and (Path(hp.run_dir) / hp.run_name).absolute() == home else None


def existing_run_problem(hp: Hyperparameters, continue_in: Path | None) -> str | None:
    """An error when a new run would write into an earlier run's directory (named by --run-name)."""
    if not hp.run_name or continue_in is not None:
        return None
    path = Path(hp.run_dir) / hp.run_name
    if path.is_dir() and any(path.iterdir()):
        return (f"--run-name {hp.run_name}: {path} already holds a run; continue it with --resume {path}, or choose "
                "another --run-name")
    return None


# -----------------------------------------------------------------------------------------------------------------
# Model: nanoGPT's GPT-2 with the symmetry-breaking biases injected into attention (docs/model.md).


class CausalSelfAttention(nn.Module):
    """Multi-head dot-product attention with the biases; causal under --objective clm, in both directions under mlm."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.causal = config.objective == "clm"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.is_residual_projection = True
        if config.bias_mode == "learned":
            # Seed 000 App. F: trainable biases initialised from the sampling distribution (restores the symmetry).
            shape = (config.n_head, config.head_dim) if config.bias_per_head else (config.head_dim,)
            self.b_q = nn.Parameter(torch.empty(shape))
            self.b_v = nn.Parameter(torch.empty(shape))

    def forward(
        self, x: torch.Tensor, b_q: torch.Tensor | None, b_k: torch.Tensor | None, b_v: torch.Tensor | None
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        if hasattr(self, "b_q"):
            b_q, b_v = self.b_q, self.b_v
        if b_k is not None:  # cancels in the softmax (constant per query row); kept only for parity checks
            k = k + (b_k if b_k.dim() == 1 else b_k.unsqueeze(1)).to(k.dtype)
        y = attention(q, k, v, b_q, b_v, causal=self.causal)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class RelationalAttention(nn.Module):
    """Relational (Gram) attention (docs/variants.md#relational-attention), a pure-PyTorch prototype for small models.

    With X the (T, C) LayerNormed token states and G = XXᵀ/C, head h scores s_ij = f(G_ij, G_ii, G_jj)_h with f a
    small MLP (3 -> relational_hidden -> n_head), masks them (causal under clm), takes the softmax A_h, and the
    output is Y = (Σ_h α_h A_h) X with learned mixing scalars α_h. The values are the token states themselves (no
    W_V, no W_O), so the layer is O(C)-equivariant: X -> XR gives Y -> YR for every orthogonal R. The biases of the
    standard attention have nothing to act on here (the configuration refuses them).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.causal = config.objective == "clm"
        self.score = nn.Sequential(nn.Linear(3, config.relational_hidden), nn.GELU(),
                                   nn.Linear(config.relational_hidden, config.n_head))
        for layer in self.score:
            layer.fan_in_init = True
        self.mix = nn.Parameter(torch.empty(config.n_head))

    def forward(self, x: torch.Tensor, b_q=None, b_k=None, b_v=None) -> torch.Tensor:
        B, T, C = x.shape
        gram = x @ x.transpose(1, 2) / C
        norms = gram.diagonal(dim1=1, dim2=2)
        pairs = torch.stack([gram, norms[:, :, None].expand(B, T, T), norms[:, None, :].expand(B, T, T)], dim=-1)
        scores = self.score(pairs).permute(0, 3, 1, 2)  # (B, H, T, T): query i, key j
        if self.causal:
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        mixing = torch.einsum("h,bhij->bij", self.mix.to(scores.dtype), scores.softmax(dim=-1))
        return mixing.to(x.dtype) @ x


class FeaturePReLU(nn.PReLU):
    """PReLU with one learnable negative slope per feature of the last dimension (nn.PReLU's is dim 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x >= 0, x, x * self.weight.to(x.dtype))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.act = FeaturePReLU(4 * config.n_embd) if config.activation == "prelu" else nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.is_residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = RelationalAttention(config) if config.attention == "relational" else CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, b_q=None, b_k=None, b_v=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), b_q, b_k, b_v)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 (pre-LN, learned positions, tied embeddings) whose attention takes per-batch biases b_Q, b_V.

    forward(idx, targets, biases): `biases` is what `BiasSampler.sample` returns — a tensor (n_layer, 3, d) or
    (n_layer, 3, H, d) holding b_Q, b_K, b_V per layer; None means evaluation, which uses the means (docs/model.md).
    Targets equal to -1 are not scored (under --objective mlm every position but the masked ones). Variants
    (docs/variants.md): --init symmetric, --objective mlm (attention in both directions), --attention relational.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.register_buffer("mean_biases", mean_biases(config), persistent=False)
        self.apply(self._init_weights)
        if config.init == "symmetric":
            self._copy_queries_to_keys()

    def _init_weights(self, module: nn.Module) -> None:
        """N(0, 0.02), residual projections scaled by (2L)^-1/2, biases zero, PReLU slopes N(0.2, 1) (docs/model.md).
        Relational attention (docs/variants.md#relational-attention): the score MLP N(0, 1/fan_in), each mixing
        scalar α_h = 0.02 · 0.02/√(2L) · C / H, so Σ_h α_h is the gain 0.02√C · 0.02/√(2L)·√C that a
        standard layer's W_V W_O has at this initialisation."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if hasattr(module, "is_residual_projection") else 0.02
            if hasattr(module, "fan_in_init"):
                std = module.in_features ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.PReLU):
            torch.nn.init.normal_(module.weight, mean=0.2, std=1.0)
        elif isinstance(module, CausalSelfAttention) and hasattr(module, "b_q"):
            mean_q, std_q, mean_v, std_v = bias_distribution(self.config)
            with torch.no_grad():
                module.b_q.copy_(mean_q + std_q * torch.randn_like(module.b_q))
                module.b_v.copy_(mean_v + std_v * torch.randn_like(module.b_v))
        elif isinstance(module, RelationalAttention):
            cfg = self.config
            torch.nn.init.constant_(module.mix, 0.02 * 0.02 / math.sqrt(2 * cfg.n_layer) * cfg.n_embd / cfg.n_head)

    @torch.no_grad()
    def _copy_queries_to_keys(self) -> None:
        """--init symmetric (docs/variants.md#symmetric-initialisation): W_K := W_Q and c_K := c_Q in every layer,
        after the normal initialisation (which therefore draws the same numbers), so M_QK = W_Qᵀ W_K is symmetric
        per head and per layer."""
        C = self.config.n_embd
        for block in self.transformer.h:
            c_attn = block.attn.c_attn
            c_attn.weight[C:2 * C].copy_(c_attn.weight[:C])
            c_attn.bias[C:2 * C].copy_(c_attn.bias[:C])

    def get_num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (tied weights once); non_embedding drops the positional table, as in nanoGPT."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, biases: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        if biases is None:
            biases = self.mean_biases
        use_q, use_k, use_v = self.config.sampled_biases
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for i, block in enumerate(self.transformer.h):
            x = block(x, biases[i, 0] if use_q else None, biases[i, 1] if use_k else None,
                      biases[i, 2] if use_v else None)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
        vocab_limit: int | None = None, generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue each row of idx (B, T) by max_new_tokens sampled tokens, with the mean biases, as nanoGPT does:
        the context is cropped to block_size, logits are divided by `temperature` (0: greedy) and cut to the `top_k`
        most likely tokens. `vocab_limit` samples only ids below it, e.g. the tokenizer's 50257 when the vocabulary
        is padded (docs/export.md#sampling)."""
        if self.config.objective != "clm":
            raise ValueError(f"this model was trained with --objective {self.config.objective}: it predicts masked "
                             "tokens from both sides, not the next token, so it cannot generate text")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[0][:, -1, :vocab_limit].float()
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    def estimate_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·H·d·T for attention (PaLM App. B, nanoGPT)."""
        cfg = self.config
        return 6 * self.get_num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * seq_len


# -----------------------------------------------------------------------------------------------------------------
# Symmetry-breaking bias sampler (docs/model.md): stateless, each draw a function of (seed, step, layer).


def bias_distribution(config: GPTConfig) -> tuple[float, torch.Tensor, float, torch.Tensor]:
    """(μ_Q, σ_Q, μ_V, σ_V) with σ per dimension = linspace(min, max, d)."""
    d = config.head_dim
    std_q = torch.linspace(config.std_q_min, config.std_q_max, d)
    std_v = torch.linspace(config.std_v_min, config.std_v_max, d)
    return config.mean_q, std_q, config.mean_v, std_v


def _bias_shape(config: GPTConfig) -> tuple[int, ...]:
    return (config.n_layer, 3, config.n_head, config.head_dim) if config.bias_per_head else (
        config.n_layer, 3, config.head_dim)


def mean_biases(config: GPTConfig) -> torch.Tensor:
    """E[b_Q], E[b_K] (= E[b_Q]), E[b_V] per layer, in the sampler's layout: what evaluation uses."""
    out = torch.empty(_bias_shape(config))
    out[:, 0] = config.mean_q
    out[:, 1] = config.mean_q
    out[:, 2] = config.mean_v
    return out


class BiasSampler:
    """Draws b_Q, b_K, b_V for one optimizer step: one draw per layer per training batch (docs/model.md), shared by
    every micro-batch and every rank of the step.

    Layer i's draw at `step` comes from numpy's SeedSequence([seed, step, i]). It holds no state, so a resumed run
    and a run on any number of GPUs, with any micro-batch split, see the same biases for the same data.
    """

    def __init__(self, config: GPTConfig, seed: int):
        self.config, self.seed = config, seed
        _, std_q, _, std_v = bias_distribution(config)
        self.mean = mean_biases(config)[0].numpy()
        std = np.stack([std_q.numpy(), std_q.numpy(), std_v.numpy()])  # (3, d)
        self.std = std[:, None, :] if config.bias_per_head else std

    def sample(self, step: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The (n_layer, 3, [n_head,] d) draws; None when the mode samples no bias (the forward pass reads none)."""
        if not any(self.config.sampled_biases):
            return None
        shape = _bias_shape(self.config)
        draws = np.empty(shape, dtype=np.float32)
        for layer in range(self.config.n_layer):
            rng = np.random.default_rng([self.seed, step, layer])
            draws[layer] = self.mean + self.std * rng.standard_normal(shape[1:])
        tensor = torch.from_numpy(draws)
        device = torch.device(device)
        if device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "rule": "SeedSequence([seed, step, layer])"}


# -----------------------------------------------------------------------------------------------------------------
# Masked-LM masking (docs/variants.md#masked-lm-objective): stateless, each row's mask a function of (seed, step, row).

# Distinct first words keep these random streams apart from each other and from the bias sampler's.
TRAINING_MASKS = 0x4D41534B  # "MASK"
VALIDATION_MASKS = 0x56414C4D  # "VALM"


class TokenMasker:
    """Masks round(mask_prob · T) positions (at least one) of every sequence: inputs there become mask_token, the
    targets are the original tokens there and -1 (not scored) everywhere else.

    Row r of a training step's global batch (its index in the step's rows, whatever the rank and micro-batch; see
    data/loader.py) draws its positions from numpy's SeedSequence([TRAINING_MASKS, seed, step, r]); row r of the
    validation stream from SeedSequence([VALIDATION_MASKS, r]), the same in every run. No state: a resumed run and a
    run on any number of GPUs mask the same positions of the same data. Every row has the same number of masked
    positions, so the mean loss of equal micro-batches is the mean over all masked positions of the batch.
    """

    def __init__(self, config: GPTConfig):
        self.mask_prob, self.mask_token = config.mask_prob, config.mask_token

    def masked_count(self, seq_len: int) -> int:
        return max(1, round(self.mask_prob * seq_len))

    def positions(self, first_row: int, rows: int, seq_len: int, step_key: tuple[int, int] | None = None
                  ) -> np.ndarray:
        """Boolean (rows, seq_len) mask of rows first_row, first_row + 1, ...: of a training step with
        step_key = (seed, step), of the validation stream with None."""
        stream = [TRAINING_MASKS, *step_key] if step_key is not None else [VALIDATION_MASKS]
        count = self.masked_count(seq_len)
        mask = np.zeros((rows, seq_len), dtype=bool)
        for i in range(rows):
            rng = np.random.default_rng([*stream, first_row + i])
            mask[i, rng.choice(seq_len, size=count, replace=False)] = True
        return mask

    def apply(self, x: torch.Tensor, first_row: int, step_key: tuple[int, int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(masked inputs, targets) of the token rows x (B, T) whose first row is `first_row` (see `positions`)."""
        mask = torch.from_numpy(self.positions(first_row, x.shape[0], x.shape[1], step_key)).to(x.device)
        return x.masked_fill(mask, self.mask_token), torch.where(mask, x, -1)


# -----------------------------------------------------------------------------------------------------------------
# Checkpoints and run directories: one API for the trainer, eval/ and bench/.
#   <run>/config.json  log.txt (the code, then every printed line)  log.jsonl  code/  checkpoints/latest.pt


class CheckpointError(ValueError):
    """A checkpoint path that is missing or does not hold a checkpoint written by this trainer."""


def run_dir_of(checkpoint: str | os.PathLike) -> Path | None:
    """The run directory a checkpoint belongs to (<run>/checkpoints/FILE -> <run>); None for a file elsewhere."""
    parent = Path(checkpoint).absolute().parent
    return parent.parent if parent.name == "checkpoints" else None


def resolve_checkpoint_path(path: str | os.PathLike, flag: str = "--resume") -> Path:
    """A checkpoint file, or a run directory (→ its checkpoints/latest.pt); an error naming the flag and file."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoints" / "latest.pt"
    if not path.is_file():
        raise CheckpointError(f"{flag}: no checkpoint at {path}; a run writes one at its end, every "
                              "--checkpoint-every steps and when it is interrupted (SIGINT/SIGTERM)")
    return path


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", mmap: bool = False) -> dict:
    """Load and check a checkpoint written by `save_checkpoint` (mmap: tensors are read only when touched). A tied
    weight stored once (see checkpoint_model_state) is filled in under each of its names."""
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except Exception as exc:  # torch reports a foreign file through several types, none naming the file
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint ({reason}); give a file written by train_gpt.py "
                              "(<run>/checkpoints/latest.pt or step_XXXXXX.pt) or its run directory") from exc
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a {CHECKPOINT_FORMAT} checkpoint")
    return link_tied(ckpt)


def link_tied(ckpt: dict) -> dict:
    """The checkpoint with each tied name of its model (ckpt["tied"], see checkpoint_model_state) pointing at the
    stored tensor; checkpoints that stored every name have no "tied" entry."""
    for alias, name in ckpt.get("tied", {}).items():
        ckpt["model"].setdefault(alias, ckpt["model"][name])
    return ckpt


def checkpoint_model_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state, tied): CPU copies of the model's tensors, each parameter once, and {alias: stored name} for the
    names of a parameter stored under an earlier one (the tied lm_head.weight is transformer.wte.weight: one copy,
    154 MB at 124M parameters, instead of two). Copies, because sharded optimizers make parameters views into
    padded flat buffers that torch.save would write whole."""
    state, tied, first_name = {}, {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first_name:
            tied[name] = first_name[id(tensor)]
            continue
        first_name[id(tensor)] = name
        state[name] = tensor.detach().to("cpu", copy=True)
    return state, tied


def save_checkpoint(path: str | os.PathLike, checkpoint: dict) -> None:
    """Write atomically (data.shards.atomic_writer): a failure leaves the previous checkpoint intact and no
    temporary file; the error names the file and the free space."""
    path = Path(path)
    try:
        with atomic_writer(path) as f:
            torch.save(checkpoint, f)
    except (OSError, RuntimeError) as exc:
        free = shutil.disk_usage(path.parent).free if path.parent.is_dir() else 0
        os_error = exc if isinstance(exc, OSError) else exc.__context__  # torch wraps the file's own error
        reason = os_error.strerror if isinstance(os_error, OSError) and os_error.strerror else str(exc).strip()
        raise OSError(f"could not write checkpoint {path}: {reason} ({free / 2**20:,.0f} MiB free there); the "
                      "previous checkpoint, if any, is intact") from exc


def load_initial_weights(model: GPT, source: str | os.PathLike) -> str:
    """Copy the model weights of a checkpoint (file or run directory) into `model` for --init-from; returns a line
    saying what was adapted: a larger vocabulary keeps its initialisation in the extra rows, positions beyond
    block_size are dropped, and parameters of another bias mode (learned b_q, b_v) are skipped or keep theirs."""
    path = resolve_checkpoint_path(source, flag="--init-from")
    ckpt = load_checkpoint(path, mmap=True)
    saved, cfg = config_from_dict(ckpt["config"]["model"]), model.config
    for name in ("n_layer", "n_head", "n_embd", "activation"):
        if getattr(saved, name) != getattr(cfg, name):
            raise CheckpointError(f"--init-from {path}: its model has {option(name)} {getattr(saved, name)}, this "
                                  f"run {getattr(cfg, name)}; set {option(name)} {getattr(saved, name)}")
    if saved.block_size < cfg.block_size:
        raise CheckpointError(f"--init-from {path}: its model has --block-size {saved.block_size}, this run "
                              f"{cfg.block_size}; set --block-size {saved.block_size} or less")
    notes = [f"initial weights from {path}"]
    if saved.vocab_size != cfg.vocab_size:
        notes.append(f"vocabulary {saved.vocab_size} -> {cfg.vocab_size}"
                     + (" (the extra rows keep their initialisation)" if cfg.vocab_size > saved.vocab_size else ""))
    if saved.block_size != cfg.block_size:
        notes.append(f"positions {saved.block_size} -> {cfg.block_size}")
    if saved.bias_mode != cfg.bias_mode:
        notes.append(f"bias mode {saved.bias_mode} -> {cfg.bias_mode}")
    state = model.state_dict()  # shares storage with the parameters
    skipped = []
    with torch.no_grad():
        for name, tensor in ckpt["model"].items():
            if name not in state or tensor.shape[1:] != state[name].shape[1:]:
                skipped.append(name)
                continue
            rows = min(tensor.size(0), state[name].size(0))
            state[name][:rows].copy_(tensor[:rows])
    if skipped:
        notes.append(f"not used: {', '.join(skipped)}")
    return " | ".join(notes)


def model_from_checkpoint(checkpoint: str | os.PathLike | dict) -> GPT:
    """The checkpoint's model on the CPU in eval mode (evaluation uses the mean biases)."""
    ckpt = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint)
    model = GPT(config_from_dict(ckpt["config"]["model"]))
    model.load_state_dict(link_tied(ckpt)["model"])
    return model.eval()


def read_log(run_dir: str | os.PathLike) -> list[dict]:
    """A run's log.jsonl records (empty if there is none)."""
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def create_run_dir(cfg: RunConfig) -> tuple[Path, str | None]:
    """A new run directory, with a copy of the code like speedrun records, and a note when the default name was
    taken. --run-name names it (an earlier run there was refused by config_problem); the default name
    timestamp-preset-optimizer gets a suffix -2, -3, ... instead of reusing a directory."""
    hp = cfg.train
    note = None
    if hp.run_name:
        run_dir = Path(hp.run_dir) / hp.run_name
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.preset or 'custom'}-{hp.optimizer}"
        Path(hp.run_dir).mkdir(parents=True, exist_ok=True)
        for n in range(1, 10_000):
            run_dir = Path(hp.run_dir) / (stem if n == 1 else f"{stem}-{n}")
            try:
                run_dir.mkdir()
                break
            except FileExistsError:
                continue
        if run_dir.name != stem:
            note = f"run directory {Path(hp.run_dir) / stem} exists: using {run_dir.name} instead"
    copy_code(run_dir)
    return run_dir, note


def copy_code(run_dir: Path) -> None:
    """<run>/code: the trainer, kernels/, optim/ and data/ as they run (a resumed run refreshes it)."""
    for package in ("", "kernels", "optim", "data"):
        for source in sorted((REPO_ROOT / package).glob("*.py")):
            target = run_dir / "code" / package / source.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)


class WandbTracker:
    """Weights & Biases for a run (--wandb-project; master rank only): the config once, at the start, then the
    numbers of every log.jsonl record at its step, and the final summary. wandb is imported only here. The W&B run
    id is kept in <run>/wandb_run_id.txt, so a run resumed in its directory goes on in the same W&B run."""

    def __init__(self, hp: Hyperparameters, run_dir: Path, config: dict) -> None:
        import wandb  # config_problem checked that it is installed

        id_file = run_dir / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(8)
        self.run = wandb.init(project=hp.wandb_project, name=hp.wandb_run_name or run_dir.name, id=run_id,
                              resume="allow", dir=str(run_dir), config=config)
        id_file.write_text(run_id + "\n")

    def record(self, record: dict) -> None:
        numbers = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if record.get("summary"):
            self.run.summary.update(numbers)
        elif numbers and "step" in record:
            self.run.log(numbers, step=record["step"])

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


class RunLog:
    """What the master rank reports: stdout, and once the run directory exists, log.txt (which starts with the
    code), log.jsonl and the optional tracker (WandbTracker). Lines printed before the directory exists are
    written to log.txt when it does."""

    def __init__(self, is_master: bool) -> None:
        self.is_master = is_master
        self.text = self.records = None
        self.tracker: WandbTracker | None = None
        self.pending: list[str] = []

    def attach(self, run_dir: Path) -> None:
        if not self.is_master:
            return
        self.text = open(run_dir / "log.txt", "a")
        self.records = open(run_dir / "log.jsonl", "a")
        self.text.write(Path(__file__).read_text() + "\n" + "=" * 100 + "\n")
        self.text.writelines(line + "\n" for line in self.pending)
        self.text.flush()

    def line(self, text: str) -> None:
        if not self.is_master:
            return
        print(text, flush=True)
        if self.text is None:
            self.pending.append(text)
        else:
            self.text.write(text + "\n")
            self.text.flush()

    def record(self, record: dict) -> None:
        if self.records is not None:
            self.records.write(json.dumps(record) + "\n")
            self.records.flush()
        if self.tracker is not None:
            self.tracker.record(record)

    def error(self, exc: BaseException) -> None:
        """Write an error that ends the run to log.txt (it is printed by Python as it propagates); the tracker's
        run ends as failed."""
        if self.text is not None:
            self.text.write("".join(traceback.format_exception(exc)))
            self.text.flush()
        if self.tracker is not None:
            self.tracker.close(exit_code=1)
            self.tracker = None

    def close(self) -> None:
        for handle in (self.text, self.records):
            if handle is not None:
                handle.close()
        if self.tracker is not None:
            self.tracker.close()
        self.text = self.records = self.tracker = None


# -----------------------------------------------------------------------------------------------------------------
# Training: setup → build → restore → open the run → loop → finish, around one TrainState.


def lr_factor(step: int, hp: Hyperparameters) -> float:
    """Multiplier of the peak learning rate at `step`: linear warmup, then constant, cosine or linear cooldown."""
    if step < hp.warmup_steps:
        return (step + 1) / hp.warmup_steps
    if hp.lr_schedule == "constant":
        return 1.0
    if hp.lr_schedule == "cosine":
        progress = (step - hp.warmup_steps) / max(1, hp.steps - hp.warmup_steps)
        return hp.min_lr_frac + (1 - hp.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    cooldown_start = hp.steps * (1 - hp.cooldown_frac)
    if step < cooldown_start:
        return 1.0
    progress = (step - cooldown_start) / max(1.0, hp.steps - cooldown_start)
    return 1.0 - (1 - hp.min_lr_frac) * min(1.0, progress)


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU (datasheet) for MFU; None when unknown or on CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def resolve_data_files(hp: Hyperparameters, is_master: bool) -> tuple[str, str, str | None]:
    """Training and validation shard globs, and a note when the embedded corpus stands in: --val-files when given;
    the rest from --train-files, else downloaded FineWeb-Edu, else the embedded corpus."""
    train, val, note = default_data_files(hp, is_master)
    return train, hp.val_files or val, note


def default_data_files(hp: Hyperparameters, is_master: bool) -> tuple[str, str, str | None]:
    """Training/validation shard globs without --val-files (validation on the training shards with --train-files)."""
    if hp.train_files:
        return hp.train_files, hp.train_files, None
    from data import fineweb_edu

    if fineweb_edu.fineweb_shards_present():
        return fineweb_edu.DEFAULT_TRAIN_PATTERN, fineweb_edu.DEFAULT_VAL_PATTERN, None
    from data.embedded import prepare_embedded_corpus

    if is_master:
        files = prepare_embedded_corpus()
    if dist.is_initialized():
        dist.barrier()
    train, val = files if is_master else prepare_embedded_corpus()  # the other ranks find the master's cache
    return train, val, "no --train-files and no FineWeb-Edu shards: using the embedded corpus (Python docstrings)"


def describe_data(hp: Hyperparameters, train_files: str, val_files: str, log: RunLog) -> dict:
    """What a run trains and validates on (docs/data.md#shard-format), for config.json and checkpoints: per split,
    the glob as given (--train-files/--val-files; empty: the default data), the resolved glob, each file with its
    token count and sha256, and the total tokens. Digests are cached by (path, size, mtime_ns) in the cache root
    (data.shards.sha256_shards), so only new or changed shards are read."""
    from data.shards import cache_root

    cache = cache_root() / DIGEST_CACHE
    data = {split: {"given": given, **describe_shards(pattern, cache)}
            for split, given, pattern in (("train", hp.train_files, train_files), ("val", hp.val_files, val_files))}
    log.line(" | ".join(f"{split} data {d['pattern']}: {len(d['files'])} files, {d['tokens']:,} tokens"
                        for split, d in data.items()))
    return data


class DataChangedError(RuntimeError):
    """--resume found other training shards than the checkpoint trained on."""


def data_changes(saved: dict | None, now: dict) -> tuple[str | None, list[str]]:
    """(problem, warnings) from comparing a checkpoint's data record with the data found now, by contents (token
    counts and sha256 of the files in order), not paths. Other training data is a problem: the loader's position
    and the data order would mean nothing. Other validation data is a warning: losses before and after the resume
    are not comparable. Moved files with the same contents are fine."""
    if not saved:
        return None, ["the checkpoint records no data (written by an older version): the data is not checked"]
    problem, warnings = None, []
    for split in ("train", "val"):
        old, new = saved[split]["files"], now[split]["files"]
        if [(f["tokens"], f["sha256"]) for f in old] == [(f["tokens"], f["sha256"]) for f in new]:
            continue
        what = (f"the {split} data {now[split]['pattern']} is not what the checkpoint recorded: {len(new)} files / "
                f"{now[split]['tokens']:,} tokens now, {len(old)} files / {saved[split]['tokens']:,} tokens then")
        i = next((i for i, (a, b) in enumerate(zip(old, new)) if a["sha256"] != b["sha256"]), None)
        if i is not None:
            what += (f"; first difference at file {i}: recorded {old[i]['path']} (sha256 {old[i]['sha256'][:12]}..), "
                     f"now {new[i]['path']} (sha256 {new[i]['sha256'][:12]}..)")
        if split == "train":
            problem = (f"--resume: {what}. The data order and the loader's position would mean nothing on other "
                       "data: restore the recorded shards (the run's config.json lists them with their sha256), or "
                       "start a new run")
        else:
            warnings.append(f"WARNING: {what}. Validation losses before and after this resume are not comparable.")
    return problem, warnings


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


@torch.no_grad()
def evaluate(model: GPT, val_files: str, val_tokens: int, seq_len: int, micro_batch: int, rank: int, world: int,
             device: torch.device, autocast: contextlib.AbstractContextManager) -> float:
    """Mean loss over the fixed validation budget (val_tokens in micro-batches of micro_batch x seq_len, which weigh
    equally), with the mean biases (docs/model.md), averaged over ranks; the trainer (micro_batch = --micro-batch, the
    memory bound) and eval.val_loss. Under --objective mlm: the loss on the validation stream's fixed masks."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    masker = TokenMasker(model.config) if model.config.objective == "mlm" else None
    for batch, (x, y) in enumerate(validation_batches(val_files, micro_batch, seq_len, val_tokens, rank=rank,
                                                      world_size=world, vocab_size=model.config.vocab_size,
                                                      device=device)):
        if masker is not None:  # the validation stream's own fixed masks (docs/variants.md#masked-lm-objective)
            x, y = masker.apply(x, (batch * world + rank) * micro_batch)
        with autocast:
            total += model(x, y)[1].double()
        count += 1
    model.train(was_training)
    stats = all_reduce_sum(torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=device)]))
    return (stats[0] / stats[1]).item()


@dataclass
class Runtime:
    """Where this process trains: its rank among `world`, its device and autocast dtype, and the per-rank batch
    layout (micro_batch sequences per pass, grad_accum passes per step; see batch_layout)."""

    rank: int
    world: int
    device: torch.device
    micro_batch: int
    grad_accum: int
    autocast_dtype: torch.dtype | None

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else \
            contextlib.nullcontext()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass
class TrainState:
    """Everything the loop reads and changes. to_checkpoint() and restore() are inverses: model, optimizer states,
    loader position, RNG, step and metrics."""

    cfg: RunConfig
    rt: Runtime
    log: RunLog
    model: GPT
    optimizers: list[torch.optim.Optimizer]
    loader: DistributedTokenLoader
    sampler: BiasSampler
    val_files: str
    data: dict | None  # the master's record of the training and validation shards (describe_data); None elsewhere
    hyperparameters: list[list[dict]]  # each optimizer group's settings as the config built them (lr = the peak)
    masker: TokenMasker | None = None  # --objective mlm: what turns the loader's rows into masked inputs and targets
    forward: nn.Module | None = None  # what the loop calls: the model, compiled on CUDA, in DDP where needed
    run_dir: Path | None = None
    step: int = 0
    tokens: int = 0
    train_time: float = 0.0
    val_loss: float | None = None
    val_step: int | None = None
    first_val: tuple[int, float] | None = None  # (step, loss) of this process's first validation
    best_val_batch: float | None = None  # the least single-batch validation estimate (--val-batch-estimate)
    reached_target: dict | None = None
    checkpoint_step: int | None = None  # step of the last checkpoint written or resumed from
    last_batch: tuple | None = None  # (x, y, biases) of the last micro-step: the finiteness check's forward pass
    grad_norm: torch.Tensor | None = None
    gauge: GaugeUpdates | None = None  # --gauge post-processing (None: off)

    @property
    def spec(self):
        return OPTIMIZERS[self.cfg.train.optimizer]

    def metrics(self, **extra) -> dict:
        return {"step": self.step, "tokens": self.tokens, "train_time_s": self.train_time, "val_loss": self.val_loss,
                "val_step": self.val_step, "best_val_loss_batch": self.best_val_batch,
                "reached_target": self.reached_target, **extra}

    def to_checkpoint(self) -> dict | None:
        """The checkpoint of this state on the master rank (None elsewhere); a collective for sharded optimizers."""
        optimizer_states = [opt.state_dict() for opt in self.optimizers]
        if not self.rt.is_master:
            return None
        model_state, tied = checkpoint_model_state(self.model)
        return {"format": CHECKPOINT_FORMAT, "step": self.step, "config": {**self.cfg.to_dict(), "data": self.data},
                "model": model_state, "tied": tied, "optimizers": optimizer_states, "loader": self.loader.state_dict(),
                "sampler": self.sampler.state_dict(), "rng": {"torch": torch.get_rng_state()},
                "metrics": self.metrics(), "gauge": self.gauge.state_dict() if self.gauge else None}

    def restore(self, ckpt: dict) -> None:
        """Load a checkpoint; the optimizer settings of the current config (lr, weight decay, betas, ...) replace
        the saved ones, so flags given on --resume take effect."""
        self.model.load_state_dict(link_tied(ckpt)["model"])
        for opt, saved, settings in zip(self.optimizers, ckpt["optimizers"], self.hyperparameters, strict=True):
            opt.load_state_dict(saved)
            for group, values in zip(opt.param_groups, settings, strict=True):
                group.update(values)
        self.loader.load_state_dict(ckpt["loader"])
        if self.gauge and ckpt.get("gauge"):
            self.gauge.load_state_dict(ckpt["gauge"], self.rt.device)
        torch.set_rng_state(ckpt["rng"]["torch"])
        metrics = ckpt["metrics"]
        self.step = self.checkpoint_step = ckpt["step"]
        self.tokens, self.train_time = metrics["tokens"], metrics["train_time_s"]
        self.val_loss, self.val_step = metrics.get("val_loss"), metrics.get("val_step")
        self.best_val_batch = metrics.get("best_val_loss_batch")
        self.reached_target = metrics.get("reached_target")

    def accumulating(self, accumulate: bool) -> contextlib.AbstractContextManager:
        """No gradient averaging across ranks in this backward pass (DDP's no_sync) when `accumulate`."""
        stack = contextlib.ExitStack()
        if accumulate and isinstance(self.forward, nn.parallel.DistributedDataParallel):
            stack.enter_context(self.forward.no_sync())
        elif accumulate:
            for opt in self.optimizers:
                if hasattr(opt, "no_sync"):
                    stack.enter_context(opt.no_sync())
        return stack


def setup(cfg: RunConfig) -> Runtime:
    """Process group (torchrun sets RANK/WORLD_SIZE/LOCAL_RANK), device, autocast and the per-rank batch layout."""
    hp = cfg.train
    world = world_size_from_env()
    use_cuda = hp.device == "cuda" or (hp.device == "auto" and torch.cuda.is_available())
    micro_batch, grad_accum = batch_layout(hp, world)
    if world > 1:
        init_process_group(backend="nccl" if use_cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    autocast_dtype = torch.bfloat16 if use_cuda and hp.dtype == "bf16" else None
    return Runtime(dist.get_rank() if world > 1 else 0, world, device, micro_batch, grad_accum, autocast_dtype)


def build(cfg: RunConfig, rt: Runtime, log: RunLog) -> TrainState:
    """Data (the validation data is checked here, before any step), model, optimizers, loader, bias sampler."""
    hp = cfg.train
    train_files, val_files, note = resolve_data_files(hp, rt.is_master)
    if note:
        log.line(note)
    validation_batches(val_files, hp.micro_batch, hp.seq_len, hp.val_tokens, rank=rt.rank, world_size=rt.world,
                       vocab_size=cfg.model.vocab_size)
    torch.manual_seed(hp.seed)
    model = GPT(cfg.model).to(rt.device)
    if hp.init_from and not hp.resume:
        log.line(load_initial_weights(model, hp.init_from))
    optimizers = OPTIMIZERS[hp.optimizer].build(model, cfg.optim)
    for opt in optimizers:
        if hasattr(opt, "max_grad_norm"):  # sharded optimizers clip after averaging the gradients, inside step()
            opt.max_grad_norm, opt.overlap = hp.grad_clip, hp.overlap_reduce
    hyperparameters = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers]
    loader = DistributedTokenLoader(train_files, rt.micro_batch, hp.seq_len, rank=rt.rank, world_size=rt.world,
                                    grad_accum_steps=rt.grad_accum, vocab_size=cfg.model.vocab_size,
                                    align_to_eot=hp.align_to_eot, device=rt.device)
    data = describe_data(hp, train_files, val_files, log) if rt.is_master else None
    gauge = None if hp.gauge == "none" else GaugeUpdates(
        hp.gauge, cfg.model.n_head, hp.gauge_correction, hp.gauge_every, hp.gauge_damping, hp.gauge_group,
        hp.hyperball_lr)
    return TrainState(cfg, rt, log, model, optimizers, loader, BiasSampler(cfg.model, hp.seed), val_files, data,
                      hyperparameters, masker=TokenMasker(cfg.model) if cfg.model.objective == "mlm" else None,
                      gauge=gauge)


def restore(state: TrainState) -> dict:
    """Continue from --resume; returns the log record saying from where and which settings changed."""
    path = resolve_checkpoint_path(state.cfg.train.resume)
    ckpt = load_checkpoint(path, map_location=state.rt.device)
    problem = None
    if state.rt.is_master:
        problem, warnings = data_changes(ckpt["config"].get("data"), state.data)
        for warning in warnings:
            state.log.line(warning)
    if all_reduce_sum(torch.tensor(float(problem is not None), device=state.rt.device)).item():
        raise DataChangedError(problem or "rank 0 found other training data than the checkpoint recorded")
    state.restore(ckpt)
    now = state.cfg.to_dict()
    changed = {f"{section}.{k}": [v, now[section][k]] for section, values in ckpt["config"].items()
               for k, v in values.items() if section in now and k in now[section] and now[section][k] != v
               and k != "resume"}
    state.log.line(f"resumed from step {state.step} of {path}"
                   + "".join(f" | {k} {old} -> {new}" for k, (old, new) in changed.items()))
    return {"resumed_from": str(path), "step": state.step, "changed": changed}


def open_run(state: TrainState) -> None:
    """The run directory (new, or the resumed run's own), its code copy, config.json and the log's header."""
    cfg, rt, log = state.cfg, state.rt, state.log
    if rt.is_master:
        note = None
        if cfg.continue_in is not None:
            state.run_dir = cfg.continue_in
            copy_code(state.run_dir)
        else:
            state.run_dir, note = create_run_dir(cfg)
        layout = {"world_size": rt.world, "micro_batch": rt.micro_batch, "grad_accum": rt.grad_accum}
        config = {**cfg.to_dict(), "layout": layout, "data": state.data, "preset": preset_report(cfg)}
        with atomic_writer(state.run_dir / "config.json") as f:
            f.write(json.dumps(config, indent=2).encode())
        log.attach(state.run_dir)
        if cfg.train.wandb_project:
            log.tracker = WandbTracker(cfg.train, state.run_dir, config)
        if note:
            log.line(note)
        log.line(f"python {sys.version.split()[0]} | torch {torch.__version__} | device {rt.device}"
                 + (f" ({torch.cuda.get_device_name(rt.device)})" if rt.device.type == "cuda" else "")
                 + f" | world {rt.world}")
        log.line(f"run directory {state.run_dir}")
        parity = preset_report(cfg)
        compared = parity.get("compared_with")
        log.line(f"preset {parity['name'] or 'none'}" + (f" (compared with {compared})" if compared != parity["name"]
                                                        and compared else "")
                 + f": reproduces {parity['reproduces']}" + "".join(f"\n  differs: {d}" for d in parity["differs"]))
    log.line(f"model: {state.model.get_num_params():,} parameters | optimizer {cfg.train.optimizer} | "
             f"{cfg.train.batch_tokens:,} tokens per step = {rt.world} ranks x {rt.grad_accum} micro-steps x "
             f"{rt.micro_batch} sequences of {cfg.train.seq_len}")


def training_forward(state: TrainState) -> nn.Module:
    """The model as the loop calls it: compiled on CUDA (nanoGPT's order: compile, then DDP, whose no_sync then
    acts on a plain module), wrapped in DDP when the optimizer does not average gradients itself."""
    rt = state.rt
    forward: nn.Module = state.model
    if rt.device.type == "cuda" and state.cfg.train.compile:
        forward = torch.compile(forward)
    if rt.world > 1 and not state.spec.reduces_gradients:
        forward = nn.parallel.DistributedDataParallel(
            forward, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    return forward


class StopRequest:
    """SIGINT/SIGTERM ask the run to stop: the loop then writes a checkpoint and exits at the next step where every
    rank agrees (every step on one process, the next log step under torchrun). A second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        self.signum = signum
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Stopwatch:
    """Training time into state.train_time: runs during training steps, stopped (after the device catches up) for
    validation and checkpoints, as in the speedrun's timing."""

    def __init__(self, state: TrainState) -> None:
        self.state, self.started = state, None

    def start(self) -> None:
        self.state.rt.synchronize()
        self.started = time.perf_counter()

    def stop(self) -> None:
        self.state.rt.synchronize()
        if self.started is not None:
            self.state.train_time += time.perf_counter() - self.started
            self.started = None

    @contextlib.contextmanager
    def paused(self):
        self.stop()
        yield
        self.start()


class TrainingStopped(SystemExit):
    """A deliberate stop on every rank alike (non-finite state, a signal): the process group can be torn down."""


def train_step(state: TrainState) -> torch.Tensor:
    """One optimizer step over grad_accum micro-batches; returns the mean training loss as a device tensor."""
    hp, rt = state.cfg.train, state.rt
    factor = lr_factor(state.step, hp)
    for opt, settings in zip(state.optimizers, state.hyperparameters):
        for group, values in zip(opt.param_groups, settings):
            group["lr"] = values["lr"] * factor
    biases = state.sampler.sample(state.step, rt.device)
    loss_sum = torch.zeros((), device=rt.device)
    for micro in range(rt.grad_accum):
        x, y, chunk = state.loader.next_batch()
        if state.masker is not None:  # chunk * micro_batch: the first row's index in the step's global batch
            x, y = state.masker.apply(x, chunk * rt.micro_batch, (hp.seed, state.step))
        with state.accumulating(micro < rt.grad_accum - 1), rt.autocast():
            loss = state.forward(x, y, biases)[1]
            (loss / rt.grad_accum).backward()
        loss_sum += loss.detach()
    state.last_batch = (x, y, biases)
    loss = loss_sum / rt.grad_accum
    if hp.grad_clip and not state.spec.reduces_gradients:
        state.grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), hp.grad_clip, foreach=True)
    before = state.gauge.snapshot(state.model) if state.gauge else None
    for opt in state.optimizers:
        opt.step(loss) if state.spec.needs_loss else opt.step()
        state.grad_norm = getattr(opt, "grad_norm", state.grad_norm)
    if state.gauge:
        state.gauge.after_step(state.model, state.optimizers, before, state.step + 1, factor)
    for opt in state.optimizers:
        opt.zero_grad(set_to_none=True)
    state.step += 1
    state.tokens += hp.batch_tokens
    return loss


def stop_non_finite(state: TrainState, what: str) -> None:
    kept = (f"the checkpoint of step {state.checkpoint_step} in {state.run_dir / 'checkpoints'} is kept"
            if state.checkpoint_step is not None and state.run_dir else "no checkpoint was written")
    state.log.line(f"step {state.step}: {what} is not finite; stopping ({kept}). Resume from it with a lower --lr, "
                   "more --warmup-steps or --grad-clip.")
    raise TrainingStopped(2)


@torch.no_grad()
def single_batch_estimate(state: TrainState) -> float | None:
    """The published runs' validation estimate at this step: the mean loss (mean biases) on one global batch of
    --batch-tokens validation tokens, the k-th batch of the validation stream at the k-th multiple of --val-every
    (cycling within the --val-tokens budget); None at other steps and when the budget holds no whole batch
    (docs/optimizers.md#paper-parity)."""
    hp, rt, model = state.cfg.train, state.rt, state.model
    budget = hp.val_tokens // hp.batch_tokens
    if not hp.val_batch_estimate or not hp.val_every or not budget or state.step == 0 or state.step % hp.val_every:
        return None
    index = (state.step // hp.val_every - 1) % budget
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=rt.device)
    batches = validation_batches(state.val_files, rt.micro_batch, hp.seq_len, (index + 1) * hp.batch_tokens,
                                 rank=rt.rank, world_size=rt.world, vocab_size=model.config.vocab_size,
                                 device=rt.device)
    for x, y in islice(batches, index * rt.grad_accum, None):
        with rt.autocast():
            total += model(x, y)[1].double()
    model.train(was_training)
    return all_reduce_sum(total.reshape(1))[0].item() / (rt.grad_accum * rt.world)


def validate(state: TrainState) -> bool:
    """Validation loss on the fixed budget (and the single-batch estimate); True when it reaches --target-val-loss
    for the first time."""
    hp, rt = state.cfg.train, state.rt
    state.val_loss = evaluate(state.model, state.val_files, hp.val_tokens, hp.seq_len, hp.micro_batch, rt.rank,
                              rt.world, rt.device, rt.autocast())
    state.val_step = state.step
    state.first_val = state.first_val or (state.step, state.val_loss)
    estimate = single_batch_estimate(state)
    if estimate is not None:
        state.best_val_batch = min(estimate, state.best_val_batch if state.best_val_batch is not None else math.inf)
    state.log.line(f"step {state.step}/{hp.steps} | val loss {state.val_loss:.4f} | train time "
                   f"{state.train_time:.1f}s" + (f" | single-batch val loss {estimate:.4f} (least "
                                                 f"{state.best_val_batch:.4f})" if estimate is not None else ""))
    state.log.record(state.metrics(elapsed_s=state.train_time, val_loss_batch=estimate))
    if not math.isfinite(state.val_loss):
        stop_non_finite(state, "the validation loss")
    if not hp.target_val_loss or state.reached_target is not None or state.val_loss > hp.target_val_loss:
        return False
    state.reached_target = {"step": state.step, "train_time_s": state.train_time, "tokens": state.tokens,
                            "val_loss": state.val_loss}
    state.log.line(f"target val loss {hp.target_val_loss} reached at step {state.step} after "
                   f"{state.train_time:.1f}s of training ({state.tokens:,} tokens)")
    return True


def state_is_finite(state: TrainState) -> bool:
    """Whether parameters, optimizer state and the loss the parameters give on the last micro-batch are all finite
    on every rank (a collective): the condition for writing a checkpoint."""
    tensors = [t for t in chain(state.model.parameters(), optimizer_state_tensors(state.optimizers))
               if t.is_floating_point()]
    flags = [torch.isfinite(t).all() for t in tensors]
    if state.last_batch is not None:
        with torch.no_grad(), state.rt.autocast():
            flags.append(torch.isfinite(state.model(*state.last_batch)[1]))
    bad = (~torch.stack(flags).all()).to(torch.float64).reshape(1)
    return all_reduce_sum(bad).item() == 0


def save(state: TrainState) -> None:
    """checkpoints/latest.pt (and step_XXXXXX.pt with --keep-checkpoints), written only from a finite state."""
    if not state_is_finite(state):
        stop_non_finite(state, "the state after this step (weights, optimizer state or the loss they give)")
    ckpt = state.to_checkpoint()
    if ckpt is not None:
        save_checkpoint(state.run_dir / "checkpoints" / "latest.pt", ckpt)
        if state.cfg.train.keep_checkpoints:
            save_checkpoint(state.run_dir / "checkpoints" / f"step_{state.step:06d}.pt", ckpt)
    if state.rt.world > 1:
        dist.barrier()
    state.checkpoint_step = state.step


def log_progress(state: TrainState, loss: torch.Tensor, stop: StopRequest, clock: Stopwatch, mark: list[float],
                 mfu_per_token_s: float | None) -> bool:
    """A log line and record (the only host sync of the loop); returns whether every rank agrees to stop.
    mfu_per_token_s: the MFU of one token per second (None when the GPU's peak is unknown)."""
    hp, rt = state.cfg.train, state.rt
    votes = all_reduce_sum(torch.stack([loss.float(), torch.tensor(float(stop.signum > 0), device=rt.device)]))
    loss_value, stop_votes = votes.tolist()
    loss_value /= rt.world
    if not math.isfinite(loss_value):
        stop_non_finite(state, f"the training loss ({loss_value})")
    clock.stop()
    tokens_per_s = (state.tokens - mark[1]) / max(state.train_time - mark[0], 1e-9)
    mfu = mfu_per_token_s * tokens_per_s if mfu_per_token_s else None
    eta = (hp.steps - state.step) * hp.batch_tokens / tokens_per_s
    record = state.metrics(train_loss=loss_value, lr=state.optimizers[0].param_groups[0]["lr"],
                           tokens_per_s=tokens_per_s, mfu=mfu, elapsed_s=state.train_time)
    if state.grad_norm is not None:
        record["grad_norm"] = state.grad_norm.item()
    if hp.dynamics_every and state.step % hp.dynamics_every == 0:
        record.update(dynamics_summary(state.model, velocity_from_optimizers(state.optimizers), state.cfg.model.n_head))
    if hp.gauge_diagnostic_every and state.step % hp.gauge_diagnostic_every == 0:

        x, y, _ = state.last_batch
        record.update(training_summary(state.model, hp.optimizer, state.cfg.optim, x, y, state.step))
    state.log.record(record)
    state.log.line(f"step {state.step}/{hp.steps} | loss {loss_value:.4f} | lr {record['lr']:.2e}"
                   + (f" | grad norm {record['grad_norm']:.3f}" if "grad_norm" in record else "")
                   + (f" | gauge ΔM QK {record['gauge_dM_QK']:.3g} VO {record['gauge_dM_VO']:.3g}"
                      if "gauge_dM_QK" in record else "")
                   + f" | {tokens_per_s:,.0f} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu else "")
                   + f" | {state.train_time:.1f}s | eta {format_duration(eta)}")
    mark[:] = [state.train_time, state.tokens]
    clock.start()
    return stop_votes > 0


def train(state: TrainState, stop: StopRequest) -> None:
    """The loop: validate when due, one optimizer step, log, checkpoint; until --steps, a reached target
    (--stop-at-target) or an agreed stop request (then checkpoint and exit 128 + signal)."""
    hp = state.cfg.train
    first, mark, clock = state.step, [state.train_time, state.tokens], Stopwatch(state)
    peak = peak_flops(state.rt.device)
    mfu_per_token_s = state.model.estimate_flops_per_token(hp.seq_len) / (peak * state.rt.world) if peak else None
    clock.start()
    while state.step < hp.steps:
        if hp.val_every and state.step % hp.val_every == 0 and state.val_step != state.step:
            with clock.paused():
                if validate(state) and hp.stop_at_target:
                    break
        loss = train_step(state)
        stopping = bool(stop.signum) and state.rt.world == 1
        if state.step % hp.log_every == 0 or state.step == hp.steps or stopping:
            stopping = log_progress(state, loss, stop, clock, mark, mfu_per_token_s)
        if state.step == first + 1:
            per_parameter = optimizer_state_bytes(state.optimizers) / state.model.get_num_params()
            state.log.line(f"optimizer state: {per_parameter:.2f} bytes per parameter on rank {state.rt.rank}")
        if stopping and state.step < hp.steps:
            clock.stop()
            save(state)
            name = signal.Signals(stop.signum or signal.SIGTERM).name
            state.log.line(f"{name} at step {state.step}: checkpoint written; continue with --resume {state.run_dir}")
            raise TrainingStopped(128 + (stop.signum or signal.SIGTERM))
        if hp.checkpoint_every and state.step % hp.checkpoint_every == 0 and state.step < hp.steps:
            with clock.paused():
                save(state)
    clock.stop()


def finish(state: TrainState) -> dict:
    """The final checkpoint, then the final validation (so an evaluation error loses no training), the summary."""
    if state.checkpoint_step != state.step:
        save(state)
    if state.val_step != state.step:
        validate(state)
    summary = state.metrics(run_dir=str(state.run_dir) if state.run_dir else None,
                            tokens_per_s=state.tokens / state.train_time if state.train_time else None)
    first = state.first_val
    start = f"{first[1]:.4f} at step {first[0]} -> " if first and first[0] != state.step else ""
    state.log.line(f"done: {state.step} steps, val loss {start}{state.val_loss:.4f} at step {state.step}, "
                   f"{state.train_time:.1f}s of training"
                   + (f", target reached at step {state.reached_target['step']}" if state.reached_target else ""))
    state.log.record({"summary": True, **summary})
    return summary


def main(argv: list[str] | None = None) -> dict:
    """Train as configured by `argv` (see --help); returns a summary dict (also the last line of log.jsonl)."""
    cfg = parse_config(argv)
    rt = setup(cfg)
    log = RunLog(rt.is_master)
    state = None
    try:
        state = build(cfg, rt, log)
        resumed = restore(state) if cfg.train.resume else None
        open_run(state)
        if resumed:
            log.record(resumed)
        state.forward = training_forward(state)
        with StopRequest() as stop:
            train(state, stop)
        summary = finish(state)
    except BaseException as exc:
        if not isinstance(exc, TrainingStopped):
            log.error(exc)
        elif rt.world > 1:
            dist.destroy_process_group()  # every rank stops here alike; see optim.distributed.init_process_group
        raise
    finally:
        if state is not None:
            state.loader.close()
        log.close()
    if rt.world > 1:
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
