"""The optimizer registry's types: each optimizer's config (its hyperparameters with their defaults), specs,
parameter groups."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from cli import flag


# Which parameters weight decay acts on (docs/optimizers.md#weight-decay-groups). "Matrices" are the weights of
# linear layers; "embeddings" the token and position tables (the token table is tied with lm_head); the rest are
# LayerNorm gains and biases, linear biases, PReLU slopes and learned attention biases.
DECAY_GROUPS = ("all", "matrices", "matrices+embeddings", "all-but-embeddings")


@dataclass
class OptimizerConfig:
    """What every optimizer takes. Each optimizer's config subclass adds its own hyperparameters and sets the
    defaults of `lr`, `weight_decay` and `decay_groups` (the paper's, docs/optimizers.md); every field is a
    command-line flag."""

    lr: float
    weight_decay: float
    decay_groups: str = flag("all", "parameters that weight decay acts on: all (the paper's optimizers), matrices "
                             "(nanoGPT's convention), matrices+embeddings or all-but-embeddings "
                             "(docs/optimizers.md#weight-decay-groups)", choices=DECAY_GROUPS, fixed_on_resume=True)


@dataclass
class ShardedOptimizerConfig(OptimizerConfig):
    """Optimizers with owner-computes sharding over flat buffers (`optim.distributed`)."""

    optim_state_dtype: str = flag("fp32", "dtype of the optimizer state (ECD's Π, the moments); fp32 keeps wider "
                                          "(float64) parameters' own dtype", choices=("fp32", "bf16"))


EMBEDDING_PREFIXES = ("transformer.wte", "transformer.wpe")  # token and position tables (nanoGPT names)


def decays(name: str, param: Tensor, decay_groups: str) -> bool:
    """Whether parameter `name` belongs to the decayed group of --decay-groups `decay_groups`."""
    is_embedding = name.startswith(EMBEDDING_PREFIXES)
    is_attention_bias = name.endswith((".attn.b_q", ".attn.b_v"))  # learned mode, (d,) or (H, d)
    is_matrix = param.dim() >= 2 and not is_embedding and not is_attention_bias
    members = {"all": True, "matrices": is_matrix, "matrices+embeddings": is_matrix or is_embedding,
               "all-but-embeddings": not is_embedding}
    if decay_groups not in members:
        raise ValueError(f"--decay-groups must be one of {DECAY_GROUPS}, got {decay_groups!r}")
    return members[decay_groups]


def parameter_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """Split trainable parameters into a decayed group (weight_decay = cfg.weight_decay) and a non-decayed one,
    as --decay-groups says (docs/optimizers.md#weight-decay-groups); empty groups are left out.

    Each group carries the parameter names (key "names") for optimizers that treat tensors by role.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if decays(name, param, cfg.decay_groups) else no_decay).append((name, param))
    groups = [
        {"params": [p for _, p in decay], "names": [n for n, _ in decay], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in no_decay], "names": [n for n, _ in no_decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def state_dtype(optim_state_dtype: str, params: Iterable[Tensor]) -> torch.dtype:
    """--optim-state-dtype as a torch dtype: bf16, or fp32 (the parameters' dtype where it is wider, e.g. float64:
    the state of the published optimizers has the parameters' dtype)."""
    if optim_state_dtype == "bf16":
        return torch.bfloat16
    dtypes = [p.dtype for p in params if p.dtype.is_floating_point]
    return functools.reduce(torch.promote_types, dtypes, torch.float32)


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one registered optimizer: `build(model, cfg)` is the one build path.

    optimizer: the class, a torch.optim.Optimizer with `optim.base.OptimizerInterface` mixed in (what the trainer and
    the tools ask of it), whose constructor takes the parameter groups and, as keyword arguments, the fields of its
    config (their names and defaults are the config's: no third spelling) except decay_groups, which `groups` uses.
    groups(model, cfg): the parameter groups (parameter_groups, or a split of them such as Muon's).
    needs_loss: step(loss) takes the global-batch loss as a device tensor (ECD); the trainer passes it to
    device_step only then.
    reduces_gradients: under torchrun the optimizer averages gradients across ranks itself (owner-computes
    sharding, `optim.distributed.ShardedOptimizer`), so the trainer must not wrap the model in
    DistributedDataParallel, and the backward passes of accumulation micro-steps run under its no_sync().
    """

    name: str
    optimizer: type
    config: type
    groups: Callable[[nn.Module, OptimizerConfig], list[dict]] = parameter_groups
    needs_loss: bool = False
    reduces_gradients: bool = False
    description: str = ""

    def build(self, model: nn.Module, cfg: OptimizerConfig, grad_clip: float | None = None,
              overlap_reduce: bool | None = None) -> torch.optim.Optimizer:
        """The optimizer that owns every trainable parameter of `model` exactly once (checked).
        grad_clip: clip the global gradient norm to this value in device_step (0: off); overlap_reduce: sharded
        optimizers average gradients while the backward pass runs (the trainer's flags of the same names; None
        keeps the optimizer's own default)."""
        settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "decay_groups"}
        optimizer = self.optimizer(self.groups(model, cfg), **settings)
        if grad_clip is not None:
            optimizer.grad_clip = grad_clip
        if overlap_reduce is not None and self.reduces_gradients:
            optimizer.overlap_reduce = overlap_reduce
        check_ownership(model, optimizer)
        return optimizer


def check_ownership(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every trainable parameter of `model` is owned by exactly one optimizer group (train_gpt_simple's check)."""
    owned = [id(p) for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    missing = [name for key, name in names.items() if key not in owned]
    repeated = sorted({names.get(key, "?") for key in owned if owned.count(key) > 1})
    if missing or repeated or len(owned) != len(names):
        raise RuntimeError(f"optimizer build: every trainable parameter must be owned exactly once; not owned: "
                           f"{missing}, owned twice: {repeated}")


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Every tensor held in the optimizer's state on this rank."""
    for state in optimizer.state.values():
        yield from (value for value in state.values() if torch.is_tensor(value))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in optimizer state tensors on this rank (for the log's bytes-per-parameter figure)."""
    return sum(t.numel() * t.element_size() for t in optimizer_state_tensors(optimizer))
