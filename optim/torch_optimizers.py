"""AdamW and SGD with Nesterov momentum from torch.optim, with the docs/model.md#the-papers-model (Table 9) defaults."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cli import flag
from optim.registry import OptimizerConfig, OptimizerSpec, parameter_groups


@dataclass
class TorchOptimizerConfig(OptimizerConfig):
    fused: bool = flag(True, "torch's fused (CUDA) or foreach implementation")


@dataclass
class AdamWConfig(TorchOptimizerConfig):
    lr: float = flag(1e-4, "peak learning rate", bounds="> 0")
    weight_decay: float = flag(0.0, "decoupled weight decay of the decayed parameters (--decay-groups)",
                                bounds=">= 0")
    beta1: float = flag(0.9, "first-moment decay", bounds="[0, 1)")
    beta2: float = flag(0.999, "second-moment decay", bounds="[0, 1)")
    eps: float = flag(1e-8, "denominator epsilon", bounds=">= 0")


@dataclass
class SGDMConfig(TorchOptimizerConfig):
    lr: float = flag(0.03, "peak learning rate", bounds="> 0")
    weight_decay: float = flag(0.0, "L2 weight decay of the decayed parameters (--decay-groups)",
                                bounds=">= 0")
    momentum: float = flag(0.95, "momentum coefficient", bounds="[0, 1)")
    nesterov: bool = flag(True, "Nesterov momentum")


def _implementation_flags(model: nn.Module, cfg: TorchOptimizerConfig) -> dict:
    """fused=True on CUDA, foreach elsewhere (torch picks the fastest available kernel)."""
    if not cfg.fused:
        return {"foreach": False}
    return {"fused": True} if next(model.parameters()).is_cuda else {"foreach": True}


def build_adamw(model: nn.Module, cfg: AdamWConfig) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(parameter_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                              **_implementation_flags(model, cfg))]


def build_sgdm(model: nn.Module, cfg: SGDMConfig) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(parameter_groups(model, cfg), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                            **_implementation_flags(model, cfg))]


ADAMW = OptimizerSpec(
    name="adamw",
    config=AdamWConfig,
    build=build_adamw,
    description="torch AdamW (decoupled weight decay)",
)

SGDM = OptimizerSpec(
    name="sgdm",
    config=SGDMConfig,
    build=build_sgdm,
    description="torch SGD with (Nesterov) momentum",
)
