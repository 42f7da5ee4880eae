"""ECD q=1, Energy Conserving Descent (arXiv 2601.22257 App. B; De Luca et al. 2025), exactly as docs/optimizers.md#ecd.

State: one vector Π over all parameters (memory 2N with the parameters). Elementwise work is sharded by
element across ranks (`optim.distributed`); the scalars the update needs (loss, ‖θ‖², θ·g, ‖g‖², Π·g, Π·θ, ‖Π‖²,
per weight-decay group or per tensor) are summed over ranks in ONE all-reduce per step, and everything derived
from them stays on the device: the loss arrives as a device tensor and the host never waits.

Π is stored up to a positive scale that is resolved lazily: after the noise step (docs/optimizers.md step 4) the state
is Π3 = Π2/s + ν̂z and the logical momentum is s·Π3/‖Π3‖; ‖Π3‖ comes from the next step's all-reduce, so the noise
costs no second collective. state_dict(), first_moments() and velocity() return the logical Π.

The elementwise work is kernels/ecd.py's: its Triton kernels on CUDA with fp32 parameters (and in Triton's CPU
interpreter), their PyTorch references everywhere else (CPU, float64, `fused=False`): one update, written once in
Triton and once in torch ops; tests/test_ecd_kernels.py shows they agree.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor

from cli import flag
from optim.base import check_arguments, mixed_seed, per_parameter
from optim.distributed import ShardedOptimizer, all_reduce_sum, rank_and_world_size
from optim.registry import OptimizerSpec, ShardedOptimizerConfig, state_dtype

PROJECTIONS = ("global", "per_tensor")
NOISE_BLOCK = 1 << 20


@dataclass
class ECDConfig(ShardedOptimizerConfig):
    """ECD's hyperparameters with the paper's defaults (docs/model.md#the-papers-model)."""

    lr: float = flag(1.0, "ℓ; the position step is lr/sqrt(ecd_eta)", bounds="> 0")
    weight_decay: float = flag(0.0, "λ: F̃ = F + λ|θ|²/2 over the decayed parameters (--decay-groups)",
                                bounds=">= 0")
    ecd_eta: float = flag(100.0, "η, concentration of the measure near low loss", bounds="> 0")
    ecd_f0: float = flag(2.0, "F0, must stay below the training loss")
    ecd_nu: float = flag(0.0, "ν, chaos (momentum noise) strength", bounds=">= 0")
    ecd_energy_conservation: bool = flag(True, "renormalise Π to unit norm every step")
    ecd_projection: str = flag("per_tensor", "Π·g̃ in the momentum update per parameter tensor (per_tensor, the "
                               "published implementation) or over all parameters (global, the Hamiltonian's "
                               "dynamics; docs/optimizers.md#ecd)", choices=PROJECTIONS)
    optim_seed: int = flag(0, "seed of the momentum noise (and of the stochastic rounding of a bf16 Π)",
                           bounds=">= 0")
    fused: bool = flag(True, "on CUDA with fp32 parameters: the Triton step kernels (kernels/ecd.py, no host sync, "
                             "a bf16 Π rounded stochastically); off: the per-tensor PyTorch path")


def ecd_noise(seed: int, call: int, stream: int, start: int, stop: int, dtype: torch.dtype, device) -> Tensor:
    """z ~ N(0, I) for elements [start, stop) of a region's parameter vector at optimizer call `call`.

    Drawn in fixed blocks seeded by (seed, call, stream, block), so the noise for an element does not depend on
    how the elements are sharded: a run on any number of ranks, or a resumed run, sees the same z (docs/optimizers.md).
    """
    out = torch.empty(stop - start, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    for block in range(start // NOISE_BLOCK, -(-stop // NOISE_BLOCK)):
        gen.manual_seed(mixed_seed(seed, call, stream, block))
        z = torch.randn(NOISE_BLOCK, generator=gen, dtype=dtype, device=device)
        lo, hi = max(start, block * NOISE_BLOCK), min(stop, (block + 1) * NOISE_BLOCK)
        out[lo - start : hi - start] = z[lo - block * NOISE_BLOCK : hi - block * NOISE_BLOCK]
    return out


class _DeferredFlag:
    """A device counter read without a host sync: copied to pinned memory and inspected one step later."""

    def __init__(self, device: torch.device) -> None:
        self.value = torch.zeros((), dtype=torch.int64, device=device)
        self.on_cuda = self.value.is_cuda
        self.host = torch.zeros((), dtype=torch.int64, pin_memory=self.on_cuda)
        self.event = torch.cuda.Event() if self.on_cuda else None

    def publish(self) -> None:
        self.host.copy_(self.value, non_blocking=True)
        if self.on_cuda:
            self.event.record()

    def read(self) -> int:
        """The counter as of the last publish, or 0 while that copy is still in flight."""
        if self.on_cuda and not self.event.query():
            return 0
        return int(self.host)


class ECD(ShardedOptimizer):
    """ECD q=1 (docs/optimizers.md). `step(loss)` with the global-batch mean loss as a 0-dim tensor, or `step(closure)`.

    The keyword arguments are ECDConfig's fields (the flags of the same names, whose help says what each does). A
    bf16 Π is computed in fp32 and rounded stochastically by the kernels, to nearest by the PyTorch path; the kernels
    also run under Triton's interpreter (TRITON_INTERPRET=1).
    """

    has_velocity = True

    def __init__(
        self,
        params,
        lr: float = ECDConfig.lr,
        weight_decay: float = ECDConfig.weight_decay,
        ecd_eta: float = ECDConfig.ecd_eta,
        ecd_f0: float = ECDConfig.ecd_f0,
        ecd_nu: float = ECDConfig.ecd_nu,
        ecd_energy_conservation: bool = ECDConfig.ecd_energy_conservation,
        ecd_projection: str = ECDConfig.ecd_projection,
        optim_seed: int = ECDConfig.optim_seed,
        optim_state_dtype: str = ECDConfig.optim_state_dtype,
        fused: bool = ECDConfig.fused,
    ) -> None:
        check_arguments(ECDConfig, locals())
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay), tensor_owned=lambda i: False)
        self.eta, self.F0, self.nu, self.seed = ecd_eta, ecd_f0, ecd_nu, optim_seed
        self.energy_conservation, self.projection = ecd_energy_conservation, ecd_projection
        self.D = sum(p.numel() for p in self.params_in_order)
        if self.D < 2:
            raise ValueError("ECD needs at least 2 parameters (κ has D/(D-1))")
        self.world_size = rank_and_world_size()[1]
        device = self.params_in_order[0].device
        self.new_flat_state("pi", state_dtype(optim_state_dtype, self.params_in_order))
        # A key per weight-decay group ("global") or per tensor ("per_tensor"); the all-reduced sums are per key.
        per_tensor = ecd_projection == "per_tensor"
        self.num_keys = len(self.params_in_order) if per_tensor else len(self.param_groups)
        self.key_of = list(range(len(self.params_in_order))) if per_tensor else self.group_of
        self.group_of_key = self.group_of if per_tensor else list(range(len(self.param_groups)))
        # The elementwise work runs over a table of blocks that never straddle two keys: the Triton kernels of
        # kernels/ecd.py (fused: CUDA with fp32 parameters, or Triton's CPU interpreter) take blocks of BLOCK
        # elements; their PyTorch references, the path everywhere else, take each key's span whole.
        from kernels import ecd as ecd_kernels  # Triton: imported when an ECD optimizer is built, not with this module

        ranges = [[(span.key, span.lo, span.hi) for span in region.spans(self.key_of.__getitem__)]
                  for region in self.regions]
        self.fused = fused and self.kernels_run()
        block = ecd_kernels.BLOCK if self.fused else max((hi - lo for rs in ranges for _, lo, hi in rs), default=1)
        table_device = device if self.fused else torch.device("cpu")  # the references read it on the host
        self.tables = [ecd_kernels.block_table(rs, table_device, block) for rs in ranges]
        block_keys = [k for rs in ranges for k, lo, hi in rs for _ in range(lo, hi, block)]
        self.block_gather = ecd_kernels.key_gather_index(block_keys, self.num_keys).to(device)
        self.partial_dots = ecd_kernels.partial_dots if self.fused else ecd_kernels.partial_dots_reference
        self.apply_update = ecd_kernels.apply_update if self.fused else ecd_kernels.apply_update_reference
        self.sum_by_key = ecd_kernels.sum_by_key
        self.pending = torch.zeros((), dtype=torch.bool, device=device)  # logical Π = σ·Π/‖Π‖ (True) or Π
        self.sigma = torch.ones((), dtype=torch.float64, device=device)
        self.skipped = _DeferredFlag(device)
        self.warned = False
        self._lam_cache: tuple[tuple[float, ...], Tensor] | None = None

    def _lam(self) -> Tensor:
        """Weight decay λ per key as a float64 device vector, rebuilt (by `stage_step`, outside any graph, in place)
        when a group's value changes."""
        per_group = tuple(float(g["weight_decay"]) for g in self.param_groups)
        if self._lam_cache is None or self._lam_cache[0] != per_group:
            values = torch.tensor([per_group[g] for g in self.group_of_key], dtype=torch.float64)
            vector = self._lam_cache[1] if self._lam_cache else torch.empty_like(values, device=self.pending.device)
            self._lam_cache = (per_group, vector.copy_(values))
        return self._lam_cache[1]

    def _lr(self) -> float:
        lrs = {float(g["lr"]) for g in self.param_groups}
        if len(lrs) != 1:
            raise ValueError(f"ECD moves all parameters with one step size; param groups have lr {sorted(lrs)}")
        return lrs.pop()

    def host_scalars(self) -> dict[str, float]:
        """h = ℓ/√η and κ = ½·h·η·D/(D−1) (docs/optimizers.md#ecd), which follow the learning rate."""
        h = self._lr() / math.sqrt(self.eta)
        return {"h": h, "kappa": 0.5 * h * self.eta * self.D / (self.D - 1)}

    def stage_step(self) -> None:
        """Warn (once) about steps skipped below F0, update λ, then stage h and κ."""
        self._check_skipped()
        self._lam()
        super().stage_step()

    def steady_step(self) -> bool:
        return self.calls > 0  # the first step sets Π from the gradient

    def capture_problem(self) -> str | None:
        if self.nu > 0:
            return ("ECD's momentum noise (--ecd-nu > 0) is drawn from a generator seeded on the host every step, "
                    "which a CUDA graph would fix; use --ecd-nu 0")
        return super().capture_problem()

    def _logical_scale(self, pp_total: Tensor) -> Tensor:
        """c with logical Π = c·(stored Π), from the stored ‖Π‖² (see module docstring)."""
        return torch.where(self.pending, self.sigma / pp_total.clamp_min(1e-300).sqrt(), 1.0)

    def _check_skipped(self) -> None:
        if not self.warned and self.skipped.read() > 0:
            self.warned = True
            warnings.warn(
                f"ECD: the loss (plus weight decay) fell to F0={self.F0} or below; those steps leave θ and Π "
                "unchanged. Lower --ecd-f0 below the losses this run reaches.",
                stacklevel=4,
            )

    @torch.no_grad()
    def update(self, loss=None) -> None:
        """One ECD step (docs/optimizers.md) from the staged h, κ; `loss` is this rank's mean loss (tensor or float)."""
        if loss is None:
            raise ValueError("ECD.step needs the training loss: call opt.step(loss) or opt.step(closure)")
        device = self.pending.device
        loss_t = torch.as_tensor(loss).detach().to(device=device, dtype=torch.float64).reshape(1)
        first = self.calls == 0
        if first:
            self.pending.fill_(True)
            self.sigma.fill_(1.0)

        grads, rows = self.reduced_gradients(), []
        for region, pi, table, g in zip(self.regions, self.flat_state["pi"], self.tables, grads):
            if first:
                pi.copy_(g.neg())
            rows.append(self.partial_dots(region.local_params, g, pi, table))
        sums = self.sum_by_key(torch.cat(rows), self.block_gather)
        vec = all_reduce_sum(torch.cat([loss_t, sums.reshape(-1)]))
        coef = self._coefficients(vec, self.staged("h", torch.float64), self.staged("kappa", torch.float64))
        lam = self._lam() if any(g["weight_decay"] for g in self.param_groups) else None
        for j, (region, pi, table, g) in enumerate(zip(self.regions, self.flat_state["pi"], self.tables, grads)):
            z = None
            if self.nu > 0:
                lo = region.rank * region.chunk
                z = ecd_noise(self.seed, self.calls, j, lo, lo + region.chunk,
                              torch.promote_types(region.params.dtype, torch.float32), pi.device)
            rounding_seed = mixed_seed(self.seed, self.calls, j, bits=31)
            self.apply_update(region.local_params, g, pi, z, table, coef, lam, rounding_seed,
                              region.rank * region.chunk)
            region.gather_params()

        active = coef["active"]
        noisy = self.nu > 0
        self.sigma.copy_(torch.where(active & noisy, coef["s"], self.sigma))
        self.pending.copy_(torch.where(active, noisy, self.pending))
        self.skipped.value.add_((~active).long())

    def finish_step(self) -> None:
        """Start the skipped-step counter on its way to the host (read at a later step), count the step."""
        self.skipped.publish()
        super().finish_step()

    def _coefficients(self, vec: Tensor, h: Tensor, kappa: Tensor) -> dict[str, Tensor]:
        """docs/optimizers.md#ecd scalars from the all-reduced sums and the staged h, κ, all on device in float64 (no
        host sync)."""
        loss = vec[0] / self.world_size
        tt, tg, gg, pg, pt, pp = vec[1:].view(self.num_keys, 6).unbind(1)
        lam = self._lam()
        gap = loss + 0.5 * (lam * tt).sum() - self.F0  # F̃ − F0
        active = gap > 1e-40  # step 2: below this gap nothing moves
        pp_total = pp.sum()
        c = self._logical_scale(pp_total)
        norm2 = c * c * pp_total  # ‖Π‖² of the logical Π
        a = torch.ones_like(norm2)
        if self.energy_conservation:  # step 1: Π ← Π/‖Π‖ unless already unit
            a = torch.where((norm2 - 1).abs() < 1e-10, 1.0, norm2.clamp_min(1e-300).rsqrt())
        m = a * c  # Π1 = m · stored Π
        pg1 = m * (pg + lam * pt)  # Π1·g̃ per key
        n1 = m * m * pp
        gg1 = gg + 2 * lam * tg + lam * lam * tt  # ‖g̃‖² per key
        proj = pg1.sum().expand_as(pg1) if self.projection == "global" else pg1
        k = torch.where(active, kappa / torch.where(active, gap, 1.0), 0.0)
        b = 1 + k * proj
        s = (b * b * n1 - 2 * k * b * pg1 + k * k * gg1).sum().clamp_min(1e-300).sqrt()  # ‖Π2‖
        on = active.to(torch.float64)
        return {
            "active": active,
            "A": torch.where(active, b * m, 1.0),
            "neg_k": -k,
            "h": on * h,
            "s": s,
            "inv_s": torch.where(active, 1 / s, 1.0),
            "nu": on * (self.nu / math.sqrt(self.D)),
        }

    @torch.no_grad()
    def _stored_norm2(self) -> Tensor:
        local = sum(buf.double().square().sum() for buf in self.flat_state["pi"])
        return all_reduce_sum(local.reshape(1))[0]

    @torch.no_grad()
    def _materialise(self) -> None:
        """Fold the pending scale into the stored Π so that stored = logical (collective)."""
        c = self._logical_scale(self._stored_norm2())
        for buf in self.flat_state["pi"]:
            buf.mul_(c.to(buf.dtype))
        self.pending.fill_(False)

    def first_moment_of(self, index: int) -> tuple[str, bool]:
        return "pi", True

    def first_moments(self, steering_only: bool = False) -> dict[str, Tensor]:
        if self.calls > 0:
            self._materialise()  # stored Π = logical Π, which set_first_moments then writes
        return super().first_moments(steering_only)

    @torch.no_grad()
    def velocity(self) -> dict[str, Tensor]:
        """u = Π/‖Π‖_global restricted to each parameter, full tensors keyed by parameter name (collective; §6),
        without folding the pending scale into the stored Π."""
        inv_norm = self._stored_norm2().clamp_min(1e-300).rsqrt()
        return {self.names[i]: (pi.double() * inv_norm).to(pi.dtype) for i, pi in self.gathered("pi").items()}

    @classmethod
    def saved_velocity(cls, state_dict: Mapping) -> dict[str, Tensor]:
        return per_parameter(state_dict, lambda state, group: state.get("pi"))

    def state_dict(self) -> dict:
        if self.calls > 0:
            self._materialise()
        return super().state_dict()

    def _global_state(self) -> dict:
        return {**super()._global_state(), "skipped": int(self.skipped.value.cpu())}

    def _load_global_state(self, state: dict) -> None:
        super()._load_global_state(state)
        self.skipped.value.fill_(state["skipped"])
        self.pending.fill_(False)
        self.sigma.fill_(1.0)


ECD_SPEC = OptimizerSpec(
    name="ecd",
    optimizer=ECD,
    config=ECDConfig,
    needs_loss=True,
    reduces_gradients=True,
    description="Energy Conserving Descent, q=1 (docs/optimizers.md#ecd)",
)
