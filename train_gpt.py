"""Train GPT-2 with symmetry-breaking attention biases (docs/model.md), on 1..N GPUs under torchrun or on a CPU.

    python train_gpt.py --preset smoke                                  # CPU, a few minutes, embedded corpus
    torchrun --standalone --nproc_per_node=8 train_gpt.py               # the paper's run on 8 GPUs

Reads top to bottom: flags → model (GPT-2 with per-batch sampled b_Q, b_V) → bias sampler → learning-rate schedule
→ evaluation → the trainer (build, restore, open the run, the step, validate, checkpoint, log, the loop, finish) →
main. The machinery is imported as modules, so each call names where it lives: config (presets, parsing, checks);
run.process, run.checkpoint (the format), run.training_state (what is saved and restored), run.directory, run.log
(as runlog), run.stop, run.capture (the step replayed from a CUDA graph); timing (the training clock, the profiler
window); variants, hooks (tools around the optimizer step); data, optim, kernels.attention_paths, kv_cache, fileio.
Importing this module has no side effects. References: nanoGPT (model layout and names), modded-nanogpt (trainer
shape), arXiv 2601.22257 (the symmetry-breaking protocol), docs/ (every formula and default used here).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cli
import config
import fileio
import hooks
import kv_cache
import optim
import optim.distributed
import timing
import variants
from data import loader, lookup, shards
from kernels import attention_paths
from run import capture, checkpoint, directory, process, stop, training_state
from run import log as runlog

# -----------------------------------------------------------------------------------------------------------------
# Flags. Every field of GPTConfig, TrainConfig, variants.ResearchConfig and the chosen optimizer's config is a flag
# `--field-name` (cli.flag: default, help, range and role written once, in the field); config.py parses them.

model_flag = functools.partial(cli.flag, fixed_on_resume=True)  # a resumed run keeps the checkpoint's model
# --compile-mode → torch.compile's own mode: the CUDA graphs of the other two are the trainer's (run/capture.py)
COMPILE_MODES = {"default": None, "reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


@dataclass
class GPTArchitecture:
    """GPT-2 architecture and symmetry-breaking biases; defaults are the paper's 124M model (docs/model.md)."""

    vocab_size: int = model_flag(50304, "vocabulary (50257 GPT-2 tokens padded to a multiple of 64)", bounds="> 0")
    block_size: int = model_flag(512, "context length (positional embeddings); the paper uses 512, GPT-2 1024",
                                 bounds="> 0")
    n_layer: int = model_flag(12, "transformer blocks", bounds="> 0")
    n_head: int = model_flag(12, "attention heads per block", bounds="> 0")
    n_embd: int = model_flag(768, "model width C; head dim d = C / n_head", bounds="> 0")
    activation: str = model_flag("prelu", "MLP activation: prelu (per-feature slope, init N(0.2, 1)) or gelu",
                                 choices=("prelu", "gelu"))
    bias_mode: str = model_flag("bqbv", "symmetry breaking: none, bq, bv, bqbv (sampled per batch) or learned "
                                        "(docs/model.md)", choices=("none", "bq", "bv", "bqbv", "learned"))
    mean_q: float = model_flag(0.5, "E[b_Q], every component")
    std_q_min: float = model_flag(0.05, "per-dimension std of b_Q = linspace(std_q_min, std_q_max, d)", bounds=">= 0")
    std_q_max: float = model_flag(0.15, "see --std-q-min", bounds=">= 0")
    mean_v: float = model_flag(0.0, "E[b_V], every component (the paper tries 0 and 0.5)")
    std_v_min: float = model_flag(0.05, "per-dimension std of b_V = linspace(std_v_min, std_v_max, d); 0.05 is the "
                                        "published code's (the paper scanned 0.02 and 0.05)", bounds=">= 0")
    std_v_max: float = model_flag(0.05, "see --std-v-min", bounds=">= 0")
    bias_per_head: bool = model_flag(False, "sample one vector per head instead of one per layer shared by all heads")
    key_bias: bool = model_flag(False, "the paper's key bias b_K: it cancels exactly in the softmax, so the model "
                                       "does not add it (docs/model.md#symmetry-breaking-biases)",
                                affects_results=False)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def sampled_biases(self) -> tuple[bool, bool]:
        """Which of (b_Q, b_V) the sampler draws in this mode."""
        return self.bias_mode in ("bq", "bqbv"), self.bias_mode in ("bv", "bqbv")


@dataclass
class GPTConfig(variants.ModelVariants, GPTArchitecture):
    """The model: GPTArchitecture's fields, then variants.ModelVariants' (their order in config.json and --help)."""


# Flags that the presets' parity report and eval.compare's conditions leave out (cli.flag's affects_results): where,
# how often or how fast, and the seed, precision and data, which the report and the run's record state on their own.
uncompared = functools.partial(cli.flag, affects_results=False)


@dataclass
class TrainConfig:
    """Optimizer choice, data, schedule, evaluation, checkpoints, logging and system settings of a run."""

    optimizer: str = cli.flag("adamw", "optimizer (listed below); its hyperparameters are the optimizer flags",
                              choices=optim.OPTIMIZERS.keys(), fixed_on_resume=True)
    train_files: str = uncompared("", "glob of training shards; empty: FineWeb-Edu if downloaded, else the embedded "
                                      "corpus", fixed_on_resume=True)
    val_files: str = uncompared("", "glob of validation shards; empty: the <prefix>_val_*.bin beside --train-files "
                                    "(else those), or the default data's validation")
    seq_len: int = cli.flag(512, "tokens per training sequence (<= block_size)", bounds="> 0", fixed_on_resume=True)
    batch_tokens: int = cli.flag(4096, "global batch per optimizer step in tokens (paper: 8 x 512, no accumulation)",
                                 bounds="> 0", fixed_on_resume=True)
    micro_batch: int = cli.flag(8, "most sequences per forward/backward pass on one rank (a memory bound): each rank "
                                   "runs the largest micro-batch up to this that splits its share of the batch, and "
                                   "accumulates gradients over the rest", bounds="> 0")
    align_to_eot: bool = cli.flag(False, "start every training sequence at an <|endoftext|> token",
                                  fixed_on_resume=True)
    steps: int = cli.flag(122070, "optimizer steps (paper: 500M tokens / 4096 tokens per step)", bounds="> 0")
    lr_schedule: str = cli.flag("constant", "constant, cosine (after warmup) or linear (constant, then linear "
                                            "cooldown)", choices=("constant", "cosine", "linear"))
    warmup_steps: int = cli.flag(0, "linear warmup steps", bounds=">= 0")
    cooldown_frac: float = cli.flag(0.2, "linear schedule: fraction of steps spent decaying to min_lr_frac",
                                    bounds="[0, 1]")
    min_lr_frac: float = cli.flag(0.0, "final learning rate as a fraction of the peak (cosine, linear)",
                                  bounds="[0, 1]")
    grad_clip: float = cli.flag(0.0, "clip the global gradient norm to this value (0: off); also logs the norm",
                                bounds=">= 0")
    val_every: int = uncompared(1000, "validate every N steps (and at the start and end); 0: only at the end",
                                bounds=">= 0")
    val_tokens: int = uncompared(1048576, "fixed validation budget in tokens (the same sequences every time, on any "
                                          "number of processes; whole sequences of --seq-len)", bounds="> 0")
    val_batch_estimate: bool = uncompared(True, "also log the published runs' validation: at each multiple of "
                                                "--val-every the loss on the next batch of --batch-tokens validation "
                                                "tokens, and the minimum of these single-batch estimates "
                                                "(docs/optimizers.md#paper-parity)")
    val_biases: str = uncompared("mean", "the biases of those single-batch estimates: mean (E[b_Q], E[b_V], as every "
                                         "other validation) or last-sample (the last training step's draw, as the "
                                         "published trainer validates)", choices=("mean", "last-sample"))
    log_every: int = uncompared(10, "print and log a line every N steps", bounds="> 0")
    checkpoint_every: int = uncompared(5000, "write checkpoints/latest.pt every N steps (0: only at the end, on "
                                             "SIGINT/SIGTERM and at a target stop)", bounds=">= 0")
    keep_checkpoints: int = uncompared(0, "also keep checkpoints/step_XXXXXX.pt of the last K checkpoints, removing "
                                          "older ones (0: latest.pt only; -1: every one)", bounds=">= -1")
    target_val_loss: float = uncompared(0.0, "report the first step and training time reaching this validation loss "
                                             "(0: off)", bounds=">= 0")
    stop_at_target: bool = uncompared(False, "stop the run once target_val_loss is reached")
    run_dir: str = uncompared("runs", "parent directory of run directories")
    run_name: str = uncompared("", "run directory name (default: timestamp-preset-optimizer); an existing run is never "
                                   "overwritten")
    resume: str = uncompared("", "checkpoint file or run directory to resume from (a damaged latest.pt falls back to "
                                 "the newest intact step_XXXXXX.pt): its config is the base and flags override it; the "
                                 "run continues in the checkpoint's run directory unless --run-name or --run-dir name "
                                 "another")
    init_from: str = cli.flag("", "start from the model weights of this checkpoint file or run directory, e.g. GPT-2 "
                                  "converted by `python -m export from-hf` (docs/export.md#hugging-face); optimizer, "
                                  "data and step start fresh; ignored by --resume")
    seed: int = uncompared(1337, "seed for initialisation and the bias sampler", bounds="[0, 4294967295]",
                           fixed_on_resume=True)
    device: str = uncompared("auto", "auto, cpu or cuda", choices=("auto", "cpu", "cuda"))
    dtype: str = uncompared("bf16", "autocast dtype on CUDA: bf16 or fp32 (CPU always computes in fp32; the preset "
                                    "report states the precision separately)", choices=("bf16", "fp32"))
    compile: bool = uncompared(True, "torch.compile the model on CUDA")
    compile_mode: str = uncompared(
        "default", "default, reduce-overhead (the whole step, forward, backward and optimizer, replayed from one CUDA "
                   "graph: one launch, for small steps) or max-autotune (the same with torch.compile's kernel tuning) "
                   "(docs/runs.md#cuda-graphs)", choices=tuple(COMPILE_MODES))
    profile_steps: str = uncompared("", "A:B profiles the steps after step A up to step B with torch.profiler: a trace "
                                        "in the run directory, host and device time per step in log.txt (empty: off)")
    attention_impl: str = uncompared("auto", "attention implementation, all exact: auto (this GPU's row of "
                                             "kernels/attention_table.json, else sdpa), triton, sdpa or flex "
                                             "(docs/model.md#choosing-the-implementation)",
                                     choices=attention_paths.CHOICES)
    overlap_reduce: bool = uncompared(True, "ECD/SOAP/Muon under torchrun: average each gradient bucket while the "
                                            "backward pass computes the others (as DDP does)")
    wandb_project: str = uncompared("", "also send the config and log.jsonl's numbers to this Weights & Biases project "
                                        "(needs `pip install wandb`; empty: off)")
    wandb_run_name: str = uncompared("", "Weights & Biases run name (default: the run directory's name)")
    tensorboard: str = uncompared("", "also write log.jsonl's numbers as TensorBoard scalars to DIR/<run name> (needs "
                                      "`pip install tensorboard`; empty: off)")


def parse_config(argv: list[str] | None = None) -> config.RunConfig:
    """config.parse_run_config (defaults ← preset ← resumed run ← flags) with the flag classes above."""
    return config.parse_run_config(argv, GPTConfig, TrainConfig)


# -----------------------------------------------------------------------------------------------------------------
# Model: nanoGPT's GPT-2 with the symmetry-breaking biases injected into attention (docs/model.md).


class CausalSelfAttention(nn.Module):
    """Multi-head dot-product attention with the biases; causal under --objective clm, in both directions under mlm."""

    def __init__(self, model_config: GPTConfig):
        super().__init__()
        self.n_head = model_config.n_head
        self.causal = model_config.objective == "clm"
        self.c_attn = nn.Linear(model_config.n_embd, 3 * model_config.n_embd)
        self.c_proj = nn.Linear(model_config.n_embd, model_config.n_embd)
        self.c_proj.is_residual_projection = True
        self.attention_impl = attention_paths.DEFAULT_IMPLEMENTATION  # a run sets its choice, a reader replays it
        self.learned_biases = model_config.bias_mode == "learned"
        if self.learned_biases:
            # arXiv 2601.22257 App. F: trainable biases drawn from the sampling distribution (restore the symmetry).
            shape = mean_biases(model_config).shape[2:]  # one layer's b_Q as drawn: (d,), or (H, d) per head
            self.b_q = nn.Parameter(torch.empty(shape))
            self.b_v = nn.Parameter(torch.empty(shape))

    @torch.no_grad()
    def init_weights(self, model_config: GPTConfig) -> None:  # after GPT._init_weights: learned biases as sampled ones
        if self.learned_biases:
            std_q, std_v = bias_stds(model_config)
            self.b_q.copy_(model_config.mean_q + std_q * torch.randn_like(self.b_q))
            self.b_v.copy_(model_config.mean_v + std_v * torch.randn_like(self.b_v))

    def forward(self, x: torch.Tensor, b_q: torch.Tensor | None, b_v: torch.Tensor | None, cache=None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        if self.learned_biases:
            b_q, b_v = self.b_q, self.b_v
        if cache is not None:  # generation: the keys and values of the tokens read before (kv_cache.py)
            k, v = cache.update(k, v)
        y = attention_paths.attend(q, k, v, b_q, b_v, causal=self.causal and q.size(2) == k.size(2),
                                      impl=self.attention_impl)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class FeaturePReLU(nn.PReLU):
    """PReLU with one learnable negative slope per feature of the last dimension (nn.PReLU's is dim 1). Also in
    modeling_symgpt.py, which exported models load without this project; tests/test_export.py keeps the two equal."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x >= 0, x, x * self.weight.to(x.dtype))


class MLP(nn.Module):
    def __init__(self, model_config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(model_config.n_embd, 4 * model_config.n_embd)
        self.act = FeaturePReLU(4 * model_config.n_embd) if model_config.activation == "prelu" else nn.GELU()
        self.c_proj = nn.Linear(4 * model_config.n_embd, model_config.n_embd)
        self.c_proj.is_residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


ATTENTION = {"standard": CausalSelfAttention, "relational": variants.RelationalAttention}  # --attention


class Block(nn.Module):
    def __init__(self, model_config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(model_config.n_embd)
        self.attn = ATTENTION[model_config.attention](model_config)
        self.ln_2 = nn.LayerNorm(model_config.n_embd)
        self.mlp = MLP(model_config)

    def forward(self, x: torch.Tensor, b_q=None, b_v=None, cache=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), b_q, b_v, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 (pre-LN, learned positions, tied embeddings) whose attention takes per-batch biases b_Q, b_V.

    forward(idx, targets, biases): `biases` is what `BiasSampler.sample` returns — a tensor (n_layer, 2, d) or
    (n_layer, 2, H, d) holding b_Q, b_V per layer; None means evaluation, which uses the means (docs/model.md).
    Targets equal to -1 are not scored (under --objective mlm every position but the masked ones). Without targets,
    only the last position's logits (nanoGPT's way, for sample.generate) unless all_logits. docs/variants.md."""

    def __init__(self, model_config: GPTConfig):
        super().__init__()
        self.config = model_config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(model_config.vocab_size, model_config.n_embd),
            wpe=nn.Embedding(model_config.block_size, model_config.n_embd),
            h=nn.ModuleList([Block(model_config) for _ in range(model_config.n_layer)]),
            ln_f=nn.LayerNorm(model_config.n_embd),
        ))
        self.lm_head = nn.Linear(model_config.n_embd, model_config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.register_buffer("mean_biases", mean_biases(model_config), persistent=False)
        self.apply(self._init_weights)
        if model_config.init == "symmetric":
            variants.symmetric_init(self)

    def _init_weights(self, module: nn.Module) -> None:
        """N(0, 0.02), residual projections scaled by (2L)^-1/2, biases zero, PReLU slopes N(0.2, 1) (docs/model.md);
        then each attention module initialises its own extras (learned biases, relational attention's score MLP)."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if hasattr(module, "is_residual_projection") else 0.02
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.PReLU):
            torch.nn.init.normal_(module.weight, mean=0.2, std=1.0)
        elif isinstance(module, tuple(ATTENTION.values())):
            module.init_weights(self.config)

    def get_num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (tied weights once); non_embedding drops the positional table, as in nanoGPT."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, biases: torch.Tensor | None = None,
                cache: kv_cache.KVCache | None = None, all_logits: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, T = idx.shape
        start = 0 if cache is None else cache.length  # with a cache, idx continues the tokens it holds
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size {self.config.block_size}")
        biases = self.mean_biases if biases is None else biases  # evaluation: the means
        use_q, use_v = self.config.sampled_biases
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for i, block in enumerate(self.transformer.h):
            x = block(x, biases[i, 0] if use_q else None, biases[i, 1] if use_v else None,
                      None if cache is None else cache[i])
        x = self.transformer.ln_f(x)
        if targets is None:  # generation reads the last position: T x vocab logits would be T - 1 rows wasted
            return self.lm_head(x if all_logits else x[:, -1:]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def estimate_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·H·d·T for attention (PaLM App. B, nanoGPT)."""
        return 6 * self.get_num_params(non_embedding=True) + 12 * self.config.n_layer * self.config.n_embd * seq_len


def model_from_checkpoint(source: str | os.PathLike | dict) -> GPT:
    """The model of a checkpoint (a file is read with config.read_checkpoint, which checks its configuration) on
    the CPU in eval mode (evaluation uses the mean biases), on the attention path its run chose and recorded (the
    model's default, sdpa, where it recorded none)."""
    ckpt = source if isinstance(source, dict) else config.read_checkpoint(source, GPTConfig, TrainConfig)
    model = GPT(config.config_from_dict(ckpt["config"]["model"], GPTConfig))
    model.load_state_dict(checkpoint.link_tied(ckpt)["model"])
    if (recorded := ckpt["config"]["attention"]) and recorded["choice"]:
        attention_paths.set_implementation(model, recorded["choice"])
    return model.eval()


# -----------------------------------------------------------------------------------------------------------------
# Symmetry-breaking bias sampler (docs/model.md): stateless, each draw a function of (seed, step, layer).

BIAS_STEPS_AHEAD = 64  # steps the trainer's sampler draws and copies to the device at once


def bias_stds(model_config: GPTConfig) -> torch.Tensor:
    """(2, d): the per-dimension std of b_Q, then of b_V, linspace(min, max, d)."""
    return torch.stack([torch.linspace(model_config.std_q_min, model_config.std_q_max, model_config.head_dim),
                        torch.linspace(model_config.std_v_min, model_config.std_v_max, model_config.head_dim)])


def mean_biases(model_config: GPTConfig) -> torch.Tensor:
    """E[b_Q], E[b_V] per layer, (n_layer, 2, [n_head,] d) as the sampler draws them: what evaluation uses."""
    one_bias = (model_config.n_head, model_config.head_dim) if model_config.bias_per_head else (model_config.head_dim,)
    out = torch.empty(model_config.n_layer, 2, *one_bias)
    out[:, 0] = model_config.mean_q
    out[:, 1] = model_config.mean_v
    return out


class BiasSampler:
    """Draws b_Q, b_V for one optimizer step, shared by every micro-batch and rank of the step: layer i's draw at
    `step` from default_rng([seed, step, i]), no state (docs/model.md#reproducible-sampling). With `ahead` > 1 it
    draws that many steps at once and copies them to the device in one transfer, which the next steps then index: the
    same numbers, without a host-to-device copy per step."""

    def __init__(self, model_config: GPTConfig, seed: int, ahead: int = 1):
        self.model_config, self.seed, self.ahead = model_config, seed, ahead
        self.mean = mean_biases(model_config)[0].numpy()
        std = bias_stds(model_config).numpy()
        self.std = std[:, None, :] if model_config.bias_per_head else std
        self._drawn: tuple[int, torch.Tensor] | None = None  # (first step, draws of `ahead` steps on the device)

    def sample(self, step: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The (n_layer, 2, [n_head,] d) draws; None when the mode samples no bias (the forward pass reads none)."""
        if not any(self.model_config.sampled_biases):
            return None
        device = torch.device(device)
        if self._drawn is None or not 0 <= step - self._drawn[0] < self.ahead or self._drawn[1].device != device:
            self._drawn = step, self._draw(range(step, step + self.ahead), device)
        return self._drawn[1][step - self._drawn[0]]

    def _draw(self, step_range: range, device: torch.device) -> torch.Tensor:
        draws = np.empty((len(step_range), self.model_config.n_layer, *self.mean.shape), dtype=np.float32)
        for i, step in enumerate(step_range):
            for layer in range(self.model_config.n_layer):
                rng = np.random.default_rng([self.seed, step, layer])
                # rows b_Q, b_K, b_V: b_K's unused (it cancels), kept so that b_Q, b_V stay earlier runs' draws
                draws[i, layer] = self.mean + self.std * rng.standard_normal((3, *self.mean.shape[1:]))[::2]
        tensor = torch.from_numpy(draws)
        if device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)


# -----------------------------------------------------------------------------------------------------------------
# Learning-rate schedule


def lr_factor(step: int, hp: TrainConfig) -> float:
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


# -----------------------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model: GPT, files: str, num_tokens: int, seq_len: int, micro_batch: int, *, first_sequence: int = 0,
             rank: int = 0, world: int = 1, device: torch.device | str = "cpu", biases: torch.Tensor | None = None,
             autocast: contextlib.AbstractContextManager = contextlib.nullcontext()) -> float:
    """Mean loss per scored token over num_tokens // seq_len validation sequences from `first_sequence` on, with
    `biases` (None: the means, docs/model.md), summed over every rank's share: the same sequences and the same number
    on any number of ranks and micro-batch (docs/evaluation.md#validation-loss). Under --objective mlm the loss on the
    validation stream's fixed masks. The trainer's validation, its single-batch estimate, and eval.val_loss."""
    was_training = model.training
    model.eval()
    objective = variants.objective_for(model.config)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y, first_row in loader.validation_batches(files, micro_batch, seq_len, num_tokens,
                                                     first_sequence=first_sequence, rank=rank, world_size=world,
                                                     vocab_size=model.config.vocab_size, device=device):
        x, y = objective.batch(x, y, first_row)
        with autocast:
            loss = model(x, y, biases)[1]
        scored = (y != -1).sum()
        total += torch.stack([loss.double() * scored, scored.double()])
    model.train(was_training)
    total = optim.distributed.all_reduce_sum(total)
    return (total[0] / total[1]).item()


# -----------------------------------------------------------------------------------------------------------------
# Training: process.setup_process → Trainer (build, restore, open the run, loop, finish).


class Trainer:
    """The run: built in __init__ from the config (data, its validation part checked before any step; model,
    optimizer, loader, bias sampler, objective, hooks, the step), then `restore` (for --resume), `open_run`, `train`,
    `finish`. `training_state` is what a checkpoint saves and --resume restores; `progress`, in it, what changes."""

    def __init__(self, run_config: config.RunConfig, rt: process.Runtime, log: runlog.RunLog) -> None:
        hp, model_config = run_config.train, run_config.model
        self.run_config, self.rt, self.log = run_config, rt, log
        train_files, self.val_files, self.data_record, lines = lookup.training_data(hp, model_config.vocab_size,
                                                                                     rt.is_master)
        for line in lines:
            log.line(line)
        torch.manual_seed(hp.seed)
        self.model = GPT(model_config).to(rt.device)
        if hp.init_from and not hp.resume:
            log.line(training_state.load_initial_weights(self.model, hp.init_from))
        self.spec = optim.OPTIMIZERS[hp.optimizer]
        self.optimizer = self.spec.build(self.model, run_config.optim, hp.grad_clip, hp.overlap_reduce)
        self.peak_settings = [{k: v for k, v in group.items() if k != "params"}  # each group's as built (lr: the peak)
                              for group in self.optimizer.param_groups]
        self.loader = loader.DistributedTokenLoader(train_files, rt.micro_batch, hp.seq_len, rank=rt.rank,
                                                    world_size=rt.world, grad_accum_steps=rt.grad_accum,
                                                    vocab_size=model_config.vocab_size, align_to_eot=hp.align_to_eot,
                                                    device=rt.device)
        self.attention = attention_paths.configure(  # before torch.compile, which then sees one implementation
            self.model, hp.attention_impl, device=rt.device, dtype=rt.autocast_dtype,
            compiled=hp.compile and rt.device.type == "cuda", log=log.line)
        self.sampler = BiasSampler(model_config, hp.seed, ahead=BIAS_STEPS_AHEAD)
        self.objective = variants.objective_for(model_config)
        self.hooks = hooks.TrainingHooks(run_config.research, model_config.n_head, hp.optimizer, run_config.optim)
        self.training_state = training_state.TrainingState(
            model=self.model, optimizer=self.optimizer, peak_settings=self.peak_settings, loader=self.loader,
            hooks=self.hooks, device=rt.device)
        self.run_directory: directory.RunDirectory | None = None
        self.checkpoint_step: int | None = None  # step of the last checkpoint written or resumed from
        self.resumed: dict | None = None  # what --resume continued from and changed
        self.first_val: tuple[int, float] | None = None  # (step, loss) of this process's first validation
        self.last_batch: tuple | None = None  # (x, y, biases) of the last micro-step: the finiteness check's input
        self.clock = timing.TrainingClock(rt.device,
                                          rt.mfu_per_token_s(self.model.estimate_flops_per_token(hp.seq_len)))
        self.profile = timing.ProfileWindow(hp.profile_steps, rt.device)
        self.step_model, self.no_sync, self.run_step = self.build_step()

    def build_step(self) -> tuple[nn.Module, Callable, Callable]:
        """(step_model, no_sync, run_step): the model compiled on CUDA, then in DDP unless the optimizer averages
        gradients (nanoGPT's order); what stops an accumulating micro-step from averaging; the step, replayed from a
        CUDA graph under --compile-mode reduce-overhead or max-autotune (run/capture.py). `restore` may follow: the
        weights it loads are loaded alike on every rank, and compiling and capturing wait for the first step."""
        rt, hp = self.rt, self.run_config.train
        step_model: nn.Module = self.model
        if rt.device.type == "cuda" and hp.compile:
            step_model = torch.compile(self.model, mode=COMPILE_MODES[hp.compile_mode])
        if rt.world > 1 and not self.spec.reduces_gradients:
            step_model = nn.parallel.DistributedDataParallel(
                step_model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
        no_sync = self.optimizer.no_sync if self.spec.reduces_gradients else getattr(step_model, "no_sync",
                                                                                     contextlib.nullcontext)
        run_step = self.step_on_device if hp.compile_mode == "default" else capture.graph_step(
            self.step_on_device, self.optimizer, rt, mode=hp.compile_mode, step_tools=self.hooks.step_tools(),
            log_line=self.log.line)
        return step_model, no_sync, run_step

    @property
    def progress(self) -> checkpoint.Progress:
        return self.training_state.progress

    # -- checkpoints --------------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Continue from --resume: the inverse of `save`, except that the optimizer settings of the current
        config (lr, weight decay, betas, ...) replace the saved ones, so flags given on --resume take effect."""
        path = self.run_config.resume_from
        for note in self.run_config.notes:
            self.log.line(note)
        ckpt = checkpoint.load_checkpoint(path, map_location=self.rt.device)
        for line in lookup.check_resumed_data(ckpt["config"]["data"], self.data_record, self.rt.device) + \
                self.training_state.load_state_dict(ckpt, path):  # warnings on the data; the thread count replayed
            self.log.line(line)
        self.checkpoint_step = self.progress.step
        if not self.state_is_finite():
            raise checkpoint.CheckpointError(f"--resume: {path} holds non-finite weights or optimizer state; resume "
                                             "from an earlier checkpoint (--keep-checkpoints K keeps "
                                             "checkpoints/step_XXXXXX.pt)")
        changed = config.changed_settings(self.run_config, ckpt["config"])
        self.log.line(f"resumed from step {self.progress.step} of {path}"
                      + "".join(f" | {k} {old} -> {new}" for k, (old, new) in changed.items()))
        self.resumed = {"resumed_from": str(path), "step": self.progress.step, "tokens": self.progress.tokens,
                        "changed": changed}

    def state_is_finite(self) -> bool:
        """Whether parameters, optimizer state and the loss the parameters give on the last micro-batch are all
        finite on every rank (a collective): the condition for writing a checkpoint."""
        with torch.no_grad(), self.rt.autocast():
            loss = [] if self.last_batch is None else [self.model(*self.last_batch)[1]]
        return stop.all_finite([*self.model.parameters(), *optim.optimizer_state_tensors(self.optimizer), *loss])

    def save(self) -> None:
        """checkpoints/latest.pt (and the last --keep-checkpoints step_XXXXXX.pt), only from a finite state."""
        if not self.state_is_finite():
            self.stop_non_finite("the state after this step (weights, optimizer state or the loss they give)")
        state = self.training_state.state_dict()  # a collective for sharded optimizers
        if self.rt.is_master:
            saved_config = {**self.run_config.to_dict(), "data": self.data_record, "preset": self.run_config.preset,
                            "attention": self.attention}
            checkpoint.save_run_checkpoint(self.run_directory.path, checkpoint.training_checkpoint(saved_config, state),
                                           self.run_config.train.keep_checkpoints)
        if self.rt.world > 1:
            dist.barrier()
        self.checkpoint_step = self.progress.step

    def stop_non_finite(self, what: str, step: int | None = None) -> None:
        """Stop every rank (exit 2), saying what exists and what to do; log.jsonl records that the run diverged."""
        step = self.progress.step if step is None else step
        self.log.line(stop.non_finite_stop_message(what, step, lr=self.run_config.optim.lr, resumed=self.resumed,
                                                   checkpoint_step=self.checkpoint_step,
                                                   run_dir=self.run_directory.path))
        self.log.record({"step": step, "diverged": what})
        raise stop.TrainingStopped(2)

    # -- the run directory --------------------------------------------------------------------------------------

    def open_run(self) -> None:
        """The run directory (run.directory.open_run_directory), its config.json and the log's header."""
        run_config, hp, rt = self.run_config, self.run_config.train, self.rt
        config_record = {**run_config.to_dict(), "layout": rt.layout(), "data": self.data_record,
                         "preset": config.preset_report(run_config, rt.dtype_name), "attention": self.attention}
        self.run_directory = directory.open_run_directory(run_config, rt, self.log, config_record=config_record,
                                                          code=Path(__file__).read_text(), step=self.progress.step)
        self.log.line(config.preset_lines(config_record["preset"]))
        if self.resumed:
            self.log.record(self.resumed)
        self.log.line(f"model: {self.model.get_num_params():,} parameters | optimizer {hp.optimizer} | "
                      f"{hp.batch_tokens:,} tokens per step = {rt.world} ranks x {rt.grad_accum} micro-steps x "
                      f"{rt.micro_batch} sequences of {hp.seq_len}")

    # -- one step -------------------------------------------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over grad_accum micro-batches: the host's part around `step_on_device`, whose outputs
        it returns (under a CUDA graph, the graph's: read them before the next step)."""
        hp, rt, progress = self.run_config.train, self.rt, self.progress
        factor = lr_factor(progress.step, hp)
        for group, values in zip(self.optimizer.param_groups, self.peak_settings):
            group["lr"] = values["lr"] * factor
        biases = self.sampler.sample(progress.step, rt.device)
        batches = []
        for _ in range(rt.grad_accum):
            x, y, chunk = self.loader.next_batch()  # chunk * micro_batch: the first row's index in the step's batch
            batches.append(self.objective.batch(x, y, chunk * rt.micro_batch, (hp.seed, progress.step)))
        self.last_batch = (*batches[-1], biases)
        before = self.hooks.snapshot(self.model)  # what the hooks read of the weights before the step
        self.optimizer.stage_step()
        outputs = self.run_step(batches, biases)
        self.optimizer.finish_step()
        self.hooks.after_step(self.model, self.optimizer, before, progress.step + 1, factor)
        self.optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        progress.tokens += hp.batch_tokens
        return outputs

    def step_on_device(self, batches: list[tuple[torch.Tensor, ...]], biases: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device's part of a step (a CUDA graph captures it): forward and backward, the optimizer's update. It
        returns all the host reads of it (run/capture.py): the mean loss, and with --grad-clip the norm before."""
        loss_sum = torch.zeros((), device=self.rt.device)
        for micro, (x, y) in enumerate(batches):
            with self.no_sync() if micro < len(batches) - 1 else contextlib.nullcontext(), self.rt.autocast():
                loss = self.step_model(x, y, biases)[1]
                (loss / len(batches)).backward()
            loss_sum += loss.detach()
        loss = loss_sum / len(batches)
        self.optimizer.device_step(loss if self.spec.needs_loss else None)
        return loss, self.optimizer.grad_norm

    # -- validation and logs --------------------------------------------------------------------------------------

    def validate(self) -> bool:
        """Validation loss on the fixed budget (and the published single-batch estimate); True when it reaches
        --target-val-loss for the first time."""
        hp, rt, progress = self.run_config.train, self.rt, self.progress
        run_eval = functools.partial(evaluate, self.model, self.val_files, seq_len=hp.seq_len,
                                     micro_batch=hp.micro_batch, rank=rt.rank, world=rt.world, device=rt.device,
                                     autocast=rt.autocast())
        progress.val_loss, progress.val_step = run_eval(hp.val_tokens), progress.step
        self.first_val = self.first_val or (progress.step, progress.val_loss)
        estimate = None
        if (first_sequence := config.single_batch_start(progress.step, hp)) is not None:  # never at step 0
            biases = self.sampler.sample(progress.step - 1, rt.device) if hp.val_biases == "last-sample" else None
            estimate = run_eval(hp.batch_tokens, first_sequence=first_sequence, biases=biases)
            progress.best_val_loss_batch = min(estimate, progress.best_val_loss_batch or math.inf)
        self.log.line(f"step {progress.step}/{hp.steps} | val loss {progress.val_loss:.4f} | train time "
                      f"{progress.train_time_s:.1f}s" + (f" | single-batch val loss {estimate:.4f} (least "
                                                         f"{progress.best_val_loss_batch:.4f})" if estimate else ""))
        self.log.record({**asdict(progress), "elapsed_s": progress.train_time_s, "val_loss_batch": estimate})
        if not math.isfinite(progress.val_loss):
            self.stop_non_finite("the validation loss")
        if not progress.reaches(hp.target_val_loss):
            return False
        self.log.line(f"target val loss {hp.target_val_loss} reached at step {progress.step} after "
                      f"{progress.train_time_s:.1f}s of training ({progress.tokens:,} tokens)")
        return True

    def log_later(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Start this log step's record: the loss averaged over ranks and the gradient norm go to the host behind an
        event (no host sync) and the hooks' fields are computed now; `write_log` finishes it a step later."""
        progress = self.progress
        scalars = [optim.distributed.all_reduce_sum(loss.float().reshape(1))[0] / self.rt.world]
        if grad_norm is not None:
            scalars.append(grad_norm)
        fields, texts = self.hooks.log(self.model, self.optimizer, self.last_batch, progress.step)
        record = {"step": progress.step, "tokens": progress.tokens, "lr": self.optimizer.param_groups[0]["lr"],
                  **fields, "texts": texts}  # no val_loss: not measured; texts: the hooks', popped by write_log
        self.clock.later(record, scalars)

    def write_log(self) -> None:
        """The held log line and record, once its numbers are on the host: loss, lr, ms per step, tokens/s and MFU
        since the last one, by the training clock (which excludes validation, logs and checkpoints)."""
        if (ready := self.clock.ready()) is None:
            return
        record, (loss, *grad_norm) = ready
        texts = record.pop("texts")
        record.update(train_loss=loss, **dict(zip(["grad_norm"], grad_norm)))
        if not math.isfinite(loss):
            self.stop_non_finite(f"the training loss ({loss})", record["step"])
        self.log.record(record)
        self.log.line(runlog.step_line(record, texts, self.run_config.train.steps))

    # -- the loop -------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def clock_paused(self):
        """The training clock runs during training steps only: stopped (once the device has caught up) around
        validation, checkpoints and the profiler (the speedrun's timing); the held log line is written first."""
        self.write_log()
        self.progress.train_time_s = self.clock.pause()
        yield
        self.clock.resume()

    def train(self, stop_request: stop.StopRequest) -> None:
        """The loop: validate when due, one optimizer step, log, checkpoint; until --steps, a reached target
        (--stop-at-target) or a stop request every rank agrees on (then checkpoint and exit 128 + signal). Between
        log steps nothing waits for the device: a log step's line is written after the next step is issued."""
        hp, progress = self.run_config.train, self.progress
        first = progress.step
        self.clock.start(progress.train_time_s, progress.step, progress.tokens)
        while progress.step < hp.steps:
            if hp.val_every and progress.step % hp.val_every == 0 and progress.val_step != progress.step:
                with self.clock_paused():
                    if self.validate() and hp.stop_at_target:
                        break
            if self.profile.opens_at(progress.step):
                with self.clock_paused():
                    self.profile.start(progress.step)
            loss, grad_norm = self.train_step()
            self.profile.step_done()
            self.write_log()  # the last log step's: the device has finished it while this step was issued
            signum = stop_request.agreed()
            if progress.step % hp.log_every == 0 or progress.step == hp.steps or signum:
                self.log_later(loss, grad_norm)
            if progress.step == first + 1:
                per_parameter = optim.optimizer_state_bytes(self.optimizer) / self.model.get_num_params()
                self.log.line(f"optimizer state: {per_parameter:.2f} bytes per parameter on rank {self.rt.rank}")
            if self.profile.closes_at(progress.step):
                self.end_profile()
            if signum and progress.step < hp.steps:
                with self.clock_paused():
                    self.save()
                self.log.line(f"{signal.Signals(signum).name} at step {progress.step}: checkpoint written; continue "
                              f"with --resume {self.run_directory.path}")
                raise stop.TrainingStopped(128 + signum)
            if hp.checkpoint_every and progress.step % hp.checkpoint_every == 0 and progress.step < hp.steps:
                with self.clock_paused():
                    self.save()
        if self.profile.profiler is not None:  # the run ended inside the window
            self.end_profile()
        with self.clock_paused():
            pass  # the last log line, and the training time up to the end

    def end_profile(self) -> None:
        """Close --profile-steps' window: its trace in the run directory, its summary in the logs."""
        with self.clock_paused():
            summary = self.profile.stop(self.run_directory.path if self.rt.is_master else None)
            self.log.line(timing.summary_lines(summary))
            self.log.record({"step": self.progress.step, "profile": summary})

    def finish(self, final: bool = True) -> dict:
        """The final checkpoint, then the final validation (so an evaluation error loses no training), the summary;
        final=False skips both (a benchmark's run)."""
        progress = self.progress
        if final and self.checkpoint_step != progress.step:
            self.save()
        if final and progress.val_step != progress.step:
            self.validate()
        summary = {**asdict(progress), "run_dir": str(self.run_directory.path),
                   "tokens_per_s": progress.tokens / progress.train_time_s if progress.train_time_s else None}
        self.log.line(runlog.done_line(summary, self.first_val, final))
        self.log.record({"summary": True, **summary})
        self.log.line(runlog.next_steps(self.run_directory.path))
        return summary

    def close(self) -> None:
        self.loader.close()
        if self.run_directory is not None:
            self.run_directory.release()


@fileio.exits_on_filesystem_errors("--run-dir")  # while parsing; once a run is built, its own handler below
def main(argv: list[str] | None = None, final: bool = True) -> dict:
    """Train as configured by `argv` (see --help); returns a summary dict (also the last line of log.jsonl).
    final=False ends without the final checkpoint and validation (bench.e2e)."""
    run_config = parse_config(argv)
    rt = process.setup_process(run_config.train)
    log = runlog.RunLog(rt.is_master)
    trainer = None
    try:
        trainer = Trainer(run_config, rt, log)
        if run_config.resume_from is not None:
            trainer.restore()
        trainer.open_run()
        with stop.StopRequest(rt.world) as stop_request:  # up to the final checkpoint: no signal costs it
            trainer.train(stop_request)
            summary = trainer.finish(final)
    except (directory.RunInUseError, checkpoint.CheckpointError, lookup.DataChangedError, shards.ShardError,
            attention_paths.AttentionChoiceError, OSError) as exc:  # bad input, refused before the first step (or a
        log.error(exc)  # shard read later), or the filesystem: the traceback in log.txt, one line here
        fileio.print_error(stop.error_line(exc, trainer and trainer.run_directory, bool(run_config.resume_from)))
        raise SystemExit(2) from None
    except BaseException as exc:
        if not isinstance(exc, stop.TrainingStopped):
            log.error(exc)
        elif rt.world > 1:
            dist.destroy_process_group()  # every rank stops here alike; see run.process.init_process_group
        raise
    finally:
        if trainer is not None:
            trainer.close()
        log.close()
    if rt.world > 1:
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
