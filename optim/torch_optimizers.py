"""AdamW and SGD with Nesterov momentum from torch.optim, with the paper's defaults (docs/optimizers.md#adamw-and-sgdm).

Each is a thin subclass whose constructor takes its config's fields (the registry's one build path) and clips the
gradient norm inside step() like the sharded optimizers (optim.registry.ClipsGradients).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cli import flag
from optim.registry import ClipsGradients, OptimizerConfig, OptimizerSpec


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
    initial_velocity_std: float = flag(0.1, "start the momentum buffer at N(0, std²) as the paper's SGDM runs do "
                                            "(0: at the first gradient, torch's SGD; "
                                            "docs/optimizers.md#adamw-and-sgdm)", bounds=">= 0",
                                       fixed_on_resume=True)
    optim_seed: int = flag(0, "seed of the initial velocity", bounds="[0, 4294967295]", fixed_on_resume=True)


def _implementation(params: list, fused: bool) -> dict:
    """fused=True on CUDA, foreach elsewhere (torch picks the fastest available kernel); fused=False: the plain
    per-tensor loop. params: parameter groups or tensors, as torch's optimizers take them."""
    if not fused:
        return {"foreach": False}
    first = params[0]["params"][0] if isinstance(params[0], dict) else params[0]
    return {"fused": True} if first.is_cuda else {"foreach": True}


class AdamW(ClipsGradients, torch.optim.AdamW):
    """torch.optim.AdamW taking AdamWConfig's fields."""

    moments_in_parameter_basis = True

    def __init__(self, params: list[dict], lr: float = AdamWConfig.lr, weight_decay: float = AdamWConfig.weight_decay,
                 beta1: float = AdamWConfig.beta1, beta2: float = AdamWConfig.beta2, eps: float = AdamWConfig.eps,
                 fused: bool = AdamWConfig.fused, grad_clip: float = 0.0) -> None:
        params = list(params)
        super().__init__(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                         **_implementation(params, fused))
        self.grad_clip = grad_clip


class SGDM(ClipsGradients, torch.optim.SGD):
    """torch.optim.SGD with (Nesterov) momentum taking SGDMConfig's fields. With initial_velocity_std > 0 every
    momentum buffer starts at N(0, std²), drawn on the CPU from (optim_seed, the parameter's index), so every rank
    and every device draws the same (docs/optimizers.md#adamw-and-sgdm); a resumed run loads the saved buffers."""

    moments_in_parameter_basis = True

    def __init__(self, params: list[dict], lr: float = SGDMConfig.lr, weight_decay: float = SGDMConfig.weight_decay,
                 momentum: float = SGDMConfig.momentum, nesterov: bool = SGDMConfig.nesterov,
                 initial_velocity_std: float = SGDMConfig.initial_velocity_std, optim_seed: int = SGDMConfig.optim_seed,
                 fused: bool = SGDMConfig.fused, grad_clip: float = 0.0) -> None:
        params = list(params)
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         **_implementation(params, fused))
        self.grad_clip = grad_clip
        if initial_velocity_std > 0 and momentum > 0:
            members = [p for group in self.param_groups for p in group["params"]]
            for index, p in enumerate(members):
                gen = torch.Generator().manual_seed(optim_seed * 1_000_003 + index)
                velocity = torch.randn(p.shape, generator=gen, dtype=torch.float32) * initial_velocity_std
                self.state[p]["momentum_buffer"] = velocity.to(p.device, p.dtype)


ADAMW_SPEC = OptimizerSpec(name="adamw", optimizer=AdamW, config=AdamWConfig,
                           description="torch AdamW (decoupled weight decay)")
SGDM_SPEC = OptimizerSpec(name="sgdm", optimizer=SGDM, config=SGDMConfig,
                          description="torch SGD with (Nesterov) momentum")
