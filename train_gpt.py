"""Train GPT-2 with symmetry-breaking attention biases (SPEC §1–2), on 1..N GPUs under torchrun or on a CPU.

    python train_gpt.py --preset smoke                                  # CPU, a few minutes, embedded corpus
    torchrun --standalone --nproc_per_node=8 train_gpt.py --preset gpt2-124m --optimizer adamw

Reads top to bottom: configuration (dataclasses, presets, CLI) → model (GPT-2 with per-batch sampled b_Q, b_V)
→ bias sampler → checkpoints and run directory → training loop. Importing this module has no side effects.
References: nanoGPT (model layout and names), modded-nanogpt (trainer shape), seed 000 (the symmetry-breaking
protocol), SPEC.md (every formula and default used here).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from data.loader import DistributedTokenLoader, validation_batches
from kernels.attention import attention
from optim import OPTIMIZERS, OptimizerConfig, optimizer_state_bytes, resolve_config
from optim.distributed import all_reduce_sum, init_process_group, rank_and_world_size
from optim.gauge import VELOCITY_OPTIMIZERS, dynamics_summary, velocity_from_optimizers

REPO_ROOT = Path(__file__).resolve().parent
CHECKPOINT_FORMAT = "symgpt-checkpoint-v1"

# -----------------------------------------------------------------------------------------------------------------
# Configuration. Every field of the three dataclasses is a CLI flag `--field-name`; the trailing comment is its help.


@dataclass
class GPTConfig:
    """GPT-2 architecture and symmetry-breaking biases; defaults are the paper's 124M model (SPEC §2)."""

    vocab_size: int = 50304  # vocabulary (50257 GPT-2 tokens padded to a multiple of 64)
    block_size: int = 512  # context length (positional embeddings); the paper uses 512, GPT-2 1024
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # model width C; head dim d = C / n_head
    activation: str = "prelu"  # MLP activation: prelu (per-feature slope, init N(0.2, 1)) or gelu
    bias_mode: str = "bqbv"  # symmetry breaking: none, bq, bv, bqbv (sampled per batch) or learned (SPEC §1)
    mean_q: float = 0.5  # E[b_Q], every component
    std_q_min: float = 0.05  # per-dimension std of b_Q = linspace(std_q_min, std_q_max, d)
    std_q_max: float = 0.15  # see std_q_min
    mean_v: float = 0.0  # E[b_V], every component (the paper tries 0 and 0.5)
    std_v_min: float = 0.02  # per-dimension std of b_V = linspace(std_v_min, std_v_max, d)
    std_v_max: float = 0.02  # see std_v_min
    bias_per_head: bool = False  # sample one vector per head instead of one per layer shared by all heads
    key_bias: bool = False  # also sample b_K ~ N(mean_q, std_q) on keys: an exact no-op, for parity checks only

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
    """Data, schedule, evaluation, logging and system settings of a run."""

    train_files: str = ""  # glob of training shards; empty: FineWeb-Edu if downloaded, else the embedded corpus
    val_files: str = ""  # glob of validation shards; empty: --train-files, else the default data's validation shards
    seq_len: int = 512  # tokens per training sequence (<= block_size)
    micro_batch: int = 8  # sequences per rank per forward/backward pass
    batch_tokens: int = 4096  # global batch per optimizer step in tokens (paper: 8 x 512, no accumulation)
    align_to_eot: bool = False  # start every training sequence at an <|endoftext|> token
    steps: int = 122070  # optimizer steps (paper: 500M tokens / 4096 tokens per step)
    lr_schedule: str = "constant"  # constant, cosine (after warmup) or linear (constant, then linear cooldown)
    warmup_steps: int = 0  # linear warmup steps
    cooldown_frac: float = 0.2  # linear schedule: fraction of steps spent decaying to min_lr_frac
    min_lr_frac: float = 0.0  # final learning rate as a fraction of the peak (cosine, linear)
    val_every: int = 1000  # validate every N steps (and at the start and end); 0: only at the end
    val_tokens: int = 1048576  # fixed validation token budget (the same tokens every time)
    log_every: int = 10  # print and log a line every N steps
    checkpoint_every: int = 0  # write checkpoints/latest.pt every N steps (0: only at the end)
    keep_checkpoints: bool = False  # also keep checkpoints/step_XXXXXX.pt at every checkpoint
    target_val_loss: float = 0.0  # report the first step and training time reaching this validation loss (0: off)
    stop_at_target: bool = False  # stop the run once target_val_loss is reached
    dynamics_every: int = 0  # log angular momentum / rotational fraction every N steps (0: off; SPEC §6)
    run_dir: str = "runs"  # parent directory of run directories
    run_name: str = ""  # run directory name (default: timestamp-preset-optimizer)
    resume: str = ""  # checkpoint file or run directory to resume from (its config is the base; flags override)
    seed: int = 1337  # seed for initialisation and the bias sampler
    device: str = "auto"  # auto, cpu or cuda
    dtype: str = "bf16"  # autocast dtype on CUDA: bf16 or fp32 (CPU always computes in fp32)
    compile: bool = True  # torch.compile the model on CUDA


PRESETS: dict[str, dict[str, object]] = {
    # SPEC §2 exactly: PReLU, context 512, 124,119,552 parameters, batch 8 x 512, 500M tokens, constant LR.
    "gpt2-124m": {},
    "gpt2-124m-gelu": {"activation": "gelu"},
    # A few minutes on a 2-core CPU: a narrow model on the embedded corpus, AdamW with warmup and cosine decay.
    "smoke": {
        "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128,
        "seq_len": 128, "micro_batch": 16, "batch_tokens": 2048, "steps": 100,
        "lr_schedule": "cosine", "warmup_steps": 10, "min_lr_frac": 0.1,
        "val_every": 50, "val_tokens": 16384, "log_every": 10,
        "lr": 2e-3, "device": "cpu", "compile": False,
    },
}

CHOICES: dict[str, tuple[str, ...]] = {
    "activation": ("prelu", "gelu"),
    "bias_mode": ("none", "bq", "bv", "bqbv", "learned"),
    "lr_schedule": ("constant", "cosine", "linear"),
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("bf16", "fp32"),
    "ecd_projection": ("global", "per_tensor"),
    "optim_state_dtype": ("fp32", "bf16"),
}
CONFIG_CLASSES = {"model": GPTConfig, "train": Hyperparameters, "optim": OptimizerConfig}


def _field_help(cls: type) -> dict[str, str]:
    """Map each dataclass field to its trailing `# comment` in the class source (the CLI help text)."""
    pattern = re.compile(r"^\s+(\w+):[^#]*#\s*(.+)$")
    return {m.group(1): m.group(2) for m in map(pattern.match, inspect.getsource(cls).splitlines()) if m}


def _parse_value(kind: str, text: str) -> object:
    if kind.startswith("float"):
        return float(text)
    if kind.startswith("int"):
        return int(text)
    return text


def build_arg_parser(base: dict[str, object]) -> argparse.ArgumentParser:
    """A parser with one `--field-name` flag per config field, defaulting to `base` (preset/checkpoint applied)."""
    parser = argparse.ArgumentParser(
        description="Train GPT-2 with symmetry-breaking attention biases (see README.md and SPEC.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="named configuration; flags override it")
    for section, cls in CONFIG_CLASSES.items():
        group = parser.add_argument_group(f"{section} ({cls.__name__})")
        helps = _field_help(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = str(f.type)
            kwargs: dict = {"default": base[f.name], "dest": f.name, "help": helps.get(f.name, " ")}
            if kind == "bool":
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = lambda text, kind=kind, flag=flag: _checked(kind, text, flag)
                kwargs["metavar"] = kind.split(" ")[0].upper()
                if f.name in CHOICES:
                    kwargs["choices"] = CHOICES[f.name]
                    kwargs.pop("metavar")
                elif f.name == "optimizer":
                    kwargs["choices"] = sorted(OPTIMIZERS)
                    kwargs["help"] += "." + "".join(f" [{name}] {spec.description}." for name, spec in
                                                    sorted(OPTIMIZERS.items()))
                    kwargs.pop("metavar")
            group.add_argument(flag, **kwargs)
    return parser


def _checked(kind: str, text: str, flag: str) -> object:
    if "None" in kind and text.lower() == "none":
        return None
    try:
        return _parse_value(kind, text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} expects {kind.split(' ')[0]}, got {text!r}") from None


def parse_config(argv: list[str] | None = None) -> tuple[GPTConfig, Hyperparameters, OptimizerConfig, str | None]:
    """Defaults ← preset ← resumed checkpoint's config ← command-line flags, then validated; also the preset."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS))
    pre.add_argument("--resume", default="")
    known, _ = pre.parse_known_args(argv)
    base: dict[str, object] = {}
    for cls in CONFIG_CLASSES.values():
        base.update(asdict(cls()))
    if known.preset:
        base.update(PRESETS[known.preset])
    if known.resume:
        saved = load_checkpoint(resolve_checkpoint_path(known.resume), mmap=True)["config"]  # no tensor is read
        for section in CONFIG_CLASSES:
            base.update(saved[section])
    parser = build_arg_parser(base)
    args = vars(parser.parse_args(argv))
    model, hp, opt = (cls(**{f.name: args[f.name] for f in dataclasses.fields(cls)}) for cls in CONFIG_CLASSES.values())
    problem = config_problem(model, hp, opt)
    if problem:
        parser.error(problem)
    return model, hp, opt, args["preset"]


def config_problem(model: GPTConfig, hp: Hyperparameters, opt: OptimizerConfig) -> str | None:
    """The first inconsistency between flags, phrased as what to change; None when the config is valid."""
    positive = {"vocab_size": model.vocab_size, "block_size": model.block_size, "n_layer": model.n_layer,
                "n_head": model.n_head, "n_embd": model.n_embd, "seq_len": hp.seq_len,
                "micro_batch": hp.micro_batch, "batch_tokens": hp.batch_tokens, "steps": hp.steps,
                "val_tokens": hp.val_tokens, "log_every": hp.log_every}
    for name, value in positive.items():
        if value <= 0:
            return f"--{name.replace('_', '-')} must be positive, got {value}"
    if model.n_embd % model.n_head:
        return f"--n-embd {model.n_embd} must be divisible by --n-head {model.n_head}"
    if hp.seq_len > model.block_size:
        return f"--seq-len {hp.seq_len} exceeds --block-size {model.block_size}"
    per_micro = hp.micro_batch * hp.seq_len
    if hp.batch_tokens % per_micro:
        return (f"--batch-tokens {hp.batch_tokens} must be a multiple of --micro-batch x --seq-len = {per_micro} "
                "(times the number of processes under torchrun)")
    for name in ("warmup_steps", "val_every", "checkpoint_every", "dynamics_every"):
        if getattr(hp, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0, got {getattr(hp, name)}"
    if not 0.0 <= hp.cooldown_frac <= 1.0 or not 0.0 <= hp.min_lr_frac <= 1.0:
        return "--cooldown-frac and --min-lr-frac must lie in [0, 1]"
    for name in ("std_q_min", "std_q_max", "std_v_min", "std_v_max"):
        if getattr(model, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0"
    if opt.lr is not None and opt.lr <= 0:
        return f"--lr must be positive, got {opt.lr}"
    if hp.dynamics_every and opt.optimizer not in VELOCITY_OPTIMIZERS:
        return (f"--dynamics-every needs a velocity, which SPEC §6 defines for --optimizer "
                f"{', '.join(VELOCITY_OPTIMIZERS)}; {opt.optimizer} has none (set --dynamics-every 0)")
    return None


# -----------------------------------------------------------------------------------------------------------------
# Model: nanoGPT's GPT-2 with the symmetry-breaking biases injected into attention (SPEC §1–2).


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
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
        y = attention(q, k, v, b_q, b_v, causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


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
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, b_q=None, b_k=None, b_v=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), b_q, b_k, b_v)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 (pre-LN, learned positions, tied embeddings) whose attention takes per-batch biases b_Q, b_V.

    forward(idx, targets, biases): `biases` is what `BiasSampler.sample` returns — a tensor (n_layer, 3, d) or
    (n_layer, 3, H, d) holding b_Q, b_K, b_V per layer; None means evaluation, which uses the means (SPEC §1).
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

    def _init_weights(self, module: nn.Module) -> None:
        """N(0, 0.02), residual projections scaled by (2L)^-1/2, biases zero, PReLU slopes N(0.2, 1) (SPEC §2)."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if hasattr(module, "is_residual_projection") else 0.02
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
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def estimate_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·H·d·T for attention (PaLM App. B, nanoGPT)."""
        cfg = self.config
        return 6 * self.get_num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * seq_len


# -----------------------------------------------------------------------------------------------------------------
# Symmetry-breaking bias sampler (SPEC §1): stateless, each draw a function of (seed, step, chunk, layer).


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
    """Draws b_Q, b_K, b_V for one forward pass.

    Layer i's draw at (step, chunk) comes from numpy's SeedSequence([seed, step, chunk, i]), where chunk is the
    global index of the micro-batch within the step's batch (see data.loader). It holds no state, so a resumed run
    and a run on any number of GPUs see the same biases for the same data.
    """

    def __init__(self, config: GPTConfig, seed: int):
        self.config, self.seed = config, seed
        mean_q, std_q, mean_v, std_v = bias_distribution(config)
        self.mean = mean_biases(config)[0].numpy()
        std = np.stack([std_q.numpy(), std_q.numpy(), std_v.numpy()])  # (3, d)
        self.std = std[:, None, :] if config.bias_per_head else std

    def sample(self, step: int, chunk: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The (n_layer, 3, [n_head,] d) draws; None when the mode samples no bias (the forward pass reads none)."""
        if not any(self.config.sampled_biases):
            return None
        shape = _bias_shape(self.config)
        draws = np.empty(shape, dtype=np.float32)
        for layer in range(self.config.n_layer):
            rng = np.random.default_rng([self.seed, step, chunk, layer])
            draws[layer] = self.mean + self.std * rng.standard_normal(shape[1:])
        tensor = torch.from_numpy(draws)
        device = torch.device(device)
        if device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "rule": "SeedSequence([seed, step, chunk, layer])"}


# -----------------------------------------------------------------------------------------------------------------
# Checkpoints and run directories.


def resolve_checkpoint_path(path: str | os.PathLike, flag: str = "--resume") -> Path:
    """A checkpoint file, or a run directory (→ its checkpoints/latest.pt); an error naming the flag and file."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoints" / "latest.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: no checkpoint at {path}; a run writes one at its end and every "
                                "--checkpoint-every steps")
    return path


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", mmap: bool = False) -> dict:
    """Load and check a checkpoint written by `save_checkpoint` (mmap: tensors are read only when touched)."""
    ckpt = torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a {CHECKPOINT_FORMAT} checkpoint")
    return ckpt


def save_checkpoint(path: str | os.PathLike, checkpoint: dict) -> None:
    """Write atomically: a crash mid-write leaves the previous checkpoint intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)


def config_from_dict(d: dict, cls: type = GPTConfig):
    """A config dataclass (GPTConfig, Hyperparameters, ...) from a saved section: missing keys take the defaults,
    unknown keys are ignored (checkpoints of older or newer code)."""
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def model_from_checkpoint(checkpoint: str | os.PathLike | dict) -> GPT:
    """The checkpoint's model on the CPU in eval mode (evaluation uses the mean biases)."""
    ckpt = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint)
    model = GPT(config_from_dict(ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    return model.eval()


def prepare_run_dir(hp: Hyperparameters, opt: OptimizerConfig, preset: str | None) -> Path:
    """Create the run directory (or reuse the resumed one) with a copy of the code, like speedrun records."""
    if hp.resume:
        run_dir = resolve_checkpoint_path(hp.resume).parent.parent
    else:
        name = hp.run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{preset or 'custom'}-{opt.optimizer}"
        run_dir = Path(hp.run_dir) / name
    code_dir = run_dir / "code"
    for package in ("", "kernels", "optim", "data"):
        for source in sorted((REPO_ROOT / package).glob("*.py")):
            target = code_dir / package / source.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    return run_dir


# -----------------------------------------------------------------------------------------------------------------
# Training.


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


def resolve_data_files(hp: Hyperparameters, is_master: bool) -> tuple[str, str]:
    """Training/validation shard globs: --val-files when given; the rest from --train-files, else downloaded
    FineWeb-Edu, else the embedded corpus."""
    train, val = default_data_files(hp, is_master)
    return train, hp.val_files or val


def default_data_files(hp: Hyperparameters, is_master: bool) -> tuple[str, str]:
    """Training/validation shard globs without --val-files (validation on the training shards with --train-files)."""
    if hp.train_files:
        return hp.train_files, hp.train_files
    from data import fineweb_edu

    if fineweb_edu.fineweb_shards_present():
        return fineweb_edu.DEFAULT_TRAIN_PATTERN, fineweb_edu.DEFAULT_VAL_PATTERN
    from data.embedded import prepare_embedded_corpus

    if is_master:
        print0("no --train-files and no FineWeb-Edu shards: using the embedded corpus (Python docstrings)")
        files = prepare_embedded_corpus()
    if dist.is_initialized():
        dist.barrier()
    return files if is_master else prepare_embedded_corpus()  # the other ranks find the master's cache


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def print0(*args, **kwargs) -> None:
    if rank_and_world_size()[0] == 0:
        print(*args, **kwargs, flush=True)


@torch.no_grad()
def evaluate(model: GPT, val_files: str, hp: Hyperparameters, rank: int, world: int, device: torch.device,
             autocast: contextlib.AbstractContextManager) -> float:
    """Mean loss over the fixed validation budget (hp.val_tokens in micro-batches of hp.micro_batch x hp.seq_len,
    which weigh equally), with the mean biases (SPEC §1), averaged over ranks; the trainer and eval.val_loss."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for x, y in validation_batches(val_files, hp.micro_batch, hp.seq_len, hp.val_tokens, rank=rank,
                                   world_size=world, vocab_size=model.config.vocab_size, device=device):
        with autocast:
            total += model(x, y)[1].double()
        count += 1
    model.train(was_training)
    stats = all_reduce_sum(torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=device)]))
    return (stats[0] / stats[1]).item()


def main(argv: list[str] | None = None) -> dict:
    """Train as configured by `argv` (see --help); returns a summary dict (also the last line of log.jsonl)."""
    model_cfg, hp, opt_cfg, preset = parse_config(argv)

    # ---- distributed setup: torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; the config is checked before a group exists
    world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    distributed = world > 1
    use_cuda = hp.device == "cuda" or (hp.device == "auto" and torch.cuda.is_available())
    if hp.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available (use --device cpu)")
    per_step_micro = hp.batch_tokens // (hp.micro_batch * hp.seq_len)
    if per_step_micro % world:
        sequences_per_rank, rest = divmod(hp.batch_tokens, hp.seq_len * world)
        keep = f"--micro-batch {sequences_per_rank} keeps the global batch, or " if sequences_per_rank and not rest \
            else ""
        raise SystemExit(f"--batch-tokens {hp.batch_tokens} does not split into micro-batches of --micro-batch "
                         f"{hp.micro_batch} x --seq-len {hp.seq_len} over {world} processes: {keep}set --batch-tokens "
                         f"to a multiple of {hp.micro_batch * hp.seq_len * world}")
    if distributed:
        init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    is_master = rank == 0
    grad_accum = per_step_micro // world
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if use_cuda and hp.dtype == "bf16"
                else contextlib.nullcontext())

    # ---- data, run directory, log
    train_files, val_files = resolve_data_files(hp, is_master)
    run_dir = prepare_run_dir(hp, opt_cfg, preset) if is_master else None
    log_txt = open(run_dir / "log.txt", "a") if is_master else None
    log_jsonl = open(run_dir / "log.jsonl", "a") if is_master else None

    def log(line: str) -> None:
        print0(line)
        if log_txt:
            log_txt.write(line + "\n")
            log_txt.flush()

    def log_record(record: dict) -> None:
        if log_jsonl:
            log_jsonl.write(json.dumps(record) + "\n")
            log_jsonl.flush()

    config_dict = {section: asdict(cfg) for section, cfg in zip(CONFIG_CLASSES, (model_cfg, hp, opt_cfg))}
    if is_master:
        (run_dir / "config.json").write_text(json.dumps(config_dict, indent=2))
        log_txt.write(Path(__file__).read_text() + "\n" + "=" * 100 + "\n")
        log(f"python {sys.version.split()[0]} | torch {torch.__version__} | device {device}"
            + (f" ({torch.cuda.get_device_name(device)})" if use_cuda else "") + f" | world {world}")
        log(f"run directory {run_dir}")

    # ---- model and optimizers
    torch.manual_seed(hp.seed)
    model = GPT(model_cfg).to(device)
    spec = OPTIMIZERS[opt_cfg.optimizer]
    opt_cfg = resolve_config(opt_cfg, spec)
    optimizers = spec.build(model, opt_cfg)
    for opt in optimizers:
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
    loader_kwargs = dict(rank=rank, world_size=world, grad_accum_steps=grad_accum,
                         vocab_size=model_cfg.vocab_size, align_to_eot=hp.align_to_eot, device=device)
    loader = DistributedTokenLoader(train_files, hp.micro_batch, hp.seq_len, **loader_kwargs)
    sampler = BiasSampler(model_cfg, hp.seed)
    start_step, train_time, tokens_seen, reached_target = 0, 0.0, 0, None
    if hp.resume:
        ckpt = load_checkpoint(resolve_checkpoint_path(hp.resume), map_location=device)
        model.load_state_dict(ckpt["model"])
        for opt, state in zip(optimizers, ckpt["optimizers"], strict=True):
            opt.load_state_dict(state)
        loader.load_state_dict(ckpt["loader"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        start_step = ckpt["step"]
        train_time, tokens_seen = ckpt["metrics"]["train_time_s"], ckpt["metrics"]["tokens"]
        reached_target = ckpt["metrics"].get("reached_target")
        log(f"resumed from step {start_step}")
    num_params = model.get_num_params()
    log(f"model: {num_params:,} parameters | optimizer {spec.name} | grad accumulation {grad_accum} | "
        f"{hp.batch_tokens:,} tokens per step")

    # nanoGPT's order: compile first, then wrap in DDP (whose no_sync skips all-reduces during accumulation)
    train_model: nn.Module = torch.compile(model) if use_cuda and hp.compile else model
    ddp_model = None
    if distributed and not spec.reduces_gradients:
        ddp_model = nn.parallel.DistributedDataParallel(train_model, device_ids=[local_rank] if use_cuda else None)
        train_model = ddp_model
    flops_per_token = model.estimate_flops_per_token(hp.seq_len)
    peak = peak_flops(device)

    def checkpoint(step: int, metrics: dict) -> None:
        optimizer_states = [opt.state_dict() for opt in optimizers]  # a collective for sharded optimizers
        if is_master:
            # Copies: sharded optimizers make parameters views into padded flat buffers, which torch.save would
            # otherwise write whole.
            model_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            state = {
                "format": CHECKPOINT_FORMAT, "step": step, "config": config_dict, "model": model_state,
                "optimizers": optimizer_states, "loader": loader.state_dict(), "sampler": sampler.state_dict(),
                "rng": {"torch": torch.get_rng_state()}, "metrics": metrics,
            }
            save_checkpoint(run_dir / "checkpoints" / "latest.pt", state)
            if hp.keep_checkpoints:
                save_checkpoint(run_dir / "checkpoints" / f"step_{step:06d}.pt", state)
        if distributed:
            dist.barrier()

    def metrics(step: int, **extra) -> dict:
        return {"step": step, "tokens": tokens_seen, "train_time_s": train_time, "reached_target": reached_target,
                **extra}

    # ---- the loop
    val_loss = start_val_loss = None
    last_log_time, last_log_tokens = train_time, tokens_seen
    step = start_step
    for step in range(start_step, hp.steps + 1):
        last_step = step == hp.steps
        resumed_here = hp.resume and step == start_step
        if last_step or (hp.val_every and step % hp.val_every == 0 and not resumed_here):
            val_loss = evaluate(model, val_files, hp, rank, world, device, autocast)
            if step == start_step:
                start_val_loss = val_loss
            log(f"step {step}/{hp.steps} | val loss {val_loss:.4f} | train time {train_time:.1f}s")
            log_record(metrics(step, val_loss=val_loss, elapsed_s=train_time))
            if hp.target_val_loss and reached_target is None and val_loss <= hp.target_val_loss:
                reached_target = {"step": step, "train_time_s": train_time, "tokens": tokens_seen,
                                  "val_loss": val_loss}
                log(f"target val loss {hp.target_val_loss} reached at step {step} after {train_time:.1f}s "
                    f"of training ({tokens_seen:,} tokens)")
                if hp.stop_at_target:
                    last_step = True
        if last_step:
            break

        # one optimizer step over grad_accum micro-batches (the clock excludes validation and checkpoints)
        t0 = time.perf_counter()
        factor = lr_factor(step, hp)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * factor
        train_loss = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y, chunk = loader.next_batch()
            biases = sampler.sample(step, chunk, device)
            sync = ddp_model.no_sync() if ddp_model is not None and micro < grad_accum - 1 \
                else contextlib.nullcontext()
            with sync, autocast:
                _, loss = train_model(x, y, biases)
                (loss / grad_accum).backward()
            train_loss += loss.detach() / grad_accum
        for opt in optimizers:
            opt.step(train_loss) if spec.needs_loss else opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        tokens_seen += hp.batch_tokens
        done = step + 1

        if done % hp.log_every == 0 or done == hp.steps:
            if distributed:
                dist.all_reduce(train_loss, op=dist.ReduceOp.AVG)
            loss_value = train_loss.item()  # the host sync happens only on log steps
            if use_cuda:
                torch.cuda.synchronize()
            train_time += time.perf_counter() - t0
            if not math.isfinite(loss_value):
                log(f"step {done}: training loss is {loss_value}; stopping. The last good checkpoint (if any) "
                    f"is kept in {run_dir / 'checkpoints' if run_dir else 'the run directory'}; lower --lr or "
                    "add --warmup-steps and resume from it.")
                if distributed:  # every rank stops here alike (the loss is all-reduced); see init_process_group
                    dist.destroy_process_group()
                raise SystemExit(2)
            interval = max(train_time - last_log_time, 1e-9)
            tok_per_s = (tokens_seen - last_log_tokens) / interval
            mfu = flops_per_token * tok_per_s / (peak * world) if peak else None
            eta = (hp.steps - done) * hp.batch_tokens / tok_per_s
            record = metrics(done, train_loss=loss_value, lr=optimizers[0].param_groups[0]["lr"],
                             tokens_per_s=tok_per_s, mfu=mfu, elapsed_s=train_time)
            if hp.dynamics_every and done % hp.dynamics_every == 0:
                record.update(dynamics_summary(model, velocity_from_optimizers(optimizers), model_cfg.n_head))
            log_record(record)
            log(f"step {done}/{hp.steps} | loss {loss_value:.4f} | lr {record['lr']:.2e} | "
                f"{tok_per_s:,.0f} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu else "")
                + f" | {train_time:.1f}s | eta {format_duration(eta)}")
            last_log_time, last_log_tokens = train_time, tokens_seen
        else:
            train_time += time.perf_counter() - t0
        if step == start_step:
            log(f"optimizer state: {optimizer_state_bytes(optimizers) / num_params:.2f} bytes per parameter "
                f"on rank {rank}")
        if hp.checkpoint_every and done % hp.checkpoint_every == 0 and done != hp.steps:
            checkpoint(done, metrics(done, val_loss=val_loss))

    checkpoint(step, metrics(step, val_loss=val_loss))
    summary = metrics(step, val_loss=val_loss, run_dir=str(run_dir) if run_dir else None,
                      tokens_per_s=tokens_seen / train_time if train_time else None)
    log(f"done: {step} steps, val loss " + (f"{start_val_loss:.4f} at step {start_step} -> " if start_val_loss else "")
        + f"{val_loss:.4f} at step {step}, {train_time:.1f}s of training"
        + (f", target reached at step {reached_target['step']}" if reached_target else ""))
    log_record({"summary": True, **summary})
    loader.close()
    for handle in (log_txt, log_jsonl):
        if handle:
            handle.close()
    if distributed:
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
