"""The optimizer registry's types: hyperparameters, specs, parameter groups."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass
class OptimizerConfig:
    """Every optimizer hyperparameter; each field is a CLI flag (`--lr`, `--weight-decay`, ...).

    Fields left at None take the selected optimizer's default from SPEC §2 (`OptimizerSpec.defaults`).
    """

    optimizer: str = "adamw"  # registry name: see optim.OPTIMIZERS
    lr: float | None = None  # peak learning rate
    weight_decay: float | None = None  # applied to matrices; see the two flags below for the rest
    decay_embeddings: bool = False  # also decay wte/wpe (tied with lm_head)
    decay_norms_and_biases: bool = False  # also decay LayerNorm gains/biases, linear biases, PReLU slopes
    beta1: float | None = None  # AdamW: first-moment decay
    beta2: float | None = None  # AdamW: second-moment decay
    eps: float | None = None  # AdamW: denominator epsilon
    momentum: float | None = None  # SGDM: momentum coefficient
    nesterov: bool = True  # SGDM: Nesterov momentum
    fused: bool = True  # use torch's fused (CUDA) or foreach implementations where available
    optim_state_dtype: str = "fp32"  # ECD/SOAP/Muon: dtype of Π and the moments (fp32 | bf16)
    optim_seed: int = 0  # ECD: seed of the momentum noise
    ecd_eta: float | None = None  # ECD: η, concentration of the measure near low loss (position step lr/sqrt(η))
    ecd_f0: float | None = None  # ECD: F0, must stay below the training loss
    ecd_nu: float | None = None  # ECD: ν, chaos (momentum noise) strength
    ecd_energy_conservation: bool = True  # ECD: renormalise Π to unit norm every step
    ecd_projection: str = "global"  # ECD: Π·g over all parameters (global) or per tensor (published code)
    soap_precondition_frequency: int | None = None  # SOAP: steps between eigenbasis refreshes
    soap_max_precond_dim: int | None = None  # SOAP: dims larger than this get no rotation
    soap_merge_dims: bool = False  # SOAP: merge small dims before preconditioning
    soap_precondition_1d: bool = False  # SOAP: also rotate 1-D parameters
    soap_shampoo_beta: float | None = None  # SOAP: decay of the Kronecker factors (None: beta2)
    muon_lr: float | None = None  # Muon: learning rate of the hidden matrices (the rest uses --lr with AdamW)
    muon_momentum: float | None = None  # Muon: momentum coefficient
    muon_nesterov: bool = True  # Muon: Nesterov momentum
    muon_ns_steps: int | None = None  # Muon: Newton-Schulz iterations


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one registered optimizer.

    build(model, cfg) returns the list of optimizers that together own every trainable parameter exactly once;
    cfg has been resolved (no None left for the fields in `defaults`).
    needs_loss: step() takes the global-batch loss as a device tensor (ECD).
    reduces_gradients: under torchrun the optimizer averages gradients across ranks itself (owner-computes
    sharding), so the trainer must not wrap the model in DistributedDataParallel.
    """

    name: str
    build: Callable[[nn.Module, OptimizerConfig], list[torch.optim.Optimizer]]
    defaults: dict[str, float | int] = field(default_factory=dict)
    needs_loss: bool = False
    reduces_gradients: bool = False
    description: str = ""


def resolve_config(cfg: OptimizerConfig, spec: OptimizerSpec) -> OptimizerConfig:
    """Fill the None fields of `cfg` from the spec's SPEC §2 defaults."""
    filled = {k: v for k, v in spec.defaults.items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **filled)


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
    weight_decay = cfg.weight_decay or 0.0
    groups = [
        {"params": [p for _, p in decay], "names": [n for n, _ in decay], "weight_decay": weight_decay},
        {"params": [p for _, p in no_decay], "names": [n for n, _ in no_decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def state_dtype(cfg: OptimizerConfig) -> torch.dtype:
    """--optim-state-dtype as a torch dtype: fp32 | bf16 (ECD's Π, SOAP's and Adam's moments)."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if cfg.optim_state_dtype not in dtypes:
        raise ValueError(f"--optim-state-dtype must be one of {sorted(dtypes)}, got {cfg.optim_state_dtype!r}")
    return dtypes[cfg.optim_state_dtype]


def optimizer_state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes held in optimizer state tensors on this rank (for the log's bytes-per-parameter figure)."""
    total = 0
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
    return total
