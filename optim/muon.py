"""Muon for the hidden matrices with AdamW for everything else: the speedrunner's baseline (Jordan et al. 2024).

Muon (github.com/KellerJordan/Muon, modded-nanogpt): Nesterov momentum, then the update is orthogonalised by
5 quintic Newton–Schulz iterations in bf16 with coefficients (3.4445, −4.7750, 2.0315) and scaled by
sqrt(max(1, rows/cols)). The fused QKV matrix (`attn.c_attn.weight`, 3C×C) is orthogonalised as three C×C blocks,
as the speedrun does with its separate q, k, v. Embeddings, the (tied) head, gains, biases and PReLU slopes use
AdamW (torch's formula, its moments in kernels/soap.py's torch step). Matrices are owned whole by one rank; the
AdamW parameters are split by element.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cli import flag
from optim.base import adam_scale, check_arguments
from optim.distributed import ShardedOptimizer
from optim.registry import (DECAY_GROUPS, EMBEDDING_PREFIXES, OptimizerSpec, ShardedOptimizerConfig, parameter_groups,
                            state_dtype)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


@dataclass
class MuonConfig(ShardedOptimizerConfig):
    """Muon for hidden matrices, AdamW for the rest, with the KellerJordan/Muon recipe's defaults."""

    lr: float = flag(3e-4, "learning rate of the AdamW part (embeddings, head, gains, biases)",
                     bounds="> 0")
    weight_decay: float = flag(0.01, "decoupled weight decay of the decayed parameters (--decay-groups)",
                                bounds=">= 0")
    decay_groups: str = flag("matrices", "parameters that weight decay acts on: matrices (the speedrun's "
                             "convention), all, matrices+embeddings or all-but-embeddings "
                             "(docs/optimizers.md#weight-decay-groups)", choices=DECAY_GROUPS)
    beta1: float = flag(0.9, "AdamW part: first-moment decay", bounds="[0, 1)")
    beta2: float = flag(0.95, "AdamW part: second-moment decay", bounds="[0, 1)")
    eps: float = flag(1e-10, "AdamW part: denominator epsilon", bounds=">= 0")
    muon_lr: float = flag(0.02, "learning rate of the hidden matrices", bounds="> 0")
    muon_momentum: float = flag(0.95, "momentum coefficient", bounds="[0, 1)")
    muon_nesterov: bool = flag(True, "Nesterov momentum")
    muon_ns_steps: int = flag(5, "Newton-Schulz iterations", bounds=">= 1")


def zeropower_via_newtonschulz5(g: Tensor, steps: int = 5) -> Tensor:
    """Approximate U Vᵀ of g = U S Vᵀ (batched over leading dims) with the quintic Newton–Schulz iteration in bf16.

    The iteration maps singular values into roughly [0.7, 1.2] rather than exactly 1: the speedrun's trade of
    accuracy for a steep slope at zero. Each iteration is three batched products with the coefficients folded in
    (X ← a·X + (b·A + c·A²)·X with A = X Xᵀ: bmm, then two baddbmm, as modded-nanogpt does), into buffers
    allocated once: no elementwise pass over the matrices inside the loop.
    """
    a, b, c = NS_COEFFICIENTS
    shape = g.shape
    x = g.bfloat16().reshape(-1, *shape[-2:])  # a no-op on the optimizer's bf16 input
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True, dtype=torch.float32).add_(1e-7)  # spectral <= Frobenius: now <= 1
    x = torch.div(x, norm, out=torch.empty(x.shape, dtype=torch.bfloat16, device=x.device))
    gram = x.new_empty(x.shape[0], x.size(-2), x.size(-2))
    poly, following = torch.empty_like(gram), torch.empty_like(x)
    for _ in range(steps):
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        torch.baddbmm(x, poly, x, beta=a, out=following)
        x, following = following, x
    return (x.mT if tall else x).reshape(shape)


def is_hidden_matrix(name: str, param: Tensor) -> bool:
    """Muon's share: weight matrices that are neither embeddings nor the head (per-head biases (H, d) are not)."""
    embedding_or_head = name.startswith((*EMBEDDING_PREFIXES, "lm_head"))
    return param.dim() >= 2 and name.endswith(".weight") and not embedding_or_head


class Muon(ShardedOptimizer):
    """Muon + AdamW in one optimizer: groups with use_muon=True hold 2-D hidden matrices, the rest use AdamW."""

    def __init__(
        self,
        params,
        lr: float = MuonConfig.lr,
        weight_decay: float = MuonConfig.weight_decay,
        beta1: float = MuonConfig.beta1,
        beta2: float = MuonConfig.beta2,
        eps: float = MuonConfig.eps,
        muon_lr: float = MuonConfig.muon_lr,
        muon_momentum: float = MuonConfig.muon_momentum,
        muon_nesterov: bool = MuonConfig.muon_nesterov,
        muon_ns_steps: int = MuonConfig.muon_ns_steps,
        optim_state_dtype: str = MuonConfig.optim_state_dtype,
    ) -> None:
        check_arguments(MuonConfig, locals())
        self.momentum, self.nesterov, self.ns_steps = muon_momentum, muon_nesterov, muon_ns_steps
        self.betas, self.eps = (beta1, beta2), eps
        params = [dict(group, lr=group.get("lr", muon_lr if group.get("use_muon") else lr)) for group in params]
        super().__init__(
            params,
            dict(lr=lr, weight_decay=weight_decay, use_muon=False),
            tensor_owned=lambda i: self.param_groups[self.group_of[i]]["use_muon"],
            layout_key=self._batch_key,
        )
        for group in self.param_groups:
            if group["use_muon"] and any(p.dim() < 2 for p in group["params"]):
                raise ValueError("Muon: use_muon groups may only hold matrices (dim >= 2)")
        muon = [r for r in self.regions if r.tensor_owned]
        adam = [r for r in self.regions if not r.tensor_owned]
        dtype = state_dtype(optim_state_dtype, self.params_in_order)
        self.new_flat_state("momentum_buffer", dtype, muon)
        self.new_flat_state("exp_avg", dtype, adam)
        self.new_flat_state("exp_avg_sq", dtype, adam)
        # Per region: spans of same-shaped matrices (one Newton–Schulz batch each) or of one group (AdamW), and a
        # scratch buffer (the bf16 Newton–Schulz input, or AdamW's denominator) allocated once.
        self.spans = [region.spans(self._batch_key if region.tensor_owned else self.group_of.__getitem__)
                      for region in self.regions]
        self.scratch = [torch.empty(r.chunk, device=r.params.device, dtype=torch.bfloat16 if r.tensor_owned
                                    else torch.promote_types(r.params.dtype, torch.float32)) for r in self.regions]
        from kernels import bf16, soap  # Triton: imported when an optimizer is built, not with this module

        self.copy_back, self.adam_moments = bf16.copy_back, soap.moments_reference

    def blocks_of(self, index: int) -> int:
        """The fused QKV matrix (3C×C) is orthogonalised as three C×C blocks; other matrices whole."""
        name, shape = self.names[index], self.params_in_order[index].shape
        return 3 if name.endswith("attn.c_attn.weight") and shape[0] == 3 * shape[1] else 1

    def _batch_key(self, index: int) -> tuple:
        """Matrices with equal keys are orthogonalised as one batch: (group, rows of a block, columns)."""
        shape = self.params_in_order[index].shape
        return self.group_of[index], shape.numel() // (self.blocks_of(index) * shape[-1]), shape[-1]

    def host_scalars(self) -> dict[str, float]:
        """Each group's decay and step coefficient (−ℓ for the matrices, whose per-shape scale is a constant; −ℓ·s for
        the AdamW part, s its bias correction at this step) and the AdamW part's ε, bias-corrected
        (optim.base.adam_scale)."""
        values = super().host_scalars()
        scale, values["eps"] = adam_scale(*self.betas, self.eps, self.calls + 1)
        for g, group in enumerate(self.param_groups):
            values[f"step{g}"] = -group["lr"] * (1.0 if group["use_muon"] else scale)
        return values

    @torch.no_grad()
    def update(self, loss=None) -> None:
        for j, (region, g) in enumerate(zip(self.regions, self.reduced_gradients())):
            if region.tensor_owned:
                self._muon(j, region, g, self.flat_state["momentum_buffer"][j])
            else:
                self._adamw(j, region, g, self.flat_state["exp_avg"][j], self.flat_state["exp_avg_sq"][j])
            region.gather_params()

    def first_moment_of(self, index: int) -> tuple[str, bool]:
        """The momentum of the matrices (the step moves along it), Adam's m elsewhere."""
        return ("momentum_buffer", True) if self.param_groups[self.group_of[index]]["use_muon"] else ("exp_avg", False)

    def _muon(self, j: int, region, g: Tensor, buf_state: Tensor) -> None:
        compute = torch.promote_types(g.dtype, torch.float32)
        buf, g, update = buf_state.to(compute), g.to(compute), self.scratch[j]  # update: Newton–Schulz's bf16 input
        buf.lerp_(g, 1 - self.momentum)
        torch.lerp(g, buf, self.momentum, out=update) if self.nesterov else update.copy_(buf)
        self.copy_back([buf_state], [buf])
        theta = region.local_params
        for span in self.spans[j]:  # adjacent matrices of one shape: views, no copies
            group, rows, cols = span.key
            ortho = zeropower_via_newtonschulz5(span.of(update).view(-1, rows, cols), self.ns_steps)
            self.decoupled_step(span.of(theta).view(-1, rows, cols), ortho, group, value=max(1.0, rows / cols) ** 0.5)

    def _adamw(self, j: int, region, g: Tensor, m: Tensor, v: Tensor) -> None:
        """torch's AdamW, its bias corrections folded into the staged step coefficient and ε (optim.base.adam_scale)."""
        direction = self.scratch[j]
        self.adam_moments(g, m, v, direction, None, *self.betas, self.staged("eps", direction.dtype))
        theta = region.local_params
        for span in self.spans[j]:
            self.decoupled_step(span.of(theta), span.of(direction), span.key)


def muon_groups(model: nn.Module, cfg: MuonConfig) -> list[dict]:
    """`parameter_groups` split into a Muon part (hidden matrices, use_muon: lr muon_lr) and an AdamW part (lr)."""
    groups = []
    for group in parameter_groups(model, cfg):
        for use_muon in (True, False):
            members = [(n, p) for n, p in zip(group["names"], group["params"]) if is_hidden_matrix(n, p) == use_muon]
            if members:
                groups.append({"params": [p for _, p in members], "names": [n for n, _ in members],
                               "weight_decay": group["weight_decay"], "use_muon": use_muon})
    return groups


MUON_SPEC = OptimizerSpec(
    name="muon",
    optimizer=Muon,
    config=MuonConfig,
    groups=muon_groups,
    reduces_gradients=True,
    description="Muon (Newton-Schulz in bf16) for hidden matrices + AdamW for the rest",
)
