"""The research tools that act around the trainer's optimizer step (docs/gauge.md, docs/evaluation.md): --gauge
post-processing, --dynamics-every and --gauge-diagnostic-every logging, switched on by variants.ResearchConfig.

Only train_gpt.py imports this module, so the gauge mathematics stays out of the configuration and out of every tool
that reads checkpoints. A new tool adds its field group to ResearchConfig and one branch to each method here it
needs. Importing this module has no side effects.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from gauge.dynamics import dynamics_summary, velocity_from_optimizer
from gauge.sensitivity import diagnostic_summary
from gauge.updates import GaugeUpdates
from optim.base import OptimizerInterface


class TrainingHooks:
    """What the research flags switch on around each optimizer step: `snapshot` before the step's forward pass,
    `after_step` after its update, `log` at a log step, and the state a checkpoint keeps (`state_dict`, by tool)."""

    def __init__(self, research, n_head: int, optimizer_name: str, optim_cfg) -> None:
        """research: variants.ResearchConfig; optimizer_name, optim_cfg: the run's --optimizer and its config (the
        gauge diagnostic steps a fresh one)."""
        self.n_head, self.optimizer_name, self.optim_cfg = n_head, optimizer_name, optim_cfg
        self.dynamics_every, self.diagnostic_every = research.dynamics_every, research.gauge_diagnostic_every
        self.gauge = None if research.gauge == "none" else GaugeUpdates(
            research.gauge, n_head, correction=research.gauge_correction, every=research.gauge_every,
            damping=research.gauge_damping, group=research.gauge_group, hyperball_lr=research.hyperball_lr,
            project_velocity=research.gauge_project_velocity)

    def snapshot(self, model: nn.Module) -> dict[str, Tensor] | None:
        """What `after_step` needs of the model before the step (--gauge: its attention parameters)."""
        return self.gauge.snapshot(model) if self.gauge else None

    def step_tools(self) -> list[str]:
        """The tools, as their flags, that rewrite the weights (some also the optimizer's state) after every step
        (--gauge; `snapshot` and `after_step` run on the host, outside the step a CUDA graph replays): run/capture.py
        keeps their runs out of graphs."""
        return [f"--gauge {self.gauge.mode}"] if self.gauge else []

    def after_step(self, model: nn.Module, optimizer: OptimizerInterface, before: dict[str, Tensor] | None,
                   step: int, lr_scale: float) -> None:
        """After the optimizer stepped to `step` (counted from 1): --gauge rewrites the step; before: `snapshot`'s;
        lr_scale: the schedule's factor."""
        if self.gauge:
            self.gauge.after_step(model, optimizer, before, step, lr_scale)

    def log(self, model: nn.Module, optimizer: OptimizerInterface, batch: tuple, step: int
            ) -> tuple[dict, list[str]]:
        """(fields for the log record, texts for the log line) at a log step; batch: the last micro-batch (x, y,
        biases). --dynamics-every: angular momentum and rotational fraction of the optimizer's velocity;
        --gauge-diagnostic-every: how much one fresh-optimizer step depends on the heads' gauge."""
        fields, texts = {}, []
        if self.dynamics_every and step % self.dynamics_every == 0:
            fields.update(dynamics_summary(model, velocity_from_optimizer(optimizer), self.n_head))
        if self.diagnostic_every and step % self.diagnostic_every == 0:
            x, y, _ = batch
            diagnostic = diagnostic_summary(model, self.optimizer_name, self.optim_cfg, x, y, step=step)
            fields.update(diagnostic)
            texts.append(f"gauge ΔM QK {diagnostic['gauge_dM_QK']:.3g} VO {diagnostic['gauge_dM_VO']:.3g}")
        return fields, texts

    def state_dict(self) -> dict:
        """What a checkpoint keeps, by tool (its "hooks" entry): --gauge hyperball's radii."""
        return {"gauge": self.gauge.state_dict()} if self.gauge else {}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        if self.gauge and "gauge" in state:
            self.gauge.load_state_dict(state["gauge"], device)
