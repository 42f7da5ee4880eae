"""AdamW and SGD with Nesterov momentum from torch.optim, with the paper's defaults (docs/optimizers.md#adamw-and-sgdm).

Each is a thin subclass whose constructor takes its config's fields (the registry's one build path); `TorchOptimizer`
opts them in to CUDA-graph capture.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor

from cli import flag
from optim.base import OptimizerInterface, adam_scale, check_arguments, mixed_seed, per_parameter
from optim.registry import OptimizerConfig, OptimizerSpec


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
    optim_seed: int = flag(-1, "seed of the initial velocity; -1: the run's --seed, so each seed draws its own (as "
                               "the published script does)", bounds="[-1, 4294967295]", affects_results=False,
                           fixed_on_resume=True)


def _implementation(params: list, fused: bool) -> dict:
    """fused=True on CUDA, foreach elsewhere (torch picks the fastest available kernel); fused=False: the plain
    per-tensor loop. params: parameter groups or tensors, as torch's optimizers take them."""
    if not fused:
        return {"foreach": False}
    first = params[0]["params"][0] if isinstance(params[0], dict) else params[0]
    return {"fused": True} if first.is_cuda else {"foreach": True}


class TorchOptimizer(OptimizerInterface):
    """For torch.optim subclasses, whose step() is torch's: they opt in to CUDA-graph capture. Captured, the step runs
    torch's capturable path with each group's learning rate read from a device tensor that `stage_step` fills; the
    groups keep floats for everything else."""

    graph_lrs: list[Tensor] | None = None  # after prepare_capture on CUDA: each group's learning rate on the device

    def _on_cuda(self) -> bool:
        return self.param_groups[0]["params"][0].is_cuda

    def capture_problem(self) -> str | None:
        if isinstance(self, torch.optim.SGD) and self._on_cuda() and not self.param_groups[0]["fused"]:
            return "SGD's unfused step reads a tensor learning rate on the host; use its fused step (--fused)"
        return None

    def prepare_capture(self) -> None:
        """On CUDA: torch's capturable step (its step counts on the device) and a device learning rate per group."""
        if not self._on_cuda():
            return
        for group in self.param_groups:
            group["capturable"] = True
            for p in group["params"]:
                state = self.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(p.device)
        self.graph_lrs = [torch.tensor(float(group["lr"]), device=self.param_groups[0]["params"][0].device)
                          for group in self.param_groups]

    def steady_step(self) -> bool:
        """After the first step, which creates the state."""
        return all(self.state.get(p) for group in self.param_groups for p in group["params"])

    def stage_step(self) -> None:
        for lr, group in zip(self.graph_lrs or (), self.param_groups):
            lr.fill_(group["lr"])

    def device_step(self, loss: Tensor | None = None) -> None:
        """The interface's (the gradient clipped, then torch's step), with each group's learning rate read from its
        device tensor once capture is prepared."""
        if self.graph_lrs is None:
            super().device_step(loss)
            return
        floats = [group["lr"] for group in self.param_groups]
        for group, lr in zip(self.param_groups, self.graph_lrs):
            group["lr"] = lr
        try:
            super().device_step(loss)
        finally:
            for group, lr in zip(self.param_groups, floats):
                group["lr"] = lr


class AdamW(TorchOptimizer, torch.optim.AdamW):
    """torch.optim.AdamW taking AdamWConfig's fields."""

    has_velocity = True

    def __init__(self, params: list[dict], lr: float = AdamWConfig.lr, weight_decay: float = AdamWConfig.weight_decay,
                 beta1: float = AdamWConfig.beta1, beta2: float = AdamWConfig.beta2, eps: float = AdamWConfig.eps,
                 fused: bool = AdamWConfig.fused) -> None:
        check_arguments(AdamWConfig, locals())
        params = list(params)
        super().__init__(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                         **_implementation(params, fused))

    def first_moment_of(self, index: int) -> tuple[str, bool]:
        return "exp_avg", False  # the step divides it by √v

    def first_step_state_bytes(self) -> int:
        """m, v and the step count of every parameter without state yet."""
        return sum(2 * p.numel() * p.element_size() + 4 for g in self.param_groups for p in g["params"]
                   if not self.state[p])

    @classmethod
    def saved_velocity(cls, state_dict: Mapping) -> dict[str, Tensor]:
        """The bias-corrected update direction −m̂/(√v̂ + ε), without the decoupled weight decay."""
        def direction(state: Mapping, group: Mapping) -> Tensor | None:
            if "exp_avg" not in state:
                return None
            scale, eps = adam_scale(*group["betas"], group["eps"], state["step"])
            return -scale * state["exp_avg"] / (state["exp_avg_sq"].sqrt() + eps)
        return per_parameter(state_dict, direction)


class SGDM(TorchOptimizer, torch.optim.SGD):
    """torch.optim.SGD with (Nesterov) momentum taking SGDMConfig's fields. With initial_velocity_std > 0 every
    momentum buffer starts at N(0, std²), drawn on the CPU from (optim_seed, the parameter's index), so every rank
    and every device draws the same (docs/optimizers.md#adamw-and-sgdm); a resumed run loads the saved buffers. The
    trainer's configuration replaces an optim_seed of -1 by the run's seed (config.parse_run_config)."""

    has_velocity = True

    def __init__(self, params: list[dict], lr: float = SGDMConfig.lr, weight_decay: float = SGDMConfig.weight_decay,
                 momentum: float = SGDMConfig.momentum, nesterov: bool = SGDMConfig.nesterov,
                 initial_velocity_std: float = SGDMConfig.initial_velocity_std, optim_seed: int = SGDMConfig.optim_seed,
                 fused: bool = SGDMConfig.fused) -> None:
        check_arguments(SGDMConfig, locals())
        params = list(params)
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         **_implementation(params, fused))
        if initial_velocity_std > 0 and momentum > 0:
            members = [p for group in self.param_groups for p in group["params"]]
            for index, p in enumerate(members):
                if p.is_meta:  # a memory estimate (grid/memory.py): the buffer, not its numbers
                    self.state[p]["momentum_buffer"] = torch.empty_like(p)
                    continue
                gen = torch.Generator().manual_seed(mixed_seed(optim_seed, index))
                velocity = torch.randn(p.shape, generator=gen, dtype=torch.float32) * initial_velocity_std
                self.state[p]["momentum_buffer"] = velocity.to(p.device, p.dtype)

    def first_moment_of(self, index: int) -> tuple[str, bool]:
        return "momentum_buffer", True

    def first_step_state_bytes(self) -> int:
        """The momentum buffer of every parameter without one yet."""
        return sum(p.numel() * p.element_size() for g in self.param_groups for p in g["params"]
                   if g["momentum"] and "momentum_buffer" not in self.state[p])

    @classmethod
    def saved_velocity(cls, state_dict: Mapping) -> dict[str, Tensor]:
        """−(momentum buffer): θ ← θ − lr·buffer (Nesterov adds the gradient, which is not stored)."""
        return per_parameter(state_dict, lambda state, group: -state["momentum_buffer"] if "momentum_buffer" in state
                             else None)


ADAMW_SPEC = OptimizerSpec(name="adamw", optimizer=AdamW, config=AdamWConfig,
                           description="torch AdamW (decoupled weight decay)")
SGDM_SPEC = OptimizerSpec(name="sgdm", optimizer=SGDM, config=SGDMConfig,
                          description="torch SGD with (Nesterov) momentum")
