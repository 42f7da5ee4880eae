"""Gauge sensitivity of one optimizer step (docs/structure.md#gauge-sensitivity-diagnostic): the pure computation
behind `python -m eval.gauge` and the trainer's `--gauge-diagnostic-every` log records.

Per attention head the products M_QK = Â_Q Â_Kᵀ and M_VO = Â_V B_O are unchanged by the gauge (Â_Q, Â_K) →
(Â_Q S, Â_K S⁻ᵀ), (Â_V, B_O) → (Â_V T, T⁻¹ B_O) (docs/model.md#conventions). `gauge_diagnostic` draws S, T per head,
checks the logits, takes one fresh-optimizer step from both representatives and compares the represented motion ΔM.
The model is any GPT of train_gpt.py (only its `config`, `named_parameters` and forward pass are used), so this module
imports no trainer and no eval code.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import Tensor, nn
from torch.linalg import matrix_norm

from optim import OPTIMIZERS
from gauge.dynamics import attention_parameters, gauge_transformed, head_factors, num_attention_layers
from gauge.updates import gram_imbalance

GAUGE_KINDS = ("gl", "orthogonal")
SECTORS = ("QK", "VO")


def random_orthogonal(shape: tuple[int, ...], d: int, generator: torch.Generator) -> Tensor:
    """Haar-distributed orthogonal matrices (*shape, d, d) in float64 (QR of a Gaussian, signs fixed by diag R)."""
    q, r = torch.linalg.qr(torch.randn(*shape, d, d, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def random_gauges(shape: tuple[int, ...], d: int, kind: str, condition: float,
                  generator: torch.Generator) -> Tensor:
    """Random gauges (*shape, d, d) in float64: orthogonal, or GL(d) = U diag(σ) Vᵀ with U, V orthogonal and σ
    geometric from condition^-½ to condition^½ (determinant 1, condition number exactly `condition`)."""
    if kind not in GAUGE_KINDS:
        raise ValueError(f"gauge kind must be one of {GAUGE_KINDS}, got {kind!r}")
    if kind == "orthogonal":
        return random_orthogonal(shape, d, generator)
    if condition < 1:
        raise ValueError(f"--condition must be >= 1, got {condition}")
    sigma = torch.logspace(-0.5, 0.5, d, base=condition, dtype=torch.float64)
    u, v = random_orthogonal(shape, d, generator), random_orthogonal(shape, d, generator)
    return (u * sigma) @ v.mT


def exact_sectors(config) -> dict[str, bool]:
    """Whether the gauge of each sector is an exact symmetry of the forward pass with the mean biases: not when a
    sampled b_Q (b_V) of nonzero mean enters (μ_Q·S⁻¹k ≠ μ_Q·k; (vT + μ_V)T⁻¹ ≠ v + μ_V). b_K cancels in the softmax;
    learned biases are factor rows and are transformed with them."""
    uses_q, uses_v = config.sampled_biases
    return {"QK": not (uses_q and config.mean_q != 0), "VO": not (uses_v and config.mean_v != 0)}


def copy_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """An independent copy of `model` in `dtype` on its device (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        clone = type(model)(model.config)
    clone.load_state_dict(model.state_dict())
    return clone.to(device=next(model.parameters()).device, dtype=dtype)


def one_step(model: nn.Module, optimizer: str, optim_cfg, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Attention parameters after one step of a fresh `optimizer` on (x, y) with the mean biases (model changed)."""
    spec = OPTIMIZERS[optimizer]
    if optimizer == "sgdm":  # SGDM's random initial velocity is one array for both representatives, which no gauge
        optim_cfg = dataclasses.replace(optim_cfg, initial_velocity_std=0.0)  # moves: measure the rule from rest
    opt = spec.build(model, optim_cfg)
    loss = model(x, y)[1]
    loss.backward()
    opt.step(loss.detach()) if spec.needs_loss else opt.step()
    return attention_parameters(model)  # of a model nobody steps again


def _inverse_gauge(factors: dict[str, Tensor], s_qk: Tensor, s_vo: Tensor) -> dict[str, Tensor]:
    """Map one layer's factors of the gauged representative back: Â_Q S⁻¹, Â_K Sᵀ, Â_V T⁻¹, T B_O."""
    return {"Q": torch.linalg.solve(s_qk.mT, factors["Q"].mT).mT, "K": factors["K"] @ s_qk.mT,
            "V": torch.linalg.solve(s_vo.mT, factors["V"].mT).mT, "O": s_vo @ factors["O"]}


def _products(f: dict[str, Tensor]) -> dict[str, Tensor]:
    return {"QK": f["Q"] @ f["K"].mT, "VO": f["V"] @ f["O"]}


def _pairs(f: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """(A, B) of each sector with M = A Bᵀ: QK (Â_Q, Â_K), VO (Â_V, B_Oᵀ)."""
    return {"QK": (f["Q"], f["K"]), "VO": (f["V"], f["O"].mT)}


def gram_balance(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(gauge.updates.gram_imbalance, max_j max(ρ_j, 1/ρ_j) with ρ_j = RMS of A's column j / RMS of B's column
    j), per head (docs/gauge.md#quotient-aware-updates)."""
    imbalance = gram_imbalance(a, b)
    ratio = a.square().mean(-2).sqrt() / b.square().mean(-2).sqrt().clamp_min(1e-300)
    return imbalance, torch.maximum(ratio, 1 / ratio.clamp_min(1e-300)).amax(-1)


def gauge_diagnostic(model: nn.Module, optimizer: str, optim_cfg, x: Tensor, y: Tensor, kind: str = "gl",
                     condition: float = 10.0, samples: int = 4, seed: int = 0, dtype: torch.dtype = torch.float64,
                     tolerance: float = 1e-6, progress: bool = False) -> dict:
    """The diagnostic on one batch (see the module docstring). Returns per-head (L×H lists) and summary (means over
    heads) metrics per sector, the relative logit change of each sampled gauge and which sectors are exact.

    Raises if the gauge is exact for the model but the logits change by more than `tolerance` (relative to max|logit|).
    """
    cfg = model.config
    n_head, d = cfg.n_head, cfg.head_dim
    base = copy_model(model, dtype)
    params0 = attention_parameters(base)  # base itself never changes
    n_layer = num_attention_layers(params0)
    with torch.no_grad():
        logits0 = base(x, all_logits=True)[0].double()
    after0 = one_step(copy_model(base, dtype), optimizer, optim_cfg, x, y)
    shared = cfg.bias_mode == "learned" and not cfg.bias_per_head  # one S per layer: shared learned bias rows
    generator = torch.Generator().manual_seed(seed)
    exact = exact_sectors(cfg)
    gauged, logit_change = [], []
    for i in range(samples):
        shape = (n_layer, 1) if shared else (n_layer, n_head)
        s_qk, s_vo = (random_gauges(shape, d, kind, condition, generator).expand(n_layer, n_head, d, d).to(x.device)
                      for _ in SECTORS)
        before = gauge_transformed(params0, n_head, s_qk, s_vo)
        clone = copy_model(base, dtype)
        for name, param in attention_parameters(clone).items():
            param.copy_(before[name])
        with torch.no_grad():
            change = ((clone(x, all_logits=True)[0].double() - logits0).abs().max() / logits0.abs().max()).item()
        logit_change.append(change)
        if all(exact.values()) and not change <= tolerance:
            raise AssertionError(f"gauge sample {i}: the logits changed by {change:.3g} (relative) under an exact "
                                 f"gauge (tolerance {tolerance:g}); the gauge transform is broken")
        gauged.append((before, one_step(clone, optimizer, optim_cfg, x, y), s_qk, s_vo))
        if progress:
            print(f"gauge sample {i + 1}/{samples}: logit change {change:.3g}")
    per_head: dict[str, list] = {}  # "{metric}_{sector}": one list of H per layer
    for layer in range(n_layer):
        f0, f1 = head_factors(params0, layer, n_head), head_factors(after0, layer, n_head)
        p0, p1 = _products(f0), _products(f1)
        reference = {s: p1[s] - p0[s] for s in SECTORS}
        moves, imbalances = {s: [] for s in SECTORS}, {s: [] for s in SECTORS}
        for before, after, s_qk, s_vo in gauged:
            g0, g1 = head_factors(before, layer, n_head), head_factors(after, layer, n_head)
            for s, (a, b) in _pairs(g0).items():
                imbalances[s].append(gram_balance(a, b))
            q0, q1 = (_products(_inverse_gauge(g, s_qk[layer], s_vo[layer])) for g in (g0, g1))
            for s in SECTORS:
                moves[s].append(q1[s] - q0[s])
        for s in SECTORS:
            # No motion (e.g. SOAP's first step only builds its preconditioner): the relative metrics are undefined.
            scale = torch.where(matrix_norm(reference[s]) > 0, matrix_norm(reference[s]), torch.nan)
            stacked = torch.stack(moves[s])  # (samples, H, rows, cols)
            mean_move = stacked.mean(0)
            rel = matrix_norm(stacked - reference[s]) / scale  # (samples, H)
            imbalance, rms_ratio = gram_balance(*_pairs(f0)[s])
            values = {
                "relative_difference": rel.mean(0), "relative_difference_var": rel.var(0, correction=0),
                "random_gauge_variance": matrix_norm(stacked - mean_move).square().mean(0) / scale.square(),
                "smoothed_difference": matrix_norm(mean_move - reference[s]) / scale,
                "gram_imbalance": imbalance,
                "gram_imbalance_gauged": torch.stack([g[0] for g in imbalances[s]]).mean(0),
                "column_rms_ratio": rms_ratio,
                "column_rms_ratio_gauged": torch.stack([g[1] for g in imbalances[s]]).mean(0),
            }
            for k, v in values.items():
                per_head.setdefault(f"{k}_{s}", []).append(v.tolist())
    summary = {k: float(np.mean(v)) for k, v in per_head.items()}
    return {"optimizer": optimizer, "gauge": kind, "condition": condition if kind == "gl" else 1.0,
            "samples": samples, "seed": seed, "dtype": str(dtype).replace("torch.", ""), "exact": exact,
            "logit_change": logit_change, "summary": summary, "per_head": per_head}


def diagnostic_summary(model: nn.Module, optimizer: str, optim_cfg, x: Tensor, y: Tensor, step: int) -> dict:
    """The trainer's `--gauge-diagnostic-every N` record: one GL(d) gauge (condition 10, seeded by the step) in
    float64, the mean over heads of the relative ΔM difference per sector (keys gauge_dM_QK, gauge_dM_VO) and the
    relative logit change (gauge_logit_change), not asserted. Costs three float64 copies of the model (one at a
    time besides the first), two forward passes and two forward/backward passes with fresh optimizer steps on (x, y)."""
    result = gauge_diagnostic(model, optimizer, optim_cfg, x, y, samples=1, seed=step, tolerance=math.inf)
    return {"gauge_dM_QK": result["summary"]["relative_difference_QK"],
            "gauge_dM_VO": result["summary"]["relative_difference_VO"],
            "gauge_logit_change": result["logit_change"][0]}
