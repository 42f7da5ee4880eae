"""Optimizer state: bf16 storage against fp32, exact resume from a state dict, state bytes, and the docs/evaluation.md
toy."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from optim import OPTIMIZERS, optimizer_state_bytes
from optim.ecd import ECD
from optim.muon import Muon
from optim.soap import SOAP

NAMES = ["ecd", "ecd_nu", "soap", "muon"]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))


def make(name: str, model: nn.Module, optim_state_dtype: str = "fp32") -> torch.optim.Optimizer:
    params = list(model.parameters())
    if name.startswith("ecd"):
        return ECD(params, lr=0.05, ecd_eta=4.0, ecd_f0=0.0, ecd_nu=0.2 if name == "ecd_nu" else 0.0,
                   optim_state_dtype=optim_state_dtype)
    if name == "soap":
        return SOAP(params, lr=3e-3, optim_state_dtype=optim_state_dtype)
    return Muon([{"params": [p for p in params if p.dim() == 2], "use_muon": True, "lr": 0.02},
                 {"params": [p for p in params if p.dim() == 1], "use_muon": False}], lr=3e-3,
                optim_state_dtype=optim_state_dtype)


def train(name: str, model: nn.Module, opt: torch.optim.Optimizer, steps: int, first: int = 0) -> float:
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 8, generator=gen)
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step(loss.detach()) if name.startswith("ecd") else opt.step()
    return loss.item()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# Measured over 50 steps on this toy: ECD 0.6%, SOAP 0.5%, Muon 7% (its update is bf16 Newton–Schulz anyway).
BF16_TOLERANCE = {"ecd": 0.02, "ecd_nu": 0.02, "soap": 0.02, "muon": 0.15}


@pytest.mark.parametrize("name", NAMES)
def test_zero_grad_clears_gradients_that_autograd_allocated_elsewhere(name):
    model = net()
    opt = make(name, model)
    model.zero_grad(set_to_none=True)  # gradients leave the flat buffer; backward allocates new ones
    model(torch.randn(4, 16)).square().sum().backward()
    assert all(p.grad.abs().sum() > 0 for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_bf16_state_stays_close_to_fp32_over_50_steps(name):
    start = flat(net())
    runs = {}
    for dtype in ("fp32", "bf16"):
        model = net()
        opt = make(name, model, dtype)
        loss = train(name, model, opt, 50)
        runs[dtype] = (flat(model), loss)
    (a, loss_a), (b, loss_b) = runs["fp32"], runs["bf16"]
    assert (a - b).norm() / (a - start).norm() < BF16_TOLERANCE[name]
    assert loss_b == pytest.approx(loss_a, rel=0.01)


@pytest.mark.parametrize("name", NAMES)
def test_resume_from_state_dict_gives_identical_trajectory(name):
    model = net()
    opt = make(name, model)
    train(name, model, opt, 7)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(name, model, opt, 6, first=7)
    resumed = net()
    opt2 = make(name, resumed)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(name, resumed, opt2, 6, first=7)
    assert torch.equal(flat(model), flat(resumed))


@pytest.mark.parametrize("name", ["ecd", "soap", "muon"])
def test_state_bytes_per_parameter_count_flat_buffers_once(name):
    spec = OPTIMIZERS[name]
    model = net()
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    numel = sum(p.numel() for p in model.parameters())
    # ECD: Π; SOAP: m and v (its Kronecker factors appear after the first step); Muon: momentum or m and v
    expected = {"ecd": 4 * numel, "soap": 8 * numel, "muon": 4 * matrices + 8 * (numel - matrices)}[name]
    for dtype, width in (("fp32", 1.0), ("bf16", 0.5)):
        model = net()
        opt = spec.build(model, spec.config(optim_state_dtype=dtype))
        assert optimizer_state_bytes(opt) == expected * width


def circular_valley_angular_momentum(make_opt, velocity, steps: int = 60) -> list[float]:
    """docs/evaluation.md toy: f = (x² + y² − 1 + z)², z ~ N(0, 0.1²); returns L = x v_y − y v_x along the run."""
    theta = nn.Parameter(torch.tensor([1.3, 0.6], dtype=torch.float64))
    opt = make_opt(theta)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        z = 0.1 * torch.randn((), generator=gen, dtype=torch.float64)
        opt.zero_grad()
        loss = (theta.square().sum() - 1 + z) ** 2
        loss.backward()
        opt.step(loss.detach()) if isinstance(opt, ECD) else opt.step()
        v = velocity(opt, theta)
        out.append((theta[0] * v[1] - theta[1] * v[0]).item())
    return out


def test_circular_valley_sgdm_keeps_zero_angular_momentum_ecd_with_noise_gains_some():
    sgdm = circular_valley_angular_momentum(
        lambda p: torch.optim.SGD([p], lr=0.01, momentum=0.9), lambda o, p: o.state[p]["momentum_buffer"])
    ecd_velocity = lambda o, p: next(iter(o.velocity().values()))  # noqa: E731
    quiet = circular_valley_angular_momentum(lambda p: ECD([p], lr=0.05, ecd_eta=2.0, ecd_f0=-0.01), ecd_velocity)
    noisy = circular_valley_angular_momentum(lambda p: ECD([p], lr=0.05, ecd_eta=2.0, ecd_f0=-0.01, ecd_nu=1.0),
                                             ecd_velocity)
    assert max(map(abs, sgdm)) < 1e-12
    assert max(map(abs, quiet)) < 1e-12  # ECD starts along −g: no angular momentum without noise either
    assert max(map(abs, noisy)) > 0.1
