"""What every optimizer of the registry implements beyond torch.optim.Optimizer (docs/optimizers.md#adding-an-
optimizer), and what their implementations share: argument checks from the flags' metadata, Adam's bias
corrections, seeds."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping

import torch
from torch import Tensor

from cli import option, value_problem


class OptimizerInterface:
    """Mixed into every optimizer of the registry before its torch.optim.Optimizer base: what the gauge tools read
    and move, tensors by parameter name in the parameters' coordinates (docs/optimizers.md#what-an-optimizer-
    implements). step() clips the global gradient norm to grad_clip (0: off) and keeps the norm before in grad_norm.
    The trainer runs a step in three parts, so that a CUDA graph can replay the middle one (run/capture.py,
    docs/optimizers.md#steps-that-a-cuda-graph-replays): `stage_step` (host), `device_step` (device only),
    `finish_step` (host); step() is the three in a row.
    """

    grad_clip: float = 0.0
    grad_norm: Tensor | None = None
    has_velocity: bool = False  # whether its state defines a direction of motion: then velocity() and
    #                             saved_velocity() return it (--dynamics-every and eval.dynamics read it)

    def capture_problem(self) -> str | None:
        """Why `device_step` cannot be replayed from a CUDA graph as configured (one line); None when it can."""
        return None

    def prepare_capture(self) -> None:
        """Before the first capture: what a graph needs beyond `stage_step` (device copies of the hyperparameters
        that change between steps)."""

    def steady_step(self) -> bool:
        """Whether the next step does the same device work as the one before it, so that one captured graph
        replays it (False for a step that creates state or, as SOAP's basis refresh, runs other kernels)."""
        return True

    def stage_step(self) -> None:
        """The host's part before a step, outside any graph: write the step's scalars that change from step to step
        (learning rates, bias corrections) into the device buffers `device_step` reads."""

    def device_step(self, loss: Tensor | None = None) -> None:
        """The step's device work, with no host read of a device value and no wait: what a CUDA graph captures.
        `loss`: the global-batch loss as a device tensor (read by optimizers whose spec says needs_loss)."""
        raise NotImplementedError

    def finish_step(self) -> None:
        """The host's part after a step's device work is issued: counts and flags kept on the host."""

    def first_step_state_bytes(self) -> int:
        """Bytes of state that the first step will allocate (torch's optimizers create theirs then, SOAP its
        Kronecker factors), 0 once it has run: with the state held now, what a memory estimate counts."""
        return 0

    def first_moment_of(self, index: int) -> tuple[str, bool] | None:
        """(state key of parameter `index`'s first moment, whether the step moves along it), or None (SOAP's)."""
        return None

    def first_moments(self, steering_only: bool = False) -> dict[str, Tensor]:
        """The state that moves like the parameters' increments, by parameter name; steering_only: the part the step
        moves along (a momentum, not Adam's m). Read-only; sharded optimizers gather it (a collective)."""
        names, params = parameter_names(self.param_groups), [p for g in self.param_groups for p in g["params"]]
        held = {names[i]: self.state.get(params[i], {}).get(key) for i, key in self.moment_keys(steering_only).items()}
        return {name: value for name, value in held.items() if torch.is_tensor(value)}

    def set_first_moments(self, moments: Mapping[str, Tensor]) -> None:
        """Replace first moments by parameter name, with tensors shaped as `first_moments` returned them."""
        params = [p for g in self.param_groups for p in g["params"]]
        for name, value in moments.items():
            index, key = self.moment_key(name)
            self.state[params[index]][key].copy_(value)

    def moment_keys(self, steering_only: bool = False) -> dict[int, str]:
        """{parameter index: state key} of the first moments that `first_moments` returns."""
        count = sum(len(group["params"]) for group in self.param_groups)
        moments = {i: moment for i in range(count) if (moment := self.first_moment_of(i))}
        return {i: key for i, (key, steers) in moments.items() if steers or not steering_only}

    def moment_key(self, name: str) -> tuple[int, str]:
        """(index, state key) of parameter `name`'s first moment; ValueError where it has none."""
        index, keys = parameter_names(self.param_groups).index(name), self.moment_keys()
        if index not in keys:
            raise ValueError(f"{type(self).__name__} keeps no first moment of {name} in the parameters' coordinates")
        return index, keys[index]

    def velocity(self) -> dict[str, Tensor]:
        """The direction of motion by parameter name (any positive scale); for optimizers with has_velocity."""
        return self.saved_velocity(self.state_dict())

    @classmethod
    def saved_velocity(cls, state_dict: Mapping) -> dict[str, Tensor]:
        """`velocity` of a state dict in torch's layout whose groups carry "names" (a checkpoint's); an optimizer
        that sets has_velocity implements it."""
        raise NotImplementedError(f"{cls.__name__} defines no velocity (has_velocity is False)")


def parameter_names(param_groups: list[dict]) -> list[str]:
    """Each parameter's name in group order: the groups' "names" (`parameter_groups` sets them), else param<i>."""
    names: list[str] = []
    for group in param_groups:
        names += group.get("names") or [f"param{len(names) + k}" for k in range(len(group["params"]))]
    return names


def per_parameter(state_dict: Mapping, direction: Callable[[Mapping, Mapping], Tensor | None]) -> dict[str, Tensor]:
    """{name: direction(state, group)} over a state dict whose groups carry "names" (None: left out)."""
    out = {}
    for group in state_dict["param_groups"]:
        if "names" not in group:
            raise ValueError("optimizer param groups carry no 'names'; build the optimizer from optim.parameter_groups")
        for index, name in zip(group["params"], group["names"]):
            value = direction(state_dict["state"].get(index, {}), group)
            if value is not None:
                out[name] = value
    return out


def check_arguments(config: type, values: Mapping[str, object]) -> None:
    """A constructor's check: ValueError for the first of `values` outside its flag's declared range or choices, in
    the command line's words (cli.value_problem)."""
    for field in dataclasses.fields(config):
        if field.name not in values:
            continue
        value, choices = values[field.name], field.metadata.get("choices")
        problem = value_problem(field.name, value, field.metadata.get("bounds"))
        if problem is None and choices and value not in choices:
            problem = f"{option(field.name)} must be one of {', '.join(choices)}, got {value!r}"
        if problem:
            raise ValueError(f"{config.__name__.removesuffix('Config')}: {problem}")


def adam_scale(beta1: float, beta2: float, eps: float, step) -> tuple[object, object]:
    """torch AdamW's bias corrections folded into the step and ε: m̂/(√v̂ + ε) = s·m/(√v + ε′) with
    s = c/(1 − β1ᵗ), ε′ = c·ε, c = √(1 − β2ᵗ). `step` may be a device tensor (no host sync)."""
    c = (1 - beta2**step) ** 0.5
    return c / (1 - beta1**step), c * eps


def mixed_seed(*parts: int, bits: int = 63) -> int:
    """One seed of a random stream from (seed, step, stream, ...): ((p0·P + p1)·P + p2)… mod 2^bits, P = 1,000,003."""
    return functools.reduce(lambda acc, part: acc * 1_000_003 + part, parts) % (1 << bits)
