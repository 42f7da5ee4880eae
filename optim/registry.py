"""The optimizer registry's types: each optimizer's config (its hyperparameters with their defaults), specs,
parameter groups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from cli import flag


@dataclass
class OptimizerConfig:
    """What every optimizer takes. Each optimizer's config subclass adds its own hyperparameters and sets the
    defaults of `lr` and `weight_decay` (SPEC §2, Table 9 of the paper); every field is a command-line flag."""

    lr: float
    weight_decay: float
    decay_embeddings: bool = flag(False, "also decay wte/wpe (tied with lm_head)")
    decay_norms_and_biases: bool = flag(
        False, "also decay LayerNorm gains/biases, linear biases, PReLU slopes and learned attention biases")


@dataclass
class ShardedOptimizerConfig(OptimizerConfig):
    """Optimizers with owner-computes sharding over flat buffers (`optim.distributed`)."""

    optim_state_dtype: str = flag("fp32", "dtype of the optimizer state (ECD's Π, the moments)",
                                  choices=("fp32", "bf16"))


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one registered optimizer.

    config: its config dataclass (hyperparameters and defaults); build(model, cfg) returns the list of optimizers
    that together own every trainable parameter exactly once.
    needs_loss: step() takes the global-batch loss as a device tensor (ECD).
    reduces_gradients: under torchrun the optimizer averages gradients across ranks itself (owner-computes
    sharding, `optim.distributed.ShardedOptimizer`), so the trainer must not wrap the model in
    DistributedDataParallel.
    """

    name: str
    config: type
    build: Callable[[nn.Module, OptimizerConfig], list[torch.optim.Optimizer]]
    needs_loss: bool = False
    reduces_gradients: bool = False
    description: str = ""


EMBEDDING_PREFIXES = ("transformer.wte", "transformer.wpe")  # token and position tables (nanoGPT names)


def parameter_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """Split trainable parameters into decayed and non-decayed groups.

    Matrices of linear layers decay; embeddings decay only with `decay_embeddings`; LayerNorm parameters,
    linear biases, PReLU slopes and learned attention biases decay only with `decay_norms_and_biases`.
    Each group carries the parameter names (key "names") for optimizers that treat tensors by role.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_embedding = name.startswith(EMBEDDING_PREFIXES)
        is_attention_bias = name.endswith((".attn.b_q", ".attn.b_v"))  # learned mode, (d,) or (H, d)
        is_matrix = param.dim() >= 2 and not is_embedding and not is_attention_bias
        if is_matrix or (is_embedding and cfg.decay_embeddings) or (not is_embedding and cfg.decay_norms_and_biases):
            decay.append((name, param))
        else:
            no_decay.append((name, param))
    groups = [
        {"params": [p for _, p in decay], "names": [n for n, _ in decay], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in no_decay], "names": [n for n, _ in no_decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def state_dtype(cfg: ShardedOptimizerConfig) -> torch.dtype:
    """--optim-state-dtype as a torch dtype: fp32 | bf16."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if cfg.optim_state_dtype not in dtypes:
        raise ValueError(f"--optim-state-dtype must be one of {sorted(dtypes)}, got {cfg.optim_state_dtype!r}")
    return dtypes[cfg.optim_state_dtype]


def optimizer_state_tensors(optimizers: list[torch.optim.Optimizer]) -> Iterator[Tensor]:
    """Every tensor held in the optimizers' state on this rank."""
    for opt in optimizers:
        for state in opt.state.values():
            yield from (value for value in state.values() if torch.is_tensor(value))


def optimizer_state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes held in optimizer state tensors on this rank (for the log's bytes-per-parameter figure)."""
    return sum(t.numel() * t.element_size() for t in optimizer_state_tensors(optimizers))
