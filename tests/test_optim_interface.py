"""What every registered optimizer gives the gauge tools (optim.base.OptimizerInterface; docs/optimizers.md#what-the-
gauge-tools-read): first moments, their steering subset, writing them back, the velocity live and from a state dict;
and the constructors' argument checks, derived from the flags' metadata so that they cannot drift from the flags."""
from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from cli import _parse_bounds, field_problem, value_problem
from optim import OPTIMIZERS
from optim.base import OptimizerInterface
from optim.muon import is_hidden_matrix
from tests.helpers import tiny_gpt
from train_gpt import GPT

# Where each optimizer keeps a parameter's first moment in its state dict, and whether the step moves along it.
FIRST_MOMENT = {"ecd": lambda name, p: ("pi", True), "sgdm": lambda name, p: ("momentum_buffer", True),
                "adamw": lambda name, p: ("exp_avg", False), "soap": lambda name, p: None,
                "muon": lambda name, p: ("momentum_buffer", True) if is_hidden_matrix(name, p) else ("exp_avg", False)}
ATTENTION = "transformer.h.0.attn.c_attn.weight"


def trained(name: str, steps: int = 2) -> tuple[GPT, torch.optim.Optimizer]:
    model = tiny_gpt(0, block_size=16, n_layer=1, n_embd=16, bias_mode="bqbv").double()
    spec = OPTIMIZERS[name]
    opt = spec.build(model, spec.config())
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        loss = model(idx, idx)[1]
        loss.backward()
        opt.step(loss.detach()) if spec.needs_loss else opt.step()
        opt.zero_grad()
    return model, opt


def saved_state(opt: torch.optim.Optimizer) -> dict[str, dict]:
    """Each parameter's state in the optimizer's state dict, by name."""
    saved = opt.state_dict()
    return {name: saved["state"].get(i, {}) for g in saved["param_groups"] for i, name in zip(g["params"], g["names"])}


def unit(velocity: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    norm = math.sqrt(sum(v.double().square().sum().item() for v in velocity.values()))
    return {name: v.double() / norm for name, v in velocity.items()}


def test_every_optimizer_implements_the_interface():
    assert set(FIRST_MOMENT) == set(OPTIMIZERS)
    for spec in OPTIMIZERS.values():
        assert issubclass(spec.optimizer, OptimizerInterface)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_first_moments_are_the_states_that_move_like_increments(name):
    model, opt = trained(name)
    state = saved_state(opt)
    expected = {n: FIRST_MOMENT[name](n, p) for n, p in model.named_parameters()}
    moments, steering = opt.first_moments(), opt.first_moments(steering_only=True)
    assert set(moments) == {n for n, held in expected.items() if held}
    assert set(steering) == {n for n, held in expected.items() if held and held[1]}
    for n, value in moments.items():
        assert value.shape == dict(model.named_parameters())[n].shape
        assert torch.equal(value, state[n][expected[n][0]]), n
        if n in steering:
            assert torch.equal(steering[n], value)
    if name == "soap":  # its moments live in Shampoo's eigenbasis
        assert not moments and "exp_avg" in state[ATTENTION]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_set_first_moments_writes_the_named_state_and_nothing_else(name):
    model, opt = trained(name)
    before = {n: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for n, s in saved_state(opt).items()}
    moments = opt.first_moments()
    if not moments:
        opt.set_first_moments({})
        with pytest.raises(ValueError, match="keeps no first moment"):
            opt.set_first_moments({ATTENTION: torch.zeros(48, 16)})
        return
    written = 3 * moments[ATTENTION] + 1
    opt.set_first_moments({ATTENTION: written})
    key = FIRST_MOMENT[name](ATTENTION, dict(model.named_parameters())[ATTENTION])[0]
    after = saved_state(opt)
    assert torch.equal(after[ATTENTION][key], written) and torch.equal(opt.first_moments()[ATTENTION], written)
    for n, state in before.items():
        for k, value in state.items():
            assert (n, k) == (ATTENTION, key) or torch.equal(after[n][k], value), (n, k)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_velocity_is_the_direction_of_motion_live_and_saved(name):
    model, opt = trained(name)
    if not opt.has_velocity:
        assert name in ("muon", "soap")
        with pytest.raises(NotImplementedError, match="defines no velocity"):
            opt.velocity()
        return
    live, saved = opt.velocity(), type(opt).saved_velocity(opt.state_dict())
    state = saved_state(opt)
    group = opt.param_groups[0]
    if name == "ecd":
        expected = {n: s["pi"] for n, s in state.items()}
    elif name == "sgdm":
        expected = {n: -s["momentum_buffer"] for n, s in state.items()}
    else:  # torch's AdamW update direction, bias-corrected, written out
        beta1, beta2 = group["betas"]
        expected = {n: -(s["exp_avg"] / (1 - beta1 ** s["step"]))
                    / ((s["exp_avg_sq"] / (1 - beta2 ** s["step"])).sqrt() + group["eps"]) for n, s in state.items()}
    assert set(live) == set(saved) == {n for n, _ in model.named_parameters()}
    for n, value in unit(expected).items():
        torch.testing.assert_close(unit(live)[n], value, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(unit(saved)[n], value, rtol=1e-9, atol=1e-12)


def test_no_velocity_before_any_state_and_a_clear_error_without_names():
    spec = OPTIMIZERS["adamw"]
    model = tiny_gpt(block_size=16, n_layer=1, n_embd=16)
    assert spec.build(model, spec.config()).velocity() == {}
    with pytest.raises(ValueError, match="carry no 'names'"):
        spec.optimizer.saved_velocity({"state": {}, "param_groups": [{"params": [0]}]})


# ---------------------------------------------------------------------------------------------------------------
# Constructor arguments: the config's fields, checked against the flags' declared ranges and choices.


def outside(bounds: str) -> list[float]:
    """Values just outside a declared range, on each side that has a bound."""
    low, high, low_in, high_in = _parse_bounds(bounds)
    values = []
    if math.isfinite(low):
        values.append(low - 1 if low_in else low)
    if math.isfinite(high):
        values.append(high + 1 if high_in else high)
    return values


def constructor_settings(spec) -> dict:
    return {f.name: getattr(spec.config(), f.name) for f in dataclasses.fields(spec.config) if f.name != "decay_groups"}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_constructors_take_their_configs_fields_with_the_configs_defaults(name):
    spec = OPTIMIZERS[name]
    parameters = dict(list(inspect.signature(spec.optimizer.__init__).parameters.items())[2:])
    assert set(parameters) == set(constructor_settings(spec))  # grad_clip is OptimizerInterface's
    for field, value in constructor_settings(spec).items():
        assert parameters[field].default == value, field


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_constructor_errors_are_the_flags_ranges(name):
    spec = OPTIMIZERS[name]
    model = tiny_gpt(block_size=16, n_layer=1, n_embd=16)
    checked = 0
    for field in dataclasses.fields(spec.config):
        bounds, choices = field.metadata.get("bounds"), field.metadata.get("choices")
        if bounds:
            bad = [type(field.default)(value) for value in outside(bounds)]
        else:
            bad = ["no-such-choice"] if choices and field.name != "decay_groups" else []
        for value in bad:
            cfg = dataclasses.replace(spec.config(), **{field.name: value})
            problem = value_problem(field.name, value, bounds) if bounds else \
                f"--{field.name.replace('_', '-')} must be one of {', '.join(choices)}, got {value!r}"
            assert field_problem(cfg) == (problem if bounds else None)  # the command line's check
            with pytest.raises(ValueError) as caught:
                spec.optimizer(spec.groups(model, spec.config()), **{**constructor_settings(spec), field.name: value})
            assert str(caught.value) == f"{spec.optimizer.__name__}: {problem}"
            checked += 1
    assert checked >= 4


def test_ecd_refuses_a_zero_learning_rate_as_its_flag_does():
    spec = OPTIMIZERS["ecd"]
    model = tiny_gpt(block_size=16, n_layer=1, n_embd=16)
    with pytest.raises(ValueError, match=r"^ECD: --lr must be > 0, got 0.0$"):
        spec.optimizer(spec.groups(model, spec.config()), lr=0.0)
