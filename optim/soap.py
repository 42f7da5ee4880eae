"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024), exactly as docs/optimizers.md#soap.

Behaviour of the published implementation: the first step only accumulates the Kronecker factors L = E[GGᵀ],
R = E[GᵀG] and takes their eigenbases (no parameter update); later steps run Adam on G' = Q_Lᵀ G Q_R, map the
normalised moment back, apply decoupled weight decay, then update L, R with the current gradient; every
`precondition_frequency` steps the bases are refreshed by one sorted power-iteration step + QR.
Sharding: tensors with a rotated dim are owned whole by one rank (so the eigenbasis work is spread over ranks),
tensors without one are plain Adam and are split by element (`optim.distributed`).

Speed: each rank's rotated tensors of one shape (the layers' c_attn, c_fc, ...) lie next to each other in its flat
buffers (`layout_key`), so each projection, back-projection, factor update and refresh is one batched matrix product
over all of them, with no copies; a refresh takes one GEMM F·Q per factor (`refresh_basis`); the last
back-projection, the step and the weight decay are one baddbmm into the parameters; the elementwise Adam step is
kernels/soap.py's (one Triton kernel on CUDA, its PyTorch reference elsewhere).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from cli import flag
from optim.base import adam_scale, check_arguments, mixed_seed
from optim.distributed import ShardedOptimizer, Span
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
    optim_seed: int = flag(0, "seed of the stochastic rounding of bf16 moments (--optim-state-dtype bf16, fused)",
                           bounds=">= 0")
    fused: bool = flag(True, "on CUDA with fp32 parameters: the elementwise step in one Triton kernel "
                             "(kernels/soap.py, bf16 moments rounded stochastically); off: its PyTorch reference")


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


def contract(x: Tensor, q: Tensor, dim: int, out: Tensor | None = None) -> Tensor:
    """y = x ×_dim qᵀ for a batch x (B, *shape) and matrices q (B, d, d): y[.., i, ..] = Σ_j x[.., j, ..] q[j, i]
    along dim `dim` of each tensor, as one batched matrix product (no copy for the first and last dims). `out`
    receives the result when `dim` is the last dim (else the caller copies)."""
    axis = dim + 1
    moved = x.movedim(axis, -1)
    rows = moved.reshape(x.shape[0], -1, q.shape[-1])
    if out is not None and axis == x.dim() - 1:
        return torch.bmm(rows, q, out=out.view(rows.shape)).view(x.shape)
    return torch.bmm(rows, q).view(moved.shape).movedim(-1, axis)


def rotate(x: Tensor, bases: list[Tensor | None], back: bool = False, out: Tensor | None = None) -> Tensor:
    """Into the eigenbasis, x → x ×_k Q_kᵀ along every rotated dim k (back: x → x ×_k Q_k), for a batch x (B, *shape)
    and stacked bases Q_k (B, d_k, d_k) (None: dim k is not rotated); the result is written to `out` if given."""
    dims = [k for k, q in enumerate(bases) if q is not None]
    for k in dims:
        q = bases[k].mT if back else bases[k]
        x = contract(x, q, k, out if k == dims[-1] else None)
    if out is not None and x.data_ptr() != out.data_ptr():
        out.copy_(x)
    return x


def accumulate_gram(factor: Tensor, x: Tensor, dim: int, beta: float) -> None:
    """factor ← β·factor + (1−β)·x_(dim) x_(dim)ᵀ, contracting every dim of each tensor of the batch x but `dim`
    (G Gᵀ for dim 0 of a matrix, Gᵀ G for dim 1): one batched GEMM."""
    rows = x.movedim(dim + 1, 1).reshape(x.shape[0], x.shape[dim + 1], -1)
    factor.baddbmm_(rows, rows.mT, beta=beta, alpha=1 - beta)


def eigenbasis(factor: Tensor) -> Tensor:
    """Eigenvectors of symmetric factors (B, d, d), columns by descending eigenvalue (float64 retry if eigh fails)."""
    eye = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    try:
        _, q = torch.linalg.eigh(factor + 1e-30 * eye)
    except RuntimeError:
        _, q = torch.linalg.eigh(factor.double() + 1e-30 * eye.double())
        q = q.to(factor.dtype)
    return torch.flip(q, [-1]).contiguous()  # row-major (eigh returns column-major), as a loaded state is


def refresh_basis(factor: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """One sorted power-iteration step with QR (docs/optimizers.md#soap) from one GEMM F·Q: the estimated eigenvalues
    diag(Qᵀ F Q) are the column sums of Q ∘ (F Q), and the power step is F Q with its columns sorted. Returns the new
    bases and the order (B, d) of the old columns, by descending estimated eigenvalue."""
    fq = torch.bmm(factor, q)
    order = (q * fq).sum(1).argsort(dim=-1, descending=True)
    q_new = torch.linalg.qr(torch.take_along_dim(fq, order[:, None, :], dim=2)).Q
    return q_new.contiguous(), order  # row-major, as in `eigenbasis`


class Batch:
    """This rank's rotated tensors of one (parameter group, rotated shape, rotated dims), adjacent in its chunk
    (`optim.distributed.Region`'s layout): (count, *shape) views of the flat buffers, with their Kronecker factors
    and bases stacked (count, d, d) per rotated dim (None for a dim that is not rotated)."""

    def __init__(self, span: Span) -> None:
        self.group, self.shape, self.rotated = span.key
        self.indices = [piece.index for piece in span.pieces]
        self.lo, self.hi = span.lo, span.hi
        self.factors: list[Tensor | None] = [None] * len(self.shape)
        self.bases: list[Tensor | None] = [None] * len(self.shape)

    def view(self, flat: Tensor) -> Tensor:
        return flat[self.lo : self.hi].view(len(self.indices), *self.shape)

    def allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        """Zero factors and bases for the rotated dims."""
        for dim, (size, rot) in enumerate(zip(self.shape, self.rotated)):
            if rot:
                self.factors[dim] = torch.zeros(len(self.indices), size, size, dtype=dtype, device=device)
                self.bases[dim] = torch.zeros_like(self.factors[dim])


class SOAP(ShardedOptimizer):
    """SOAP (docs/optimizers.md); the keyword arguments are SOAPConfig's fields. Groups carry lr and weight_decay;
    betas, eps and the preconditioner settings are global. bf16 m, v round to nearest in the PyTorch reference."""

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
        optim_seed: int = SOAPConfig.optim_seed,
        optim_state_dtype: str = SOAPConfig.optim_state_dtype,
        fused: bool = SOAPConfig.fused,
    ) -> None:
        check_arguments(SOAPConfig, locals())
        self.betas, self.eps, self.seed = (beta1, beta2), eps, optim_seed
        self.shampoo_beta = beta2 if soap_shampoo_beta < 0 else soap_shampoo_beta
        self.precondition_frequency, self.max_precond_dim = soap_precondition_frequency, soap_max_precond_dim
        self.merge_dims, self.precondition_1d = soap_merge_dims, soap_precondition_1d
        super().__init__(
            params,
            dict(lr=lr, weight_decay=weight_decay),
            tensor_owned=lambda i: any(self._rotated(self.params_in_order[i].shape)),
            layout_key=self._batch_key,
        )
        dtype = state_dtype(optim_state_dtype, self.params_in_order)
        self.new_flat_state("exp_avg", dtype)
        self.new_flat_state("exp_avg_sq", dtype)
        self.batches = [[Batch(span) for span in region.spans(self._batch_key)] if region.tensor_owned else []
                        for region in self.regions]
        self.batch_of = {i: (batch, b) for batches in self.batches for batch in batches
                         for b, i in enumerate(batch.indices)}
        self.group_spans = [[] if region.tensor_owned else region.spans(self.group_of.__getitem__)
                            for region in self.regions]
        self.work = [torch.empty(r.chunk, dtype=torch.promote_types(r.params.dtype, torch.float32),
                                 device=r.params.device) for r in self.regions]  # g′, then the direction
        device = self.params_in_order[0].device
        self.fused = fused and self.kernels_run()
        from kernels import soap as soap_kernels  # Triton: imported when a SOAP optimizer is built, not on import

        self.moments = soap_kernels.moments if self.fused else soap_kernels.moments_reference
        first = list(itertools.accumulate([0] + [p.numel() for p in self.params_in_order]))  # element keys
        self.tables = [soap_kernels.block_table([(first[piece.index] + piece.start, piece.offset,
                                                  piece.offset + piece.numel) for piece in region.pieces], device)
                       if self.fused else None for region in self.regions]

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

    def _batch_key(self, index: int) -> tuple:
        """Rotated tensors with equal keys are stepped as one batch: (group, rotated shape, rotated dims)."""
        shape = self.params_in_order[index].shape
        return self.group_of[index], self._shape(shape), tuple(self._rotated(shape))

    def _update_factors(self, batch: Batch, g: Tensor) -> None:
        for dim, factor in enumerate(batch.factors):
            if factor is not None:
                accumulate_gram(factor, g, dim, self.shampoo_beta)

    def _apply(self, theta: Tensor, direction: Tensor, bases: list[Tensor | None], group: int) -> None:
        """θ ← (1 − ℓλ)·θ + c·(direction rotated back), c the group's staged step coefficient: the direction (scratch)
        is scaled in place and the last back-projection accumulates into θ in one baddbmm."""
        dims = [k for k, q in enumerate(bases) if q is not None]
        last = dims[-1]
        y = direction.mul_(self.staged(f"step{group}", direction.dtype))
        for k in dims[:-1]:
            y = contract(y, bases[k].mT, k)
        compute = theta if theta.dtype == y.dtype else theta.to(y.dtype)
        if self.param_groups[group]["weight_decay"]:
            compute.mul_(self.staged(f"decay{group}", compute.dtype))
        if last == y.dim() - 2:
            rows = compute.view(y.shape[0], -1, y.shape[-1])
            rows.baddbmm_(y.reshape(rows.shape), bases[last].mT)
        else:
            compute.add_(contract(y, bases[last].mT, last))
        if compute is not theta:
            theta.copy_(compute)

    def _refresh(self, batch: Batch, m: Tensor, v: Tensor, compute: torch.dtype) -> None:
        """Refresh every basis of the batch (`refresh_basis`); v is re-indexed to match, m is carried into the new
        bases (docs/optimizers.md#soap)."""
        m_original = rotate(m.to(compute), batch.bases, back=True)
        for dim, (factor, q) in enumerate(zip(batch.factors, batch.bases)):
            if factor is None:
                continue
            q_new, order = refresh_basis(factor, q)
            q.copy_(q_new)  # in place: a captured step keeps reading these addresses
            index = order.view(order.shape[0], *(-1 if k == dim else 1 for k in range(len(batch.shape))))
            v.copy_(torch.take_along_dim(v, index, dim=dim + 1))
        m.copy_(rotate(m_original, batch.bases))
        self._expose(batch)

    def _expose(self, batch: Batch) -> None:
        for b, i in enumerate(batch.indices):
            state = self.state[self.params_in_order[i]]
            for dim, (factor, q) in enumerate(zip(batch.factors, batch.bases)):
                if factor is not None:
                    state[f"GG{dim}"], state[f"Q{dim}"] = factor[b], q[b]

    def host_scalars(self) -> dict[str, float]:
        """Each group's decay and step coefficient −ℓ·s·(1 − ℓλ), s Adam's bias correction at this step (the published
        SOAP: ε not bias-corrected; the decay applies after the step)."""
        values = super().host_scalars()
        scale = adam_scale(*self.betas, self.eps, max(self.calls, 1))[0]
        for g, group in enumerate(self.param_groups):
            values[f"step{g}"] = -group["lr"] * scale * values[f"decay{g}"]
        return values

    def first_step_state_bytes(self) -> int:
        """The Kronecker factors and their eigenbases, two (d, d) matrices per rotated dim of size d."""
        if self.calls:
            return 0
        return sum(2 * len(batch.indices) * size * size * work.element_size()
                   for batches, work in zip(self.batches, self.work) for batch in batches
                   for size, rotated in zip(batch.shape, batch.rotated) if rotated)

    def steady_step(self) -> bool:
        """The first step takes the eigenbases and every precondition_frequency-th refreshes them: both run other
        kernels."""
        return self.calls > 0 and self.calls % self.precondition_frequency != 0

    @torch.no_grad()
    def update(self, loss=None) -> None:
        grads = self.reduced_gradients()
        if self.calls == 0:  # accumulate the factors and take eigenbases; no update (published behaviour)
            for batches, g, work in zip(self.batches, grads, self.work):
                for batch in batches:
                    batch.allocate(work.dtype, work.device)
                    self._update_factors(batch, batch.view(g).to(work.dtype))
                    batch.bases = [eigenbasis(f) if f is not None else None for f in batch.factors]
                    self._expose(batch)
            return
        t = self.calls
        beta1, beta2 = self.betas
        seed = mixed_seed(self.seed, t, bits=31)
        refresh = t % self.precondition_frequency == 0
        for j, region in enumerate(self.regions):
            g, work, batches = grads[j], self.work[j], self.batches[j]
            m, v = self.flat_state["exp_avg"][j], self.flat_state["exp_avg_sq"][j]
            for batch in batches:  # g′ = Q_Lᵀ G Q_R into the work buffer
                rotate(batch.view(g).to(work.dtype), batch.bases, out=batch.view(work))
            self.moments(work if batches else g, m, v, work, self.tables[j], beta1, beta2, self.eps, seed)
            theta = region.local_params
            for span in self.group_spans[j]:
                self.decoupled_step(span.of(theta), span.of(work), span.key)
            for batch in batches:
                self._apply(batch.view(theta), batch.view(work), batch.bases, batch.group)
                self._update_factors(batch, batch.view(g).to(work.dtype))
                if refresh:
                    self._refresh(batch, batch.view(m), batch.view(v), work.dtype)
            region.gather_params()

    def _tensor_state(self, index: int) -> dict:
        region = self.region_of[index]
        if not region.tensor_owned or self.calls == 0:
            return {}
        owner, mine = region.owner[index], region.owner[index] == region.rank
        out = {}
        dtype = torch.promote_types(region.params.dtype, torch.float32)
        for dim, (size, rot) in enumerate(zip(self._shape(self.params_in_order[index].shape),
                                              self._rotated(self.params_in_order[index].shape))):
            if not rot:
                continue
            for name, stacks in ((f"GG{dim}", "factors"), (f"Q{dim}", "bases")):
                if mine:
                    batch, b = self.batch_of[index]
                    tensor = getattr(batch, stacks)[dim][b].clone()
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
        batch, b = self.batch_of[index]
        work = self.work[self.regions.index(region)]
        if batch.factors[batch.rotated.index(True)] is None:
            batch.allocate(work.dtype, work.device)
        for dim, rot in enumerate(batch.rotated):
            if rot:
                batch.factors[dim][b].copy_(state[f"GG{dim}"])
                batch.bases[dim][b].copy_(state[f"Q{dim}"])
        self._expose(batch)


SOAP_SPEC = OptimizerSpec(
    name="soap",
    optimizer=SOAP,
    config=SOAPConfig,
    reduces_gradients=True,
    description="SOAP, Adam in Shampoo's eigenbasis (docs/optimizers.md#soap)",
)
