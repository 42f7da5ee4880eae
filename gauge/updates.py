"""Gauge-aware post-processing of optimizer updates on attention heads (docs/gauge.md).

Any optimizer of the registry takes its step; `GaugeUpdates` then reads the per-head factor increments
U = θ_after − θ_before of the attention parameters and rewrites them (docs/gauge.md#quotient-aware-updates):

- correct: opposite-Gram correction ΔA = U_A (BᵀB + λI)⁻¹, ΔB = U_B (AᵀA + λI)⁻¹ (full, diagonal or periodic);
- project: remove the update's component along the GL(d) or O(d) gauge orbit, and the same component of the
  optimizer's velocity (its steering first moments: ECD's Π, a momentum buffer; not Adam's first moment), so that
  the motion is redirected rather than dropped (docs/gauge.md#projection);
- dress: every k steps move each head to its Gram-balanced representative, forward pass unchanged, and transport
  the optimizer's first moments with it (docs/gauge.md#dressed-representatives);
- hyperball: a step of fixed relative length on each factor's Frobenius sphere (docs/gauge.md#hyperball).

Each head's sector is handled as one factor pair (A, B) with M = ABᵀ: QK: (Â_Q, Â_K); VO: (Â_V, B_Oᵀ), with the
learned attention biases as augmented rows (gauge.dynamics.head_factors). The gauge acts as (A, B) → (AS, BS⁻ᵀ).
correct, project and dress work on the factors of the model as evaluated: the mean of each sampled bias joins the
linear-bias row (c + μ), so the gauge they assume is an exact symmetry of the forward pass at the mean biases under
every --bias-mode (docs/gauge.md#the-biases). All math is float64, batched over layers and heads (d×d work per
head), without host synchronisation.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor, nn

from gauge.dynamics import (attention_parameters, complete_velocity, factor_tensors, head_factors, num_attention_layers,
                            plain_name, solve_rotation_generator)
from optim.base import OptimizerInterface

MODES = ("correct", "project", "dress", "hyperball")  # --gauge's choices besides none (variants.ResearchConfig)
SECTORS = {"QK": ("Q", "K"), "VO": ("V", "O")}


# ----------------------------------------------------------------------------------------------------------------
# Pure tensor math on factor pairs: a (..., n, d), b (..., m, d), increments u_a, u_b of the same shapes.


def opposite_gram_correction(a: Tensor, b: Tensor, u_a: Tensor, u_b: Tensor, damping: float,
                             diagonal: bool = False) -> tuple[Tensor, Tensor]:
    """ΔA = U_A (BᵀB + λI)⁻¹, ΔB = U_B (AᵀA + λI)⁻¹ (docs/gauge.md#quotient-aware-updates); `diagonal` keeps
    only the Grams' diagonals. The Grams are those of the factors before the step."""
    h_a, h_b = a.mT @ a, b.mT @ b
    if diagonal:
        return (u_a / (h_b.diagonal(dim1=-2, dim2=-1) + damping).unsqueeze(-2),
                u_b / (h_a.diagonal(dim1=-2, dim2=-1) + damping).unsqueeze(-2))
    eye = damping * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    # X (H + λI)⁻¹ = ((H + λI)⁻¹ Xᵀ)ᵀ for symmetric H; cholesky_solve would sync on failure, solve does not.
    return (torch.linalg.solve(h_b + eye, u_a.mT).mT, torch.linalg.solve(h_a + eye, u_b.mT).mT)


def solve_sylvester_spd(h_a: Tensor, h_b: Tensor, rhs: Tensor) -> Tensor:
    """ξ with H_A ξ + ξ H_B = R for symmetric positive definite H_A, H_B (batched d×d), through the
    eigendecompositions H_A = PΛPᵀ, H_B = QMQᵀ: ξ = P ((PᵀRQ) / (λ_i + μ_j)) Qᵀ."""
    lam, p = torch.linalg.eigh(h_a)
    mu, q = torch.linalg.eigh(h_b)
    denominator = (lam.unsqueeze(-1) + mu.unsqueeze(-2)).clamp_min(torch.finfo(h_a.dtype).tiny)
    return p @ ((p.mT @ rhs @ q) / denominator) @ q.mT


def orbit_generator(a: Tensor, b: Tensor, u_a: Tensor, u_b: Tensor, group: str) -> Tensor:
    """The generator ξ (d×d) whose orbit motion (Aξ, −Bξᵀ) is the least-squares fit to (U_A, U_B)
    (docs/gauge.md#projection). gl: H_A ξ + ξ H_B = AᵀU_A − U_BᵀB; o: ξ antisymmetric, solving
    (H_A + H_B)ξ + ξ(H_A + H_B) = X − Xᵀ with X = AᵀU_A + BᵀU_B, as gauge.dynamics.rotational_fraction."""
    if group == "gl":
        return solve_sylvester_spd(a.mT @ a, b.mT @ b, a.mT @ u_a - u_b.mT @ b)
    if group == "o":
        charge = a.mT @ u_a + b.mT @ u_b  # the Noether charge (gauge.dynamics.noether_charges) of the pair
        return solve_rotation_generator(a.mT @ a + b.mT @ b, charge - charge.mT)
    raise ValueError(f"gauge group must be 'gl' or 'o', got {group!r}")


def orbit_projection(a: Tensor, b: Tensor, u_a: Tensor, u_b: Tensor, group: str) -> tuple[Tensor, Tensor]:
    """(U_A − Aξ, U_B + Bξᵀ): the update with its component along the gauge orbit removed (ξ: orbit_generator)."""
    xi = orbit_generator(a, b, u_a, u_b, group)
    return u_a - a @ xi, u_b + b @ xi.mT


def balancing_gauge(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(A', B', S, S⁻ᵀ): the Gram-balanced representative A' = AS, B' = BS⁻ᵀ of M = ABᵀ (A'ᵀA' = B'ᵀB' = Σ)
    (docs/gauge.md#dressed-representatives).

    Thin SVD of M through d×d work: A = Q_A R_A, B = Q_B R_B, R_A R_Bᵀ = UΣVᵀ, so A' = Q_A U Σ^½ O and
    B' = Q_B V Σ^½ O for any orthogonal O; O is the Procrustes choice closest to (A, B) (the polar factor of
    A'₀ᵀA + B'₀ᵀB), so dressing a balanced pair again changes nothing. Needs A and B of full column rank.
    """
    q_a, r_a = torch.linalg.qr(a)
    q_b, r_b = torch.linalg.qr(b)
    u, sigma, vt = torch.linalg.svd(r_a @ r_b.mT)
    root = sigma.sqrt().unsqueeze(-2)
    closest = (u * root).mT @ r_a + (vt.mT * root).mT @ r_b  # A'₀ᵀA + B'₀ᵀB in d×d form
    x, _, yt = torch.linalg.svd(closest)
    rotation = x @ yt
    left, right = (u * root) @ rotation, (vt.mT * root) @ rotation  # R_A S and R_B S⁻ᵀ
    s = torch.linalg.solve_triangular(r_a, left, upper=True)
    s_inv_t = (u / root) @ rotation  # (U Σ^½ O)⁻ᵀ = U Σ^-½ O, so S⁻ᵀ = R_Aᵀ U Σ^-½ O
    return q_a @ left, q_b @ right, s, r_a.mT @ s_inv_t


def sphere_step(w: Tensor, u: Tensor, radius: Tensor, step: float) -> Tensor:
    """Hyperball retraction (docs/gauge.md#hyperball): U = η R Ũ/‖Ũ‖_F, W ← R (W + U)/‖W + U‖_F per matrix (last
    two dims); Ũ is the optimizer's increment (a descent direction already, hence no minus sign)."""
    norm = torch.linalg.matrix_norm(u).clamp_min(torch.finfo(u.dtype).tiny)[..., None, None]
    moved = w + (step * radius[..., None, None] / norm) * u
    return radius[..., None, None] * moved / torch.linalg.matrix_norm(moved)[..., None, None]


def gram_imbalance(a: Tensor, b: Tensor) -> Tensor:
    """‖AᵀA − BᵀB‖_F / ‖AᵀA‖_F per head."""
    h_a = a.mT @ a
    return torch.linalg.matrix_norm(h_a - b.mT @ b) / torch.linalg.matrix_norm(h_a).clamp_min(1e-300)


# ----------------------------------------------------------------------------------------------------------------
# Named tensors ↔ stacked factor pairs.


def mean_bias_rows(model: nn.Module) -> dict[str, Tensor]:
    """{"Q", "V": (L, H, d) float64}: the mean sampled bias that the evaluated model adds to each head's queries or
    values, for the sectors its --bias-mode samples (none for `none` and `learned`). It is what `factor_pairs` adds
    to the linear-bias rows (docs/gauge.md#the-biases)."""
    config, means = model.config, model.mean_biases.double()  # (L, 2, d) or, per head, (L, 2, H, d)
    if means.dim() == 3:
        means = means.unsqueeze(2).expand(-1, -1, config.n_head, -1)
    return {sector: means[:, i] for i, (sector, sampled) in enumerate(zip("QV", config.sampled_biases)) if sampled}


def _shift_bias_rows(factors: dict[str, Tensor], tensors: Mapping[str, Tensor], layer: int,
                     shift: Mapping[str, Tensor], sign: float) -> None:
    """Add sign · shift[sector][layer] to the linear-bias row (row C) of the named sectors' factors, in place."""
    if shift and f"transformer.h.{layer}.attn.c_attn.bias" not in tensors:
        raise ValueError("the mean biases fold into the attention's linear bias (c_attn.bias), which these tensors "
                         "lack")
    for sector, rows in shift.items():
        factors[sector] = factors[sector].clone()
        factors[sector][:, factors["O"].shape[-1]] += sign * rows[layer].to(factors[sector])


def factor_pairs(tensors: Mapping[str, Tensor], n_head: int,
                 shift: Mapping[str, Tensor] | None = None) -> dict[str, tuple[Tensor, Tensor]]:
    """{"QK": (Â_Q, Â_K), "VO": (Â_V, B_Oᵀ)}, each (L, H, rows, d) float64, from named attention tensors. `shift`
    (`mean_bias_rows`) is added to the linear-bias rows: the factors of the model as evaluated (parameters only;
    increments and optimizer moments take no shift)."""
    layers = []
    for layer in range(num_attention_layers(tensors)):
        factors = head_factors(tensors, layer, n_head)
        _shift_bias_rows(factors, tensors, layer, shift or {}, 1.0)
        layers.append(factors)
    return {sector: (torch.stack([f[x] for f in layers]),
                     torch.stack([f[y].mT if y == "O" else f[y] for f in layers]))
            for sector, (x, y) in SECTORS.items()}


def named_tensors(pairs: Mapping[str, tuple[Tensor, Tensor]], like: Mapping[str, Tensor], n_head: int,
                  shift: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The inverse of `factor_pairs` (dtype and device of `like`; `shift` is subtracted again). A learned bias
    shared by all heads, shape (d,), takes the mean over heads of its per-head rows."""
    out = {}
    for layer in range(pairs["QK"][0].shape[0]):
        factors = {"Q": pairs["QK"][0][layer], "K": pairs["QK"][1][layer], "V": pairs["VO"][0][layer],
                   "O": pairs["VO"][1][layer].mT}
        _shift_bias_rows(factors, like, layer, shift or {}, -1.0)
        for sector, name in (("Q", "b_q"), ("V", "b_v")):
            learned = like.get(f"transformer.h.{layer}.attn.{name}")
            if learned is not None and learned.dim() == 1:
                rows = factors[sector].clone()
                rows[:, -1] = rows[:, -1].mean(0)
                factors[sector] = rows
        out.update(factor_tensors(factors, like, layer, n_head))
    return out


# ----------------------------------------------------------------------------------------------------------------
# The trainer's object.


class GaugeUpdates:
    """Post-processing of every optimizer step on the attention heads (`--gauge`, docs/gauge.md#commands).

    Call `snapshot(model)` before the optimizer step and `after_step(model, optimizer, before, step, scale)` after
    it. Parameters are rewritten in place (the sharded optimizers keep them as views into flat buffers);
    every rank holds the full parameters after a step and does the same float64 work, so no collective is needed
    except for moving optimizer state (optim.base.OptimizerInterface.first_moments gathers the sharded state).
    """

    def __init__(self, mode: str, n_head: int, correction: str = "full", every: int = 10, damping: float = 1e-3,
                 group: str = "gl", hyperball_lr: float = 0.01, project_velocity: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"--gauge must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.n_head, self.correction, self.every = mode, n_head, correction, every
        self.damping, self.group, self.hyperball_lr = damping, group, hyperball_lr
        self.project_velocity = project_velocity
        self.radii: dict[str, Tensor] = {}  # hyperball: each head factor's Frobenius norm at the first step

    @torch.no_grad()
    def snapshot(self, model: nn.Module) -> dict[str, Tensor] | None:
        """Copies of the attention parameters before the step (None for dress, which does not read the step)."""
        if self.mode == "dress":
            return None
        return {name: p.clone() for name, p in attention_parameters(model).items()}

    @torch.no_grad()
    def after_step(self, model: nn.Module, optimizer: OptimizerInterface | None, before: dict[str, Tensor] | None,
                   step: int, lr_scale: float = 1.0) -> None:
        """Post-process the step that led to `step` (steps counted from 1); lr_scale: the schedule's factor;
        optimizer: the one that stepped, whose first moments project and dress move (None: no state to move)."""
        params = attention_parameters(model)
        # correct, project and dress act on the factors of the model as evaluated; hyperball constrains the stored
        # parameters' norms (docs/gauge.md#the-biases).
        shift = {} if self.mode == "hyperball" else mean_bias_rows(model)
        if self.mode == "dress":
            if step % self.every == 0:
                self.dress(params, optimizer, shift)
            return
        old, new = factor_pairs(before, self.n_head, shift), factor_pairs(params, self.n_head, shift)
        result = {sector: self._processed(sector, a, b, new[sector][0] - a, new[sector][1] - b, step, lr_scale)
                  for sector, (a, b) in old.items()}
        for name, value in named_tensors(result, params, self.n_head, shift).items():
            params[name].copy_(value)
        if self.mode == "project" and self.project_velocity:
            # The velocity at the new point loses its orbit component too (docs/gauge.md#projection); Adam's first
            # moment is divided by its unprojected √v, so projecting it would not project the step (#the-velocity).
            self._move_first_moments(params, optimizer, lambda sector, u_a, u_b: orbit_projection(
                *result[sector], u_a, u_b, self.group), steering_only=True)

    def _processed(self, sector: str, a: Tensor, b: Tensor, u_a: Tensor, u_b: Tensor, step: int,
                   lr_scale: float) -> tuple[Tensor, Tensor]:
        if self.mode == "correct":
            diagonal = self.correction == "diagonal" or (self.correction == "periodic" and step % self.every != 0)
            u_a, u_b = opposite_gram_correction(a, b, u_a, u_b, self.damping, diagonal)
        elif self.mode == "project":
            u_a, u_b = orbit_projection(a, b, u_a, u_b, self.group)
        else:
            for key, w in ((f"{sector}.A", a), (f"{sector}.B", b)):
                if key not in self.radii:
                    self.radii[key] = torch.linalg.matrix_norm(w)
            return (sphere_step(a, u_a, self.radii[f"{sector}.A"], self.hyperball_lr * lr_scale),
                    sphere_step(b, u_b, self.radii[f"{sector}.B"], self.hyperball_lr * lr_scale))
        return a + u_a, b + u_b

    @torch.no_grad()
    def dress(self, params: Mapping[str, Tensor], optimizer: OptimizerInterface | None,
              shift: Mapping[str, Tensor] | None = None) -> None:
        """Move every head to its Gram-balanced representative and transport the optimizer's first moments (not
        SOAP's, which live in its eigenbasis) like the factors' increments; second moments and SOAP's state are
        kept (docs/gauge.md#dressed-representatives). shift: `mean_bias_rows` of the model, without which a model
        with sampled bias means would change (docs/gauge.md#the-biases)."""
        pairs, gauges = {}, {}
        for sector, (a, b) in factor_pairs(params, self.n_head, shift).items():
            a, b, s, s_inv_t = balancing_gauge(a, b)
            pairs[sector], gauges[sector] = (a, b), (s, s_inv_t)
        self._move_first_moments(params, optimizer, lambda sector, u_a, u_b: (u_a @ gauges[sector][0],
                                                                              u_b @ gauges[sector][1]))
        for name, value in named_tensors(pairs, params, self.n_head, shift).items():
            params[name].copy_(value)

    def _move_first_moments(self, params: Mapping[str, Tensor], optimizer: OptimizerInterface | None,
                            move: Callable[[str, Tensor, Tensor], tuple[Tensor, Tensor]],
                            steering_only: bool = False) -> None:
        """Rewrite the optimizer's first moments of the attention parameters (optim.base.OptimizerInterface;
        steering_only: those the step moves along): move(sector, U_A, U_B) -> (U_A', U_B') per sector, stacked like
        `factor_pairs`. Collectives for the sharded optimizers."""
        if optimizer is None:
            return
        moments = {plain_name(name): (name, value) for name, value in optimizer.first_moments(steering_only).items()}
        present = {name: moments[name][1] for name in params if name in moments}
        if not present:
            return
        full = complete_velocity(params, present)
        moved = {sector: move(sector, u_a, u_b) for sector, (u_a, u_b) in factor_pairs(full, self.n_head).items()}
        optimizer.set_first_moments({moments[name][0]: value for name, value in
                                     named_tensors(moved, full, self.n_head).items() if name in present})

    def state_dict(self) -> dict:
        return {"mode": self.mode, "radii": {k: v.cpu() for k, v in self.radii.items()}}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.radii = {k: v.to(device) for k, v in state.get("radii", {}).items()} if state.get("mode") == self.mode \
            else {}
