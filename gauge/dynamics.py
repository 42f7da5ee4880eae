"""Gauge diagnostics of attention heads (docs/model.md, docs/evaluation.md): Noether charges, angular momentum |J̃|,
rotational fraction
f_rot (exact and the paper's eq. 24) and the weight drift ratio.

Pure tensor functions over *named tensors* (plain nanoGPT names, e.g. `transformer.h.0.attn.c_attn.weight`), so the
trainer's online diagnostics (`dynamics_summary`) and `eval.dynamics` (checkpoints) run the same code. Per head h of
layer l (docs/model.md): Â_Q = [W_Q[h]ᵀ; c_Q[h]] ∈ R^{(C+1)×d} (likewise Â_K, Â_V; in `learned` mode the learned b_q /
b_v is one more row), B_O = W_O[:, h]ᵀ ∈ R^{d×C}. A velocity u has the same names and shapes as the parameters.
Everything is computed in float64 on the tensors' device without host synchronisation.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor, nn

_WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DistributedDataParallel
_LEARNED_BIASES = {"Q": "b_q", "V": "b_v"}  # `learned` mode parameters (docs/model.md), rotated with their sector


def plain_name(name: str) -> str:
    """A parameter name without torch.compile / DDP wrapper prefixes."""
    while name.startswith(_WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def attention_parameters(model: nn.Module) -> dict[str, Tensor]:
    """The attention parameters by plain name, which the gauge acts on: detached views that write through."""
    return {plain_name(n): p.detach() for n, p in model.named_parameters() if ".attn." in n}


def num_attention_layers(tensors: Mapping[str, Tensor]) -> int:
    """Number of `transformer.h.{i}.attn.c_attn.weight` entries (checked to be 0..L-1)."""
    layers = sorted(int(n.split(".")[2]) for n in tensors if n.startswith("transformer.h.")
                    and n.endswith(".attn.c_attn.weight"))
    if layers != list(range(len(layers))) or not layers:
        raise ValueError(f"expected attention weights transformer.h.0..L-1.attn.c_attn.weight, found layers {layers} "
                         "(a model with --attention relational has no W_Q, W_K, W_V, W_O to analyse)")
    return len(layers)


def head_factors(tensors: Mapping[str, Tensor], layer: int, n_head: int) -> dict[str, Tensor]:
    """{"Q", "K", "V": Â (H, C+1[+1], d), "O": B_O (H, d, C)} of one attention layer, in float64 (docs/model.md).

    `tensors` holds parameters, or a velocity with the same entries (see `complete_velocity`).
    """
    prefix = f"transformer.h.{layer}.attn."
    weight = tensors[prefix + "c_attn.weight"].double()
    C = weight.shape[1]
    d = C // n_head
    bias = tensors.get(prefix + "c_attn.bias")
    factors = {}
    for i, sector in enumerate("QKV"):
        rows = [weight[i * C:(i + 1) * C].view(n_head, d, C).transpose(1, 2)]
        if bias is not None:
            rows.append(bias[i * C:(i + 1) * C].double().view(n_head, 1, d))
        learned = tensors.get(prefix + _LEARNED_BIASES[sector]) if sector in _LEARNED_BIASES else None
        if learned is not None:  # a shared (d,) bias joins every head: the per-head rotation is then approximate
            rows.append(learned.double().expand(n_head, d).reshape(n_head, 1, d))
        factors[sector] = torch.cat(rows, dim=1)
    factors["O"] = tensors[prefix + "c_proj.weight"].double().view(C, n_head, d).permute(1, 2, 0)
    return factors


def noether_charges(a: Mapping[str, Tensor], u: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """X_QK = Â_Qᵀu_Q + Â_Kᵀu_K and X_VO = Â_Vᵀu_V − u_O B_Oᵀ, each (H, d, d) (docs/evaluation.md), from `head_factors`
    of the parameters (a) and of the velocity (u).

    ⟨X, Ω⟩ is the velocity's component along the O(d) generator Ω (δÂ_Q = Â_QΩ, δÂ_K = Â_KΩ; δÂ_V = Â_VΩ,
    δB_O = −ΩB_O). The paper's printed eq. (23) pairs u_Q with W_K instead; we implement the charge itself.
    """
    x_qk = a["Q"].mT @ u["Q"] + a["K"].mT @ u["K"]
    x_vo = a["V"].mT @ u["V"] - u["O"] @ a["O"].mT
    return x_qk, x_vo


def angular_momentum(charge: Tensor) -> Tensor:
    """|J̃| = ‖X − Xᵀ‖_F / √2 over the last two dims (docs/evaluation.md#angular-momentum-and-rotational-fraction)."""
    return torch.linalg.matrix_norm(charge - charge.mT) / math.sqrt(2.0)


def solve_rotation_generator(gram: Tensor, rhs: Tensor) -> Tensor:
    """Solve H Ω + Ω H = L for symmetric positive definite H (batched d×d), without host synchronisation.

    Scaled Newton sign iteration for Sylvester equations (Roberts 1980; Higham, Functions of Matrices §5.5): with
    μ = (‖H⁻¹‖_F/‖H‖_F)^½, H ← (μH + (μH)⁻¹)/2 and L ← (μL + (μH)⁻¹ μL (μH)⁻¹)/2 keep the solution
    L_ij/(λ_i + λ_j) (in H's eigenbasis) invariant while H → I, so Ω = L_final/2. A fixed iteration count (no
    convergence test, hence no sync): 8 reach float64 accuracy for condition numbers up to 1e10, 12 leave margin.
    H is scaled to unit mean eigenvalue with a 1e-14 ridge so that an all-zero H gives Ω = 0 rather than NaN. H
    must be positive definite for a unique answer (true for a real head: C ≥ d rows, generic weights). Use float64.
    """
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    scale = (gram.diagonal(dim1=-2, dim2=-1).mean(-1) + torch.finfo(gram.dtype).tiny)[..., None, None]
    h, rhs = gram / scale + 1e-14 * eye, rhs / scale
    for _ in range(12):
        h_inv = torch.linalg.inv_ex(h)[0]
        mu = (torch.linalg.matrix_norm(h_inv) / torch.linalg.matrix_norm(h)).sqrt()[..., None, None]
        h, h_inv, rhs = mu * h, h_inv / mu, mu * rhs
        rhs = 0.5 * (rhs + h_inv @ rhs @ h_inv)
        h = 0.5 * (h + h_inv)
    return 0.5 * rhs


def rotational_fraction(charge: Tensor, gram: Tensor, velocity_sq: Tensor) -> Tensor:
    """Exact f_rot = ‖tangent part of u‖ / ‖u_sector‖ (docs/evaluation.md#angular-momentum-and-rotational-fraction).

    The least-squares projection of u onto the orbit's tangent space {(ÂΩ, ...) : Ωᵀ = −Ω} solves
    H Ω + Ω H = X − Xᵀ with H the sector's Gram sum (QK: Â_QᵀÂ_Q + Â_KᵀÂ_K; VO: Â_VᵀÂ_V + B_O B_Oᵀ); the
    tangent part's squared norm is then ⟨X, Ω⟩.
    """
    omega = solve_rotation_generator(gram, charge - charge.mT)
    tangent_sq = (charge * omega).sum(dim=(-2, -1)).clamp_min(0.0)
    return torch.where(velocity_sq > 0, (tangent_sq / velocity_sq.clamp_min(1e-300)).sqrt(), 0.0)


def rotational_fraction_approx(momentum: Tensor, weight_sq: Tensor, velocity_sq: Tensor, head_dim: int) -> Tensor:
    """arXiv 2601.22257 eq. (24): f_rot² ≈ d·|J̃|² / (2(‖W_Q‖² + ‖W_K‖²)(‖u_Q‖² + ‖u_K‖²)); exact when H ∝ I."""
    denominator = (2.0 * weight_sq * velocity_sq).clamp_min(1e-300)
    return torch.where(denominator > 1e-300, (head_dim * momentum.square() / denominator).sqrt(), 0.0)


def complete_velocity(params: Mapping[str, Tensor], velocity: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`velocity` with zeros for attention parameters it lacks (e.g. parameters no optimizer state covers yet)."""
    return {name: velocity[name] if name in velocity else torch.zeros_like(p) for name, p in params.items()
            if ".attn." in name}


def head_dynamics(params: Mapping[str, Tensor], velocity: Mapping[str, Tensor], n_head: int) -> dict[str, Tensor]:
    """Per-head diagnostics, each (L, H) float64: J_QK, J_VO, f_rot_QK, f_rot_VO (exact), f_rot_*_approx (eq. 24).

    Both sectors of every layer go through one batched Sylvester solve.
    """
    velocity = complete_velocity(params, velocity)
    charges, grams, weight_sq, velocity_sq = [], [], [], []
    for layer in range(num_attention_layers(params)):
        a, u = head_factors(params, layer, n_head), head_factors(velocity, layer, n_head)
        charges += noether_charges(a, u)
        grams += [a["Q"].mT @ a["Q"] + a["K"].mT @ a["K"], a["V"].mT @ a["V"] + a["O"] @ a["O"].mT]
        for factors, out in ((a, weight_sq), (u, velocity_sq)):
            out += [sum(factors[n].square().sum(dim=(-2, -1)) for n in pair) for pair in (("Q", "K"), ("V", "O"))]
    charge, gram = torch.stack(charges), torch.stack(grams)  # (2L, H, d, d): layer-major, QK then VO
    weight_sq, velocity_sq = torch.stack(weight_sq), torch.stack(velocity_sq)
    momentum = angular_momentum(charge)
    exact = rotational_fraction(charge, gram, velocity_sq)
    approx = rotational_fraction_approx(momentum, weight_sq, velocity_sq, charge.shape[-1])
    per_sector = {"J_{}": momentum, "f_rot_{}": exact, "f_rot_{}_approx": approx}
    return {key.format(sector): value[i::2] for key, value in per_sector.items()
            for i, sector in enumerate(("QK", "VO"))}


def dynamics_summary(model: nn.Module, velocity: Mapping[str, Tensor], n_head: int) -> dict[str, float]:
    """Means over layers and heads of `head_dynamics` (keys J_QK, J_VO, f_rot_QK, f_rot_VO, f_rot_*_approx).

    `velocity`: a unit velocity such as `velocity_from_optimizer(optimizer)`. For the trainer's
    `--dynamics-every N` log lines; one host sync (the final conversion).
    """
    velocity = {plain_name(n): v for n, v in velocity.items()}
    per_head = head_dynamics(attention_parameters(model), velocity, n_head)
    means = torch.stack([v.mean() for v in per_head.values()]).tolist()
    return dict(zip(per_head, means))


def _unit(velocity: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An optimizer's velocity by plain name, scaled to unit global norm."""
    directions = {plain_name(name): v for name, v in velocity.items()}
    if not directions:
        raise ValueError("no optimizer state holds a velocity yet (take at least one optimizer step first)")
    norm = torch.stack([v.double().square().sum() for v in directions.values()]).sum().sqrt()
    return {name: v / norm.clamp_min(1e-300).to(v.dtype) for name, v in directions.items()}


def _check_velocity(optimizer: type) -> None:
    if not optimizer.has_velocity:
        raise ValueError(f"{optimizer.__name__} defines no velocity (docs/evaluation.md#angular-momentum-and-"
                         "rotational-fraction)")


def velocity_from_state_dict(optimizer: type, state_dict: Mapping) -> dict[str, Tensor]:
    """Unit velocity u (name → tensor, global norm 1) from a state dict of optimizer class `optimizer` (a
    checkpoint's, whose param groups carry "names"): ECD Π; SGDM −momentum buffer; AdamW −m̂/(√v̂ + ε)."""
    _check_velocity(optimizer)
    return _unit(optimizer.saved_velocity(state_dict))


def velocity_from_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """Unit velocity u of a live optimizer, from its `velocity()`."""
    _check_velocity(type(optimizer))
    return _unit(optimizer.velocity())


def _product_distance_sq(a0: Tensor, b0: Tensor, a1: Tensor, b1: Tensor) -> Tensor:
    """‖A1B1ᵀ − A0B0ᵀ‖_F² through d×d Grams (never forms the C×C products)."""
    def inner(a, b, c, e):  # ⟨A Bᵀ, C Eᵀ⟩ = tr((CᵀA)(BᵀE)) = Σ (CᵀA) ∘ (EᵀB)
        return ((c.mT @ a) * (e.mT @ b)).sum(dim=(-2, -1))
    return (inner(a1, b1, a1, b1) + inner(a0, b0, a0, b0) - 2 * inner(a1, b1, a0, b0)).clamp_min(0.0)


def weight_drift_ratio(params0: Mapping[str, Tensor], params1: Mapping[str, Tensor], n_head: int) -> dict[str, Tensor]:
    """(‖ΔÂ_Q‖ + ‖ΔÂ_K‖)/‖Δ(Â_QÂ_Kᵀ)‖ per head (and the VO analogue with Â_V B_O), each (L, H) (docs/evaluation.md)."""
    out: dict[str, list[Tensor]] = {"drift_QK": [], "drift_VO": []}
    for layer in range(num_attention_layers(params1)):
        f0, f1 = head_factors(params0, layer, n_head), head_factors(params1, layer, n_head)
        for sector, (x, y) in {"QK": ("Q", "K"), "VO": ("V", "O")}.items():
            b0, b1 = (f0[y], f1[y]) if y == "K" else (f0[y].mT, f1[y].mT)
            moved = torch.linalg.matrix_norm(f1[x] - f0[x]) + torch.linalg.matrix_norm(f1[y] - f0[y])
            out[f"drift_{sector}"].append(moved / _product_distance_sq(f0[x], b0, f1[x], b1).sqrt().clamp_min(1e-300))
    return {key: torch.stack(values) for key, values in out.items()}


def factor_tensors(factors: Mapping[str, Tensor], like: Mapping[str, Tensor], layer: int,
                   n_head: int) -> dict[str, Tensor]:
    """The inverse of `head_factors`: named tensors of one attention layer (c_attn weight/bias, c_proj weight and
    learned b_q/b_v, those present in `like`) from factors {"Q", "K", "V": (H, C+1[+1], d), "O": (H, d, C)}, in the
    dtype and device of `like`'s entries. Works for parameters and for increments or velocities alike.

    A shared learned bias (shape (d,)) must be the same row in every head; it is taken from head 0 (a per-head gauge
    with different S per head cannot act on it: use per-head learned biases).
    """
    prefix = f"transformer.h.{layer}.attn."
    weight = like[prefix + "c_attn.weight"]
    C = weight.shape[1]
    out = {prefix + "c_attn.weight": torch.cat([factors[s][:, :C, :].mT.reshape(C, C) for s in "QKV"]).to(weight)}
    row = C
    if prefix + "c_attn.bias" in like:
        out[prefix + "c_attn.bias"] = torch.cat([factors[s][:, row, :].reshape(C) for s in "QKV"]).to(weight)
        row += 1
    for sector, name in _LEARNED_BIASES.items():
        learned = like.get(prefix + name)
        if learned is not None:
            rows = factors[sector][:, row, :]
            out[prefix + name] = (rows if learned.dim() == 2 else rows[0]).to(learned)
    out[prefix + "c_proj.weight"] = factors["O"].permute(2, 0, 1).reshape(C, C).to(like[prefix + "c_proj.weight"])
    return out


def gauge_transformed(tensors: Mapping[str, Tensor], n_head: int, s_qk: Tensor | None = None,
                      s_vo: Tensor | None = None) -> dict[str, Tensor]:
    """A copy of the parameters with the per-head gauge applied (docs/model.md#conventions): with S, T ∈ GL(d) per
    head, (Â_Q, Â_K) → (Â_Q S, Â_K S⁻ᵀ) and (Â_V, B_O) → (Â_V T, T⁻¹ B_O). s_qk, s_vo: (L, H, d, d) float64 (None:
    identity). Without sampled biases the forward pass is unchanged (a shared learned bias needs S equal across heads).
    """
    out = dict(tensors)
    for layer in range(num_attention_layers(tensors)):
        f = head_factors(tensors, layer, n_head)
        if s_qk is not None:
            f["Q"], f["K"] = f["Q"] @ s_qk[layer], f["K"] @ torch.linalg.inv(s_qk[layer]).mT
        if s_vo is not None:
            f["V"], f["O"] = f["V"] @ s_vo[layer], torch.linalg.solve(s_vo[layer], f["O"])
        out.update(factor_tensors(f, tensors, layer, n_head))
    return out
