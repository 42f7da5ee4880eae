"""The contract between an optimizer and the trainer and tools (docs/optimizers.md#adding-an-optimizer), and what
the optimizers' implementations share: argument checks from the flags' metadata, Adam's bias corrections, seeds."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping

import torch
from torch import Tensor

from cli import option, value_problem


class OptimizerInterface:
    """Mixed into every optimizer of the registry before its torch.optim.Optimizer base: what the trainer and the
    tools ask of an optimizer beyond torch's, each with a default, so that a new optimizer's author writes its
    constructor and `step()` and nothing here (docs/optimizers.md#adding-an-optimizer). By concern:

    - the trainer's step in three parts, `stage_step` (host), `device_step` (device only), `finish_step` (host): by
      default `device_step` clips the gradient norm to `grad_clip` and calls `step()`, the others do nothing;
    - opt-in, CUDA-graph capture (docs/optimizers.md#steps-that-a-cuda-graph-replays): refused, with the reason in
      one line, until `capture_problem` returns None (with `prepare_capture` and `steady_step`);
    - opt-in, the gauge tools (docs/optimizers.md#what-the-gauge-tools-read), tensors by parameter name in the
      parameters' coordinates: `first_moment_of` (none by default), `has_velocity` with `saved_velocity` (none);
    - opt-in, the grid's memory estimate: `first_step_state_bytes`, the state the first step creates (default 0).

    Calls run one way: the trainer's parts call the update (`step()`; a sharded optimizer's `update`), never back.
    """

    grad_clip: float = 0.0  # the trainer's --grad-clip (OptimizerSpec.build): the global gradient norm's bound, 0: off
    grad_norm: Tensor | None = None  # the norm before clipping (a device tensor), once a step has clipped
    has_velocity: bool = False  # whether the state defines a direction of motion: then velocity() and
    #                             saved_velocity() return it (--dynamics-every and eval.dynamics read it)

    # -- the trainer's step ---------------------------------------------------------------------------------------

    def stage_step(self) -> None:
        """The host's part before a step, outside any graph: write the step's scalars that change from step to step
        (learning rates, bias corrections) into the device buffers `device_step` reads. Default: nothing."""

    def device_step(self, loss: Tensor | None = None) -> None:
        """The step's device work, what a CUDA graph captures. Default: clip the global gradient norm to `grad_clip`
        (keeping the norm before in `grad_norm`), then `step()`, or `step(loss)` when the trainer passes `loss`, the
        global-batch loss as a device tensor: only to an optimizer whose spec says needs_loss."""
        if self.grad_clip > 0:
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip, foreach=True)
        self.step() if loss is None else self.step(loss)

    def finish_step(self) -> None:
        """The host's part after a step's device work is issued: counts and flags kept on the host. Default:
        nothing."""

    # -- CUDA-graph capture (opt-in) ------------------------------------------------------------------------------

    def capture_problem(self) -> str | None:
        """Why `device_step` cannot be replayed from a CUDA graph as configured (one line); None when it can.
        Default: a reason, since a graph fixes what a plain step reads on the host (a float learning rate, a step
        count) at its values when captured; an optimizer opts in by overriding this."""
        return (f"{type(self).__name__} does not declare its step replayable (an optimizer opts in through "
                "capture_problem: docs/optimizers.md#steps-that-a-cuda-graph-replays)")

    def prepare_capture(self) -> None:
        """Before the first capture: what a graph needs beyond `stage_step` (device copies of the hyperparameters
        that change between steps)."""

    def steady_step(self) -> bool:
        """Whether the next step does the same device work as the one before it, so that one captured graph
        replays it (False for a step that creates state or, as SOAP's basis refresh, runs other kernels)."""
        return True

    # -- the gauge tools (opt-in) ---------------------------------------------------------------------------------

    def first_moment_of(self, index: int) -> tuple[str, bool] | None:
        """(state key of parameter `index`'s first moment, whether the step moves along it), or None (SOAP's)."""
        return None

    def first_moments(self, steering_only: bool = False) -> dict[str, Tensor]:
        """The state that moves like the parameters' increments, by parameter name; steering_only: the part the step
        moves along (a momentum, not Adam's m). Read-only; sharded optimizers gather it (a collective)."""
        names, params = parameter_names(self.param_groups), [p for g in self.param_groups for p in g["params"]]
        held = {names[i]: self.state.get(params[i], {}).get(key) for i, key in moment_keys(self, steering_only).items()}
        return {name: value for name, value in held.items() if torch.is_tensor(value)}

    def set_first_moments(self, moments: Mapping[str, Tensor]) -> None:
        """Replace first moments by parameter name, with tensors shaped as `first_moments` returned them."""
        params = [p for g in self.param_groups for p in g["params"]]
        for name, value in moments.items():
            index, key = moment_key(self, name)
            self.state[params[index]][key].copy_(value)

    def velocity(self) -> dict[str, Tensor]:
        """The direction of motion by parameter name (any positive scale); for optimizers with has_velocity."""
        return self.saved_velocity(self.state_dict())

    @classmethod
    def saved_velocity(cls, state_dict: Mapping) -> dict[str, Tensor]:
        """`velocity` of a state dict in torch's layout whose groups carry "names" (a checkpoint's); an optimizer
        that sets has_velocity implements it."""
        raise NotImplementedError(f"{cls.__name__} defines no velocity (has_velocity is False)")

    # -- the grid's memory estimate (opt-in) ----------------------------------------------------------------------

    def first_step_state_bytes(self) -> int:
        """Bytes of state that the first step will allocate (torch's optimizers create theirs then, SOAP its
        Kronecker factors), 0 once it has run: with the state held now, what a memory estimate counts. Default: 0,
        right for an optimizer that creates its state in its constructor."""
        return 0


def moment_keys(optimizer: OptimizerInterface, steering_only: bool = False) -> dict[int, str]:
    """{parameter index: state key} of the first moments that `first_moments` returns."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    moments = {i: moment for i in range(count) if (moment := optimizer.first_moment_of(i))}
    return {i: key for i, (key, steers) in moments.items() if steers or not steering_only}


def moment_key(optimizer: OptimizerInterface, name: str) -> tuple[int, str]:
    """(index, state key) of parameter `name`'s first moment; ValueError where it has none."""
    index, keys = parameter_names(optimizer.param_groups).index(name), moment_keys(optimizer)
    if index not in keys:
        raise ValueError(f"{type(optimizer).__name__} keeps no first moment of {name} in the parameters' coordinates")
    return index, keys[index]


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
