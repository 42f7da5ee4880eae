"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024), exactly as docs/optimizers.md#soap.

Behaviour of the published implementation: the first step only accumulates the Kronecker factors L = E[GGᵀ],
R = E[GᵀG] and takes their eigenbases (no parameter update); later steps run Adam on G' = Q_Lᵀ G Q_R, map the
normalised moment back, apply decoupled weight decay, then update L, R with the current gradient; every
`precondition_frequency` steps the bases are refreshed by one sorted power-iteration step + QR.
Sharding: tensors with a rotated dim are owned whole by one rank (so the eigenbasis work is spread over ranks),
tensors without one are plain Adam and are split by element (`optim.distributed`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from cli import flag
from optim.distributed import ShardedOptimizer
from optim.registry import OptimizerSpec, ShardedOptimizerConfig, state_dtype


@dataclass
class SOAPConfig(ShardedOptimizerConfig):
    """SOAP's hyperparameters with the paper's defaults (docs/model.md#the-papers-model)."""

    lr: float = flag(3e-4, "peak learning rate", bounds="> 0")
    weight_decay: float = flag(0.01, "decoupled weight decay of the decayed parameters (--decay-groups)",
                                bounds=">= 0")
    beta1: float = flag(0.95, "first-moment decay", bounds="[0, 1)")
    beta2: float = flag(0.95, "second-moment decay (and the Kronecker factors' unless --soap-shampoo-beta)",
                        bounds="[0, 1)")
    eps: float = flag(1e-8, "denominator epsilon", bounds="> 0")
    soap_precondition_frequency: int = flag(10, "steps between eigenbasis refreshes", bounds=">= 1")
    soap_max_precond_dim: int = flag(10000, "dims larger than this get no rotation (0: plain Adam)", bounds=">= 0")
    soap_merge_dims: bool = flag(False, "merge small dims before preconditioning")
    soap_precondition_1d: bool = flag(False, "also rotate 1-D parameters")
    soap_shampoo_beta: float = flag(-1.0, "decay of the Kronecker factors (negative: --beta2)",
                                     bounds="< 1")


def merged_shape(shape: torch.Size, max_precond_dim: int) -> tuple[int, ...]:
    """The published `merge_dims`: fuse consecutive dims while their product stays <= max_precond_dim."""
    merged, current = [], 1
    for size in shape:
        if current * size > max_precond_dim:
            if current > 1:
                merged.append(current)
                current = size
            else:
                merged.append(size)
                current = 1
        else:
            current *= size
    if current > 1 or not merged:
        merged.append(current)
    return tuple(merged)


def project(x: Tensor, bases: list[Tensor | None]) -> Tensor:
    """x → x ×_k Q_kᵀ along every dim k (identity where Q_k is None); dims come back in order."""
    for q in bases:
        x = torch.tensordot(x, q, dims=([0], [0])) if q is not None else x.permute(*range(1, x.dim()), 0)
    return x


def project_back(x: Tensor, bases: list[Tensor | None]) -> Tensor:
    """Inverse of `project`: x → x ×_k Q_k along every dim k."""
    for q in bases:
        x = torch.tensordot(x, q, dims=([0], [1])) if q is not None else x.permute(*range(1, x.dim()), 0)
    return x


def gram(x: Tensor, dim: int) -> Tensor:
    """Contract x with itself over every dim but `dim` (GGᵀ for dim 0 of a matrix, GᵀG for dim 1)."""
    others = [k for k in range(x.dim()) if k != dim]
    return torch.tensordot(x, x, dims=(others, others))


def eigenbasis(factor: Tensor) -> Tensor:
    """Eigenvectors of a symmetric factor, columns by descending eigenvalue (float64 retry if eigh fails)."""
    eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    try:
        _, q = torch.linalg.eigh(factor + 1e-30 * eye)
    except RuntimeError:
        _, q = torch.linalg.eigh(factor.double() + 1e-30 * eye.double())
        q = q.to(factor.dtype)
    return torch.flip(q, [1])


class SOAP(ShardedOptimizer):
    """SOAP (docs/optimizers.md). Groups carry lr and weight_decay; betas, eps and the preconditioner settings are
    global."""

    moments_in_parameter_basis = False  # m and v live in the eigenbasis of each rotated tensor

    def __init__(
        self,
        params,
        lr: float = SOAPConfig.lr,
        weight_decay: float = SOAPConfig.weight_decay,
        beta1: float = SOAPConfig.beta1,
        beta2: float = SOAPConfig.beta2,
        eps: float = SOAPConfig.eps,
        soap_precondition_frequency: int = SOAPConfig.soap_precondition_frequency,
        soap_max_precond_dim: int = SOAPConfig.soap_max_precond_dim,
        soap_merge_dims: bool = SOAPConfig.soap_merge_dims,
        soap_precondition_1d: bool = SOAPConfig.soap_precondition_1d,
        soap_shampoo_beta: float = SOAPConfig.soap_shampoo_beta,
        optim_state_dtype: str = SOAPConfig.optim_state_dtype,
        grad_clip: float = 0.0,
        overlap_reduce: bool = True,
    ) -> None:
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"SOAP: --beta1/--beta2 must lie in [0, 1), got {beta1}, {beta2}")
        if soap_precondition_frequency < 1:
            raise ValueError(f"SOAP: --soap-precondition-frequency must be >= 1, got {soap_precondition_frequency}")
        if soap_max_precond_dim < 0:
            raise ValueError(f"SOAP: --soap-max-precond-dim must be >= 0, got {soap_max_precond_dim}")
        if eps <= 0:
            raise ValueError(f"SOAP: --eps must be > 0, got {eps}")
        self.betas, self.eps = (beta1, beta2), eps
        self.shampoo_beta = beta2 if soap_shampoo_beta < 0 else soap_shampoo_beta
        self.precondition_frequency, self.max_precond_dim = soap_precondition_frequency, soap_max_precond_dim
        self.merge_dims, self.precondition_1d = soap_merge_dims, soap_precondition_1d
        super().__init__(
            params,
            dict(lr=lr, weight_decay=weight_decay),
            tensor_owned=lambda i: any(self._rotated(self.params_in_order[i].shape)),
            grad_clip=grad_clip,
            overlap_reduce=overlap_reduce,
        )
        dtype = state_dtype(optim_state_dtype, self.params_in_order)
        self.shapes = [self._shape(p.shape) for p in self.params_in_order]
        self.new_flat_state("exp_avg", dtype)
        self.new_flat_state("exp_avg_sq", dtype)
        self.factors: dict[int, list[Tensor | None]] = {}  # L, R per owned rotated tensor (None: no rotation)
        self.bases: dict[int, list[Tensor | None]] = {}  # Q_L, Q_R

    def _shape(self, shape: torch.Size) -> tuple[int, ...]:
        if self.merge_dims and len(shape) > 1:
            return merged_shape(shape, self.max_precond_dim)
        return tuple(shape)

    def _rotated(self, shape: torch.Size) -> list[bool]:
        if len(shape) == 0:
            return []
        if len(shape) == 1:
            return [self.precondition_1d and shape.numel() <= self.max_precond_dim]
        return [size <= self.max_precond_dim for size in self._shape(shape)]

    def _owned_rotated(self):
        """(index, gradient chunk index, piece) of the rotated tensors this rank owns."""
        for j, region in enumerate(self.regions):
            if region.tensor_owned:
                for piece in region.pieces:
                    yield piece.index, j, piece

    def _update_factors(self, i: int, g: Tensor) -> None:
        for dim, factor in enumerate(self.factors[i]):
            if factor is not None:
                factor.lerp_(gram(g, dim), 1 - self.shampoo_beta)

    def _refresh(self, i: int, m: Tensor, v: Tensor) -> None:
        """Sorted power iteration + QR on each basis; m moves to the new basis, v is re-indexed (docs/optimizers.md)."""
        m_original = project_back(m, self.bases[i])
        for dim, (factor, q) in enumerate(zip(self.factors[i], self.bases[i])):
            if factor is None:
                continue
            order = torch.argsort(torch.diag(q.T @ factor @ q), descending=True)
            v.copy_(v.index_select(dim, order))
            self.bases[i][dim] = torch.linalg.qr(factor @ q[:, order]).Q
        m.copy_(project(m_original, self.bases[i]))
        self._expose(i)

    def _expose(self, i: int) -> None:
        state = self.state[self.params_in_order[i]]
        for dim, (factor, q) in enumerate(zip(self.factors[i], self.bases[i])):
            if factor is not None:
                state[f"GG{dim}"], state[f"Q{dim}"] = factor, q

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self.reduced_gradients()
        if self.calls == 0:  # accumulate the factors and take eigenbases; no update (published behaviour)
            for i, j, piece in self._owned_rotated():
                g = piece.of(grads[j]).view(self.shapes[i]).to(torch.promote_types(grads[j].dtype, torch.float32))
                self.factors[i] = [
                    torch.zeros(size, size, dtype=g.dtype, device=g.device) if rot else None
                    for size, rot in zip(self.shapes[i], self._rotated(self.params_in_order[i].shape))
                ]
                self._update_factors(i, g)
                self.bases[i] = [eigenbasis(f) if f is not None else None for f in self.factors[i]]
                self._expose(i)
            self.calls = 1
            return loss
        t = self.calls
        beta1, beta2 = self.betas
        scale = math.sqrt(1 - beta2**t) / (1 - beta1**t)
        for j, region in enumerate(self.regions):
            g = grads[j]
            compute = torch.promote_types(g.dtype, torch.float32)
            m_state, v_state = self.flat_state["exp_avg"][j], self.flat_state["exp_avg_sq"][j]
            m, v = m_state.to(compute), v_state.to(compute)
            rotated = [(i, piece) for i, jj, piece in self._owned_rotated() if jj == j]
            g_rot = g.to(compute, copy=bool(rotated))
            for i, piece in rotated:
                piece.of(g_rot).copy_(project(piece.of(g).view(self.shapes[i]).to(compute), self.bases[i]).reshape(-1))
            m.mul_(beta1).add_(g_rot, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g_rot, g_rot, value=1 - beta2)
            direction = m / (v.sqrt() + self.eps)
            for i, piece in rotated:
                d = piece.of(direction)
                d.copy_(project_back(d.view(self.shapes[i]), self.bases[i]).reshape(-1))
            theta = region.local_params
            for piece in region.pieces:
                group = self.param_groups[self.group_of[piece.index]]
                p = piece.of(theta)
                p.add_(piece.of(direction).to(p.dtype), alpha=-group["lr"] * scale)
                if group["weight_decay"] > 0:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
            for i, piece in rotated:
                self._update_factors(i, piece.of(g).view(self.shapes[i]).to(compute))
                if t % self.precondition_frequency == 0:
                    self._refresh(i, piece.of(m).view(self.shapes[i]), piece.of(v).view(self.shapes[i]))
            if m is not m_state:
                m_state.copy_(m)
                v_state.copy_(v)
            region.gather_params()
        self.calls += 1
        return loss

    def _tensor_state(self, index: int) -> dict:
        region = self.region_of[index]
        if not region.tensor_owned or self.calls == 0:
            return {}
        owner, mine = region.owner[index], region.owner[index] == region.rank
        out = {}
        dtype = torch.promote_types(region.params.dtype, torch.float32)
        for dim, (size, rot) in enumerate(zip(self.shapes[index], self._rotated(self.params_in_order[index].shape))):
            if not rot:
                continue
            for name, source in ((f"GG{dim}", self.factors), (f"Q{dim}", self.bases)):
                if mine:  # contiguous: QR returns column-major Q and collectives send raw memory
                    tensor = source[index][dim].clone(memory_format=torch.contiguous_format)
                else:
                    tensor = torch.empty(size, size, dtype=dtype, device=region.params.device)
                if region.world_size > 1:
                    dist.broadcast(tensor, src=owner)
                out[name] = tensor
        return out

    def _load_tensor_state(self, index: int, state: dict) -> None:
        region = self.region_of[index]
        saved = any(key.startswith("GG") for key in state)  # absent when saved before the first step
        if not region.tensor_owned or region.owner[index] != region.rank or not saved:
            return
        device, dtype = region.params.device, torch.promote_types(region.params.dtype, torch.float32)
        rotated = self._rotated(self.params_in_order[index].shape)
        self.factors[index] = [state[f"GG{d}"].to(device, dtype).clone() if r else None for d, r in enumerate(rotated)]
        self.bases[index] = [state[f"Q{d}"].to(device, dtype).clone() if r else None for d, r in enumerate(rotated)]
        self._expose(index)



SOAP_SPEC = OptimizerSpec(
    name="soap",
    optimizer=SOAP,
    config=SOAPConfig,
    reduces_gradients=True,
    description="SOAP, Adam in Shampoo's eigenbasis (docs/optimizers.md#soap)",
)
