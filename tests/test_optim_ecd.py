"""ECD q=1 against docs/optimizers.md: a float64 NumPy transcription, the first step, renormalisation, noise, F̃ <=
F0."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from optim import OPTIMIZERS
from optim.ecd import ECD, ecd_noise


def tiny_model(seed: int = 0, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def groups(model: nn.Module, weight_decay: float) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if p.dim() == 2], "names": [n for n, p in named if p.dim() == 2],
         "weight_decay": weight_decay},
        {"params": [p for n, p in named if p.dim() == 1], "names": [n for n, p in named if p.dim() == 1],
         "weight_decay": 0.0},
    ]


def batch(step: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 5, generator=gen, dtype=dtype), torch.randn(16, 3, generator=gen, dtype=dtype)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step, next(model.parameters()).dtype)
    return ((model(x) - y) ** 2).mean()


def run_ecd(model: nn.Module, opt: ECD, steps: int) -> None:
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        opt.step(loss.detach())


def flat(tensors) -> np.ndarray:
    return np.concatenate([t.detach().double().reshape(-1).numpy() for t in tensors])


def reference_ecd(model, order, steps, lr, eta, F0, nu, lam, per_tensor, seed, energy_conservation=True):
    """docs/optimizers.md#ecd written out in float64 NumPy over one flat vector (the parameters in optimizer order)."""
    params = [dict(model.named_parameters())[n] for n in order]
    sizes = [p.numel() for p in params]
    bounds = np.cumsum([0] + sizes)
    theta = flat(params)
    D = theta.size
    h, nu_hat = lr / math.sqrt(eta), nu / math.sqrt(D)
    kappa = 0.5 * h * eta * D / (D - 1)
    pi = None

    def loss_and_grad(theta, step):
        with torch.no_grad():
            for p, a, b in zip(params, bounds[:-1], bounds[1:]):
                p.copy_(torch.from_numpy(theta[a:b]).view_as(p))
        model.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        return loss.item(), flat(p.grad for p in params)

    for step in range(steps):
        F, g = loss_and_grad(theta, step)
        Ft, gt = F + 0.5 * np.sum(lam * theta**2), g + lam * theta
        if pi is None:
            pi = -g / np.linalg.norm(g)
        if Ft - F0 <= 1e-40:
            continue
        if energy_conservation and abs(pi @ pi - 1) >= 1e-10:
            pi = pi / np.linalg.norm(pi)
        if per_tensor:
            pg = np.concatenate([np.full(b - a, pi[a:b] @ gt[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])
        else:
            pg = pi @ gt
        pi = pi - kappa / (Ft - F0) * (gt - pi * pg)
        s = np.linalg.norm(pi)
        theta = theta + h * pi
        if nu > 0:
            z = ecd_noise(seed, step, 0, 0, D, torch.float64, "cpu").numpy()
            pi = pi / s + nu_hat * z
            pi = s * pi / np.linalg.norm(pi)
    return theta, pi


@pytest.mark.parametrize("projection", ["global", "per_tensor"])
@pytest.mark.parametrize("nu", [0.0, 0.3])
def test_matches_numpy_transcription_over_20_steps(projection, nu):
    lr, eta, F0, wd, seed = 0.05, 4.0, 0.1, 0.05, 7
    model = tiny_model()
    opt = ECD(groups(model, wd), lr=lr, ecd_eta=eta, ecd_f0=F0, ecd_nu=nu, ecd_projection=projection, optim_seed=seed)
    order = [n for g in opt.param_groups for n in g["names"]]
    lam = np.concatenate([np.full(p.numel(), g["weight_decay"]) for g in opt.param_groups for p in g["params"]])
    run_ecd(model, opt, 20)
    theta = flat(opt.params_in_order)
    pi = flat(opt.state_dict()["state"][i]["pi"] for i in range(len(order)))
    ref_theta, ref_pi = reference_ecd(tiny_model(), order, 20, lr, eta, F0, nu, lam, projection == "per_tensor", seed)
    moved = np.linalg.norm(ref_theta - flat(tiny_model().parameters()))
    assert moved > 0.1
    np.testing.assert_allclose(theta, ref_theta, rtol=0, atol=1e-10 * moved)
    np.testing.assert_allclose(pi, ref_pi, rtol=0, atol=1e-10)


def test_first_step_moves_along_minus_gradient():
    model = tiny_model(1)
    opt = ECD(model.parameters(), lr=0.3, ecd_eta=9.0, ecd_f0=0.0, ecd_projection="global")
    before = flat(model.parameters())
    loss = loss_of(model, 0)
    loss.backward()
    g = flat(p.grad for p in model.parameters())
    opt.step(loss.detach())
    step = flat(model.parameters()) - before
    # Π0 = −g/‖g‖ has no component orthogonal to g̃ = g, so the (globally) projected force vanishes: Δθ = −h g/‖g‖.
    np.testing.assert_allclose(step, -(0.3 / 3.0) * g / np.linalg.norm(g), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("energy_conservation", [True, False])
def test_update_is_projected_form_with_renormalised_momentum(energy_conservation):
    model = tiny_model(2)
    lr, eta, F0 = 0.2, 4.0, 0.05
    opt = ECD(model.parameters(), lr=lr, ecd_eta=eta, ecd_f0=F0, ecd_energy_conservation=energy_conservation,
              ecd_projection="global")
    run_ecd(model, opt, 2)
    state = opt.state_dict()
    gen = torch.Generator().manual_seed(3)
    for i in state["state"]:
        state["state"][i]["pi"] = 3.0 * torch.randn(state["state"][i]["pi"].shape, generator=gen, dtype=torch.float64)
    opt.load_state_dict(state)
    pi = flat(state["state"][i]["pi"] for i in state["state"])
    before = flat(model.parameters())
    opt.zero_grad()
    loss = loss_of(model, 5)
    loss.backward()
    g = flat(p.grad for p in model.parameters())
    opt.step(loss.detach())
    D = pi.size
    h = lr / math.sqrt(eta)
    k = 0.5 * h * eta * D / (D - 1) / (loss.item() - F0)
    unit = pi / np.linalg.norm(pi) if energy_conservation else pi
    expected = h * (unit - k * (g - unit * (unit @ g)))
    np.testing.assert_allclose(flat(model.parameters()) - before, expected, rtol=1e-10, atol=1e-14)
    if energy_conservation:  # the projected force is orthogonal to Π̂, so ‖Π‖² = 1 + k²(‖g‖² − (Π̂·g)²) after it
        new_pi = flat(opt.state_dict()["state"][i]["pi"] for i in state["state"])
        expected_norm2 = 1 + k**2 * (g @ g - (unit @ g) ** 2)
        assert new_pi @ new_pi == pytest.approx(expected_norm2, rel=1e-12)


def test_noise_is_reproducible_under_a_seed():
    finals = []
    for seed, nu in [(11, 0.5), (11, 0.5), (12, 0.5), (11, 0.0)]:
        model = tiny_model(4)
        opt = ECD(model.parameters(), lr=0.1, ecd_eta=4.0, ecd_f0=0.0, ecd_nu=nu, optim_seed=seed)
        run_ecd(model, opt, 6)
        finals.append(flat(model.parameters()))
    assert np.array_equal(finals[0], finals[1])
    assert not np.allclose(finals[0], finals[2])
    assert not np.allclose(finals[0], finals[3])


def test_noise_does_not_depend_on_sharding():
    whole = ecd_noise(5, 3, 0, 0, 3_000_000, torch.float32, "cpu")
    part = ecd_noise(5, 3, 0, 1_048_000, 2_100_000, torch.float32, "cpu")
    assert torch.equal(whole[1_048_000:2_100_000], part)
    assert whole.std().item() == pytest.approx(1.0, abs=0.01)


def test_loss_at_or_below_f0_leaves_state_unchanged_and_warns_once():
    model = tiny_model(5)
    opt = ECD(model.parameters(), lr=0.1, ecd_eta=4.0, ecd_f0=0.0)
    run_ecd(model, opt, 3)
    before, pi_before = flat(model.parameters()), flat(opt.state_dict()["state"][i]["pi"] for i in range(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for loss in (torch.tensor(-1.0, dtype=torch.float64), torch.tensor(0.0), torch.tensor(-3.0)):
            opt.zero_grad()
            loss_of(model, 9).backward()
            opt.step(loss)
        opt.zero_grad()
        good = loss_of(model, 9)
        good.backward()
        opt.step(good.detach())
    assert sum("F0" in str(w.message) for w in caught) == 1
    after_pi = flat(opt.state_dict()["state"][i]["pi"] for i in range(4))
    assert np.all(np.isfinite(after_pi)) and np.all(np.isfinite(flat(model.parameters())))
    assert not np.array_equal(before, flat(model.parameters()))  # the good step moved

    model2 = tiny_model(5)
    opt2 = ECD(model2.parameters(), lr=0.1, ecd_eta=4.0, ecd_f0=0.0)
    run_ecd(model2, opt2, 3)
    with pytest.warns(UserWarning, match="F0"):
        for _ in range(3):
            opt2.zero_grad()
            loss_of(model2, 9).backward()
            opt2.step(torch.tensor(-1.0))
    assert np.array_equal(flat(model2.parameters()), before)
    assert np.array_equal(flat(opt2.state_dict()["state"][i]["pi"] for i in range(4)), pi_before)


def test_first_call_below_f0_initialises_but_does_not_move():
    model = tiny_model(6)
    opt = ECD(model.parameters(), lr=0.1, ecd_eta=4.0, ecd_f0=10.0)
    before = flat(model.parameters())
    loss = loss_of(model, 0)
    loss.backward()
    g = flat(p.grad for p in model.parameters())
    with pytest.warns(UserWarning, match="F0"):
        opt.step(loss.detach())
        opt.step(loss.detach())
    assert np.array_equal(flat(model.parameters()), before)
    np.testing.assert_allclose(flat(opt.velocity().values()), -g / np.linalg.norm(g), rtol=1e-12)


def test_closure_form_equals_loss_form():
    finals = []
    for use_closure in (False, True):
        model = tiny_model(7)
        opt = ECD(model.parameters(), lr=0.1, ecd_eta=4.0, ecd_f0=0.0)
        for step in range(4):
            def closure(step=step):
                opt.zero_grad()
                loss = loss_of(model, step)
                loss.backward()
                return loss

            if use_closure:
                opt.step(closure)
            else:
                opt.step(closure().detach())
        finals.append(flat(model.parameters()))
    assert np.array_equal(finals[0], finals[1])


def test_velocity_is_normalised_momentum_by_name():
    model = tiny_model(8)
    opt = ECD(groups(model, 0.0), lr=0.1, ecd_eta=4.0, ecd_f0=0.0, ecd_nu=0.2)
    run_ecd(model, opt, 3)
    u = opt.velocity()
    assert set(u) == {n for n, _ in model.named_parameters()}
    assert sum(t.square().sum().item() for t in u.values()) == pytest.approx(1.0, rel=1e-12)
    pi = opt.state_dict()["state"]
    names = [n for g in opt.param_groups for n in g["names"]]
    norm = math.sqrt(sum(pi[i]["pi"].square().sum().item() for i in pi))
    for i, name in enumerate(names):
        torch.testing.assert_close(u[name], pi[i]["pi"] / norm)


def test_builder_validates_flags():
    model = tiny_model(dtype=torch.float32)
    spec = OPTIMIZERS["ecd"]
    for bad, match in [({"ecd_eta": 0.0}, "eta"), ({"ecd_projection": "local"}, "projection"),
                       ({"optim_state_dtype": "fp8"}, "optim-state-dtype")]:
        with pytest.raises(ValueError, match=match):
            spec.build(model, spec.config(**bad))
