"""AdamW and SGD with Nesterov momentum from torch.optim, with the SPEC §2 (Table 9) defaults."""
from __future__ import annotations

import torch
from torch import nn

from optim.registry import OptimizerConfig, OptimizerSpec, parameter_groups


def _implementation_flags(model: nn.Module, cfg: OptimizerConfig) -> dict:
    """fused=True on CUDA, foreach elsewhere (torch picks the fastest available kernel)."""
    on_cuda = next(model.parameters()).is_cuda
    if not cfg.fused:
        return {"foreach": False}
    return {"fused": True} if on_cuda else {"foreach": True}


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> list[torch.optim.Optimizer]:
    groups = parameter_groups(model, cfg)
    return [
        torch.optim.AdamW(
            groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **_implementation_flags(model, cfg)
        )
    ]


def build_sgdm(model: nn.Module, cfg: OptimizerConfig) -> list[torch.optim.Optimizer]:
    groups = parameter_groups(model, cfg)
    return [
        torch.optim.SGD(
            groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **_implementation_flags(model, cfg)
        )
    ]


ADAMW = OptimizerSpec(
    name="adamw",
    build=build_adamw,
    defaults={"lr": 1e-4, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    description="torch AdamW (decoupled weight decay); SPEC §2 defaults lr 1e-4, betas (0.9, 0.999), wd 0",
)

SGDM = OptimizerSpec(
    name="sgdm",
    build=build_sgdm,
    defaults={"lr": 0.03, "weight_decay": 0.0, "momentum": 0.95},
    description="torch SGD with Nesterov momentum; SPEC §2 defaults lr 0.03, momentum 0.95",
)
