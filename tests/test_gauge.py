"""gauge.dynamics (docs/model.md, docs/evaluation.md): factor layout, Noether charges, |J̃|, exact vs eq. 24 f_rot,
velocities, drift."""
from __future__ import annotations

import math

import pytest
import torch

from gauge.dynamics import (
    dynamics_summary,
    factor_tensors,
    gauge_transformed,
    head_dynamics,
    head_factors,
    solve_rotation_generator,
    velocity_from_optimizer,
    velocity_from_state_dict,
    weight_drift_ratio,
)
from optim.ecd import ECD
from optim.muon import Muon
from optim.soap import SOAP
from optim.torch_optimizers import SGDM, AdamW
from tests.helpers import tiny_gpt
from train_gpt import GPT

N_HEAD = 2


def tiny_model(seed: int = 0, bias_mode: str = "none", **kw) -> GPT:
    model = tiny_gpt(seed, vocab_size=96, block_size=16, n_head=N_HEAD, n_embd=16, bias_mode=bias_mode, **kw)
    with torch.no_grad():  # generic (non-zero) linear biases so the augmented rows matter
        for name, p in model.named_parameters():
            if name.endswith("attn.c_attn.bias"):
                p.normal_(0.0, 0.3)
    return model


def params_of(model: GPT) -> dict[str, torch.Tensor]:
    return {n: p.detach().double() for n, p in model.named_parameters()}


def random_antisymmetric(*shape: int, generator: torch.Generator) -> torch.Tensor:
    a = torch.randn(*shape, dtype=torch.float64, generator=generator)
    return a - a.mT


def velocity_of(params: dict, updates: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Named velocity tensors from per-layer factor velocities (factor_tensors, the inverse of head_factors)."""
    velocity = {}
    for layer, u in updates.items():
        velocity.update(factor_tensors(u, params, layer, N_HEAD))
    return velocity


def test_factor_tensors_inverts_head_factors_with_learned_per_head_biases():
    model = tiny_model(5, bias_mode="learned", bias_per_head=True)
    params = {n: p.detach() for n, p in model.named_parameters()}
    for layer in range(2):
        back = factor_tensors(head_factors(params, layer, N_HEAD), params, layer, N_HEAD)
        factor_names = {n for n in params if n.startswith(f"transformer.h.{layer}.attn.")} - {
            f"transformer.h.{layer}.attn.c_proj.bias"}  # the output bias is not part of any factor
        assert set(back) == factor_names
        for name, tensor in back.items():
            assert tensor.dtype == params[name].dtype
            assert torch.equal(tensor, params[name]), name


@pytest.mark.parametrize("bias_mode", ["none", "learned"])
def test_random_gauge_leaves_the_forward_pass_unchanged(bias_mode):
    model = tiny_model(6, bias_mode=bias_mode, bias_per_head=True).double().eval()
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(7))
    before = model(idx, all_logits=True)[0]
    g = torch.Generator().manual_seed(8)
    s_qk, s_vo = (torch.eye(8, dtype=torch.float64) + 0.5 * torch.randn(2, N_HEAD, 8, 8, dtype=torch.float64,
                  generator=g) for _ in range(2))
    params = {n: p.detach() for n, p in model.named_parameters()}
    moved = gauge_transformed(params, N_HEAD, s_qk, s_vo)
    changed = max((moved[n] - params[n]).abs().max().item() for n in params)
    model.load_state_dict(moved, strict=False)
    after = model(idx, all_logits=True)[0]
    assert changed > 0.1  # the weights really moved
    torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-9)


def test_head_factors_reproduce_the_model_queries_and_outputs():
    model = tiny_model(1)
    params = params_of(model)
    attn = model.transformer.h[1].attn
    x = torch.randn(5, 16, dtype=torch.float64)
    f = head_factors(params, 1, N_HEAD)
    qkv = x @ params["transformer.h.1.attn.c_attn.weight"].T + params["transformer.h.1.attn.c_attn.bias"]
    x1 = torch.cat([x, torch.ones(5, 1, dtype=torch.float64)], dim=1)
    for i, s in enumerate("QKV"):
        heads = torch.einsum("tc,hcd->htd", x1, f[s])
        assert torch.allclose(heads, qkv[:, i * 16:(i + 1) * 16].view(5, N_HEAD, 8).transpose(0, 1))
    y = torch.randn(N_HEAD, 5, 8, dtype=torch.float64)  # per-head attention outputs
    out = torch.einsum("htd,hdc->tc", y, f["O"])
    assert torch.allclose(out, y.transpose(0, 1).reshape(5, 16) @ attn.c_proj.weight.detach().double().T)


def test_sylvester_solver_matches_kronecker_solve():
    g = torch.Generator().manual_seed(0)
    d = 6
    a = torch.randn(3, 20, d, dtype=torch.float64, generator=g) * torch.logspace(-2, 1, d, dtype=torch.float64)
    gram = a.mT @ a  # condition number ~1e6
    rhs = random_antisymmetric(3, d, d, generator=g)
    omega = solve_rotation_generator(gram, rhs)
    eye = torch.eye(d, dtype=torch.float64)
    for b in range(3):
        kron = torch.kron(gram[b], eye) + torch.kron(eye, gram[b].T.contiguous())  # row-major vec(HΩ + ΩH)
        expected = torch.linalg.solve(kron, rhs[b].reshape(-1)).reshape(d, d)
        assert torch.allclose(omega[b], expected, rtol=1e-7, atol=1e-9)


def test_pure_rotation_has_rotational_fraction_one_and_invariant_velocity_zero_momentum():
    model = tiny_model(2)
    params = params_of(model)
    g = torch.Generator().manual_seed(3)
    rotation, invariant = {}, {}
    for layer in range(2):
        f = head_factors(params, layer, N_HEAD)
        omega_qk = random_antisymmetric(N_HEAD, 8, 8, generator=g)
        omega_vo = random_antisymmetric(N_HEAD, 8, 8, generator=g)
        rotation[layer] = {"Q": f["Q"] @ omega_qk, "K": f["K"] @ omega_qk, "V": f["V"] @ omega_vo,
                           "O": -omega_vo @ f["O"]}
        # Gradient of gauge-invariant functions of M_QK = Â_QÂ_Kᵀ and M_VO = Â_V B_O: G Â_K, Gᵀ Â_Q, G B_Oᵀ, Â_VᵀG.
        g_qk = torch.randn(N_HEAD, 17, 17, dtype=torch.float64, generator=g)
        g_vo = torch.randn(N_HEAD, 17, 16, dtype=torch.float64, generator=g)
        invariant[layer] = {"Q": g_qk @ f["K"], "K": g_qk.mT @ f["Q"], "V": g_vo @ f["O"].mT,
                            "O": f["V"].mT @ g_vo}
    rot = head_dynamics(params, velocity_of(params, rotation), N_HEAD)
    inv = head_dynamics(params, velocity_of(params, invariant), N_HEAD)
    for sector in ("QK", "VO"):
        assert torch.allclose(rot[f"f_rot_{sector}"], torch.ones(2, N_HEAD, dtype=torch.float64), atol=1e-8)
        assert (rot[f"J_{sector}"] > 1e-2).all()
        assert (inv[f"J_{sector}"] < 1e-10 * rot[f"J_{sector}"].max()).all()
        assert (inv[f"f_rot_{sector}"] < 1e-6).all()


def test_loss_gradient_of_symmetric_model_carries_no_angular_momentum_but_broken_one_does():
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))
    momenta = {}
    for mode in ("none", "bqbv"):
        model = tiny_model(5, bias_mode=mode, mean_v=0.5).double()
        _, loss = model(idx, idx)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        momenta[mode] = head_dynamics(params_of(model), grads, N_HEAD)
    for sector in ("QK", "VO"):
        broken = momenta["bqbv"][f"J_{sector}"]
        assert (broken > 1e-6).all()
        assert (momenta["none"][f"J_{sector}"] < 1e-9 * broken.max()).all()


def test_exact_and_approximate_rotational_fraction_agree_for_isotropic_weights_only():
    model = tiny_model(6)
    params = params_of(model)
    g = torch.Generator().manual_seed(7)
    for layer in range(2):
        q_orth = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64, generator=g))[0]
        k_orth = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64, generator=g))[0]
        params[f"transformer.h.{layer}.attn.c_attn.weight"][:16] = 0.7 * q_orth  # Â_QᵀÂ_Q = 0.49 I per head
        params[f"transformer.h.{layer}.attn.c_attn.weight"][16:32] = 1.3 * k_orth
        params[f"transformer.h.{layer}.attn.c_attn.bias"][:32] = 0.0
    velocity = {n: torch.randn(p.shape, dtype=torch.float64, generator=g) for n, p in params.items()}
    out = head_dynamics(params, velocity, N_HEAD)
    assert (out["f_rot_QK"] > 0.05).all()
    assert torch.allclose(out["f_rot_QK"], out["f_rot_QK_approx"], rtol=1e-8)
    # The VO sector's weights are anisotropic (random Â_V, B_O): there eq. 24 is only an approximation.
    assert not torch.allclose(out["f_rot_VO"], out["f_rot_VO_approx"], rtol=1e-2)


def test_dynamics_summary_is_the_mean_of_head_dynamics():
    model = tiny_model(8, bias_mode="learned", bias_per_head=True)
    velocity = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    summary = dynamics_summary(model, velocity, N_HEAD)
    per_head = head_dynamics(params_of(model), velocity, N_HEAD)
    assert set(summary) == {"J_QK", "J_VO", "f_rot_QK", "f_rot_VO", "f_rot_QK_approx", "f_rot_VO_approx"}
    for key, value in per_head.items():
        assert summary[key] == pytest.approx(value.mean().item(), rel=1e-9)
        assert all(math.isfinite(summary[k]) for k in summary)


def test_learned_biases_rotate_with_their_heads():
    model = tiny_model(9, bias_mode="learned", bias_per_head=True)
    params = params_of(model)
    f = head_factors(params, 0, N_HEAD)
    assert f["Q"].shape == (N_HEAD, 18, 8)  # C weight rows + c_Q + b_q
    assert torch.equal(f["Q"][:, -1], params["transformer.h.0.attn.b_q"])
    assert torch.equal(f["V"][:, -1], params["transformer.h.0.attn.b_v"])


def _trained_optimizer(kind: str) -> tuple[GPT, torch.optim.Optimizer]:
    model = tiny_model(10)
    groups = [{"params": list(model.parameters()), "names": [n for n, _ in model.named_parameters()]}]
    opt = (SGDM(groups, lr=0.01, momentum=0.9, nesterov=False, initial_velocity_std=0.0) if kind == "sgdm"
           else AdamW(groups, lr=1e-3, beta1=0.8, beta2=0.95, eps=1e-6))
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(11))
    for _ in range(3):
        opt.zero_grad()
        model(idx, idx)[1].backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("kind", ["sgdm", "adamw"])
def test_velocity_from_optimizer_state_is_the_unit_update_direction(kind):
    model, opt = _trained_optimizer(kind)
    u = velocity_from_optimizer(opt)
    norm = torch.stack([v.double().square().sum() for v in u.values()]).sum().sqrt()
    assert norm.item() == pytest.approx(1.0, rel=1e-6)
    name, p = "transformer.h.0.attn.c_attn.weight", model.transformer.h[0].attn.c_attn.weight
    state = opt.state[p]
    if kind == "sgdm":
        direction = -state["momentum_buffer"]
    else:
        step = float(state["step"])
        m_hat = state["exp_avg"] / (1 - 0.8 ** step)
        direction = -m_hat / ((state["exp_avg_sq"] / (1 - 0.95 ** step)).sqrt() + 1e-6)
    cosine = torch.nn.functional.cosine_similarity(u[name].flatten(), direction.flatten(), dim=0)
    assert cosine.item() == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(velocity_from_state_dict(type(opt), opt.state_dict())[name], u[name])


def test_velocity_from_ecd_state_and_from_optimizers_without_one():
    g = torch.Generator().manual_seed(12)
    pis = {0: torch.randn(4, 3, generator=g), 1: torch.randn(5, generator=g)}
    sd = {"state": {i: {"pi": v} for i, v in pis.items()}, "param_groups": [{"params": [0, 1], "names": ["a", "b"]}]}
    u = velocity_from_state_dict(ECD, sd)
    total = math.sqrt(sum(v.square().sum().item() for v in pis.values()))
    assert torch.allclose(u["a"], pis[0] / total) and torch.allclose(u["b"], pis[1] / total)
    sd["state"][0] = {"exp_avg": pis[0], "exp_avg_sq": pis[0].abs()}  # Muon's AdamW part: m, v, no velocity
    for optimizer in (Muon, SOAP):
        with pytest.raises(ValueError, match=f"{optimizer.__name__} defines no velocity"):
            velocity_from_state_dict(optimizer, sd)


def test_weight_drift_ratio_matches_explicit_products():
    model = tiny_model(13)
    p0 = params_of(model)
    g = torch.Generator().manual_seed(14)
    p1 = {n: v + 0.05 * torch.randn(v.shape, dtype=torch.float64, generator=g) for n, v in p0.items()}
    drift = weight_drift_ratio(p0, p1, N_HEAD)
    for layer in range(2):
        f0, f1 = head_factors(p0, layer, N_HEAD), head_factors(p1, layer, N_HEAD)
        for h in range(N_HEAD):
            dm_qk = f1["Q"][h] @ f1["K"][h].T - f0["Q"][h] @ f0["K"][h].T
            moved = (f1["Q"][h] - f0["Q"][h]).norm() + (f1["K"][h] - f0["K"][h]).norm()
            assert drift["drift_QK"][layer, h].item() == pytest.approx((moved / dm_qk.norm()).item(), rel=1e-8)
            dm_vo = f1["V"][h] @ f1["O"][h] - f0["V"][h] @ f0["O"][h]
            moved = (f1["V"][h] - f0["V"][h]).norm() + (f1["O"][h] - f0["O"][h]).norm()
            assert drift["drift_VO"][layer, h].item() == pytest.approx((moved / dm_vo.norm()).item(), rel=1e-8)


@pytest.mark.cuda
def test_online_diagnostics_do_not_synchronise_with_the_host():
    model = tiny_model(15).cuda()
    groups = [{"params": list(model.parameters()), "names": [n for n, _ in model.named_parameters()]}]
    opt = AdamW(groups, lr=1e-3)
    idx = torch.randint(0, 96, (2, 16), device="cuda")
    model(idx, idx)[1].backward()
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any implicit device->host sync raises
    try:
        velocity = velocity_from_optimizer(opt)
        per_head = head_dynamics({n: p.detach() for n, p in model.named_parameters()}, velocity, N_HEAD)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(v).all() for v in per_head.values())
