"""Owner-computes sharding: parameters, gradients and optimizer state as views into flat buffers.

The optimizers that average gradients themselves (ECD, SOAP, Muon: `OptimizerSpec.reduces_gradients`) lay their
parameters out in `Region`s and rebind every `param.data` and `param.grad` to a view of a region's flat buffer.
Each rank owns one equal-sized chunk of every region:
- element regions concatenate their parameters and split the elements evenly (elementwise rules: ECD, Adam). They
  are buckets of at most BUCKET_BYTES (a larger tensor alone), so the reduction of one bucket can start while the
  backward pass still computes the gradients of the others;
- tensor regions give each parameter whole to one rank, balanced by size (SOAP's eigenbases, Muon's
  orthogonalisation), so the expensive per-matrix work is spread over ranks; each tensor's gradient is reduced to
  its owner.
A step is: average the gradients over ranks into each rank's chunk, update the owned chunk, all-gather the
parameters. The averaging starts during the backward pass (post-accumulate-grad hooks), as DDP's all-reduce does,
unless the backward runs under `no_sync()` (the micro-steps of gradient accumulation before the last); step()
waits for what was started and starts the rest. Elementwise state lives in chunk-sized buffers aligned with the
owned chunk, which is what a fused kernel wants. Without torch.distributed (or with one process) every collective
is skipped.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from optim.base import OptimizerInterface, moment_key, moment_keys, parameter_names


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum `tensor` over ranks in place (no-op on one process)."""
    if rank_and_world_size()[1] > 1:
        dist.all_reduce(tensor)
    return tensor


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of parameter `index` (flattened), owned by this rank at `offset` in its chunk."""

    index: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def of(self, local: Tensor) -> Tensor:
        """This piece's 1-D view into a chunk-sized local buffer."""
        return local[self.offset : self.offset + self.numel]


@dataclass(frozen=True)
class Span:
    """Consecutive pieces of this rank's chunk, elements [lo, hi), whose parameters share `key`."""

    key: object
    lo: int
    hi: int
    pieces: tuple[Piece, ...]

    def of(self, local: Tensor) -> Tensor:
        """This span's 1-D view into a chunk-sized local buffer."""
        return local[self.lo : self.hi]


class Region:
    """Parameters of one dtype and ownership mode in one flat buffer of world_size equal chunks.

    In a tensor region each rank's tensors lie in the order of `layout_key(index)` (then index), so tensors of one
    key are adjacent: a batch of same-shaped matrices is then one view of the flat buffers, with no copy."""

    def __init__(self, params: list[tuple[int, Tensor]], tensor_owned: bool, rank: int, world_size: int,
                 layout_key=None) -> None:
        self.rank, self.world_size, self.tensor_owned = rank, world_size, tensor_owned
        self.indices = [i for i, _ in params]
        numels = [p.numel() for _, p in params]
        if tensor_owned:
            load, owner = [0] * world_size, {}
            for k in sorted(range(len(params)), key=lambda k: -numels[k]):  # largest first, least-loaded rank
                owner[k] = min(range(world_size), key=lambda r: load[r])
                load[owner[k]] += numels[k]
            self.chunk = max(load)
            fill, starts = [0] * world_size, [0] * len(params)
            key = (lambda k: layout_key(params[k][0])) if layout_key else (lambda k: 0)
            for k in sorted(range(len(params)), key=lambda k: (key(k), k)):  # each rank's tensors grouped by key
                starts[k] = owner[k] * self.chunk + fill[owner[k]]
                fill[owner[k]] += numels[k]
            self.owner = {params[k][0]: owner[k] for k in range(len(params))}
        else:
            self.chunk = -(-sum(numels) // world_size)
            starts = list(itertools.accumulate([0] + numels[:-1]))
            self.owner = {}
        self.offset = {i: s for (i, _), s in zip(params, starts)}
        first = params[0][1]
        self.params = torch.zeros(world_size * self.chunk, dtype=first.dtype, device=first.device)
        self.grads = torch.zeros_like(self.params)
        self._grad_views: dict[int, tuple[Tensor, Tensor]] = {}
        lo, hi = rank * self.chunk, (rank + 1) * self.chunk
        self.pieces: list[Piece] = []
        for (i, p), start in zip(params, starts):
            a, b = max(start, lo), min(start + p.numel(), hi)
            if a < b:
                self.pieces.append(Piece(i, a - start, b - start, a - lo))
            view = self.params[start : start + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
            p.grad = self.grads[start : start + p.numel()].view_as(p)
            self._grad_views[i] = (p, p.grad)
        self.pieces.sort(key=lambda piece: piece.offset)
        self._works: dict[int, object] = {}  # in-flight reductions: by parameter index (tensor regions) or -1
        self._not_ready = set(self.indices)  # parameters whose gradient this backward pass has not produced yet
        self._reduced: Tensor | None = None

    def spans(self, key_of) -> list[Span]:
        """This rank's chunk cut into maximal spans of consecutive pieces with equal `key_of(index)`."""
        spans: list[Span] = []
        for piece in self.pieces:
            key = key_of(piece.index)
            if spans and spans[-1].key == key:
                last = spans[-1]
                spans[-1] = Span(key, last.lo, piece.offset + piece.numel, (*last.pieces, piece))
            else:
                spans.append(Span(key, piece.offset, piece.offset + piece.numel, (piece,)))
        return spans

    @property
    def local_params(self) -> Tensor:
        """This rank's chunk of the parameter buffer (a view: writing it updates the model on this rank)."""
        return self.params[self.rank * self.chunk : (self.rank + 1) * self.chunk]

    def zero_grad(self) -> None:
        """Zero the flat gradient buffer and point every `param.grad` back at its view (dropping any gradient that
        autograd allocated elsewhere after a set_to_none)."""
        self._wait()
        self._not_ready = set(self.indices)
        self.grads.zero_()
        for p, view in self._grad_views.values():
            p.grad = view

    def _adopt_gradient(self, index: int) -> None:
        """Put a gradient that autograd allocated elsewhere (after set_to_none) back into the flat buffer."""
        p, view = self._grad_views[index]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def gradient_ready(self, index: int) -> None:
        """Backward hook: parameter `index` holds its final gradient; start what can be reduced now."""
        if self.tensor_owned:
            self._launch(index)
            return
        self._not_ready.discard(index)
        if not self._not_ready:
            self._launch(-1)

    def _launch(self, key: int) -> None:
        """Start averaging one tensor's gradient to its owner (tensor regions) or the bucket's (key -1) over ranks."""
        if key in self._works:  # gradients were accumulated again after an earlier launch: that result is stale
            self._works.pop(key).wait()
        if key >= 0:
            self._adopt_gradient(key)
            grad = self._grad_views[key][1]
            self._works[key] = dist.reduce(grad, dst=self.owner[key], async_op=True)
        else:
            for index in self.indices:
                self._adopt_gradient(index)
            self._reduced = torch.empty(self.chunk, dtype=self.grads.dtype, device=self.grads.device)
            self._works[key] = dist.reduce_scatter_tensor(self._reduced, self.grads, async_op=True)
            self._not_ready = set(self.indices)

    def _wait(self) -> None:
        for work in self._works.values():
            work.wait()
        self._works = {}

    def reduce_gradients(self) -> Tensor:
        """The mean over ranks of the gradients in this rank's chunk: waits for the reductions started during the
        backward pass and runs the rest (in index order, the same on every rank); the buffer itself on 1 rank."""
        if self.world_size == 1:
            for index in self.indices:
                self._adopt_gradient(index)
            return self.grads
        if self.tensor_owned:
            for index in self.indices:
                if index not in self._works:
                    self._launch(index)
        elif -1 not in self._works:
            self._launch(-1)
        self._wait()
        self._not_ready = set(self.indices)
        local = self.grads[self.rank * self.chunk : (self.rank + 1) * self.chunk] if self.tensor_owned \
            else self._reduced
        return local.div_(self.world_size)

    def gather_params(self) -> None:
        """All-gather the updated chunks so every rank holds the full parameters again."""
        if self.world_size > 1:
            dist.all_gather_into_tensor(self.params, self.local_params)

    def gather(self, local: Tensor) -> Tensor:
        """Full flat buffer (world_size * chunk) from every rank's chunk-aligned `local` buffer (collective)."""
        if self.world_size == 1:
            return local
        full = torch.empty(self.world_size * self.chunk, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(full, local)
        return full

    def scatter(self, local: Tensor, index: int, value: Tensor) -> None:
        """Copy this rank's pieces of a full parameter-shaped `value` into the chunk-aligned `local` buffer."""
        flat = value.reshape(-1)
        for piece in self.pieces:
            if piece.index == index:
                piece.of(local).copy_(flat[piece.start : piece.stop])


BUCKET_BYTES = 25 << 20  # element regions are cut into buckets of at most this size (DDP's default bucket cap)


def _buckets(members: list[tuple[int, Tensor]]) -> list[list[tuple[int, Tensor]]]:
    """Consecutive runs of at most BUCKET_BYTES (a larger tensor forms its own): a layout independent of the number
    of ranks, so per-region noise streams (ECD) stay the same on any world size."""
    buckets: list[list[tuple[int, Tensor]]] = []
    size = 0
    for i, p in members:
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append((i, p))
        size += nbytes
    return buckets


def build_regions(params: list[Tensor], tensor_owned: list[bool], layout_key=None) -> list[Region]:
    """Lay `params` out in regions by (dtype, tensor_owned), element regions cut into buckets, tensor regions ordered
    by `layout_key(index)` on each rank, and rebind the parameters to views (see module docstring)."""
    rank, world_size = rank_and_world_size()
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"sharded optimizers need every parameter on one device; got {sorted(map(str, devices))}")
    keys = sorted({(str(p.dtype), owned) for p, owned in zip(params, tensor_owned)})
    regions = []
    for dtype, owned in keys:
        members = [(i, p) for i, (p, o) in enumerate(zip(params, tensor_owned)) if str(p.dtype) == dtype and o == owned]
        for bucket in [members] if owned else _buckets(members):
            regions.append(Region(bucket, owned, rank, world_size, layout_key))
    return regions


class ShardedOptimizer(OptimizerInterface, torch.optim.Optimizer):
    """Base of the owner-computes optimizers: flat layout, gradient averaging that overlaps the backward pass,
    gradient-norm clipping, zero_grad on the buffers, consolidated state dicts, the decoupled step, first moments.

    Subclasses implement `update`, the step's device work, which starts with `grads = self.reduced_gradients()` (this
    rank's averaged, clipped chunk per region) and ends with `region.gather_params()`; `device_step` and `step` both
    call it (step() between `stage_step` and `finish_step`). They list the scalars it reads that change from step to
    step in `host_scalars` (the base's: each group's decay 1 − ℓλ): `stage_step` copies them into one device buffer,
    read through `staged(name, dtype)`, so that a replayed CUDA graph sees each step's values. `grad_clip` > 0 clips
    the global gradient norm to it (the norm of the averaged gradient, so it needs the reduction first: gradients are
    local until the update); `grad_norm` then holds the norm before clipping as a device tensor. `overlap_reduce` =
    False leaves every reduction to the update.

    `layout_key(index)` orders each rank's tensors in the tensor regions (`Region`): optimizers that batch
    same-shaped matrices (SOAP, Muon) key them by shape. `Region.spans` cuts a chunk into spans of equal key.
    Subclasses fill `self.flat_state[name]` (one chunk-aligned local buffer per region, or None where the region
    has no such state), name each parameter's first moment in it (`first_moment_of`; the base gathers and
    scatters it) and may override
    `_tensor_state` / `_load_tensor_state` for per-tensor state (SOAP's Kronecker factors) and `_global_state` /
    `_load_global_state` for optimizer-wide scalars beyond `calls` (the number of completed steps, which the base
    saves and restores). `decoupled_step` applies a direction with the group's weight decay and its staged step
    coefficient `step<group>`.
    state_dict() is a collective: every rank must call it; every rank returns the full state in torch's layout
    ({"state": {index: {name: tensor}}, "param_groups": [...]}), loadable under any world size.
    """

    overlap_reduce = True

    def __init__(self, params, defaults: dict, tensor_owned, layout_key=None) -> None:
        super().__init__(params, defaults)
        self.params_in_order = [p for group in self.param_groups for p in group["params"]]
        self.names = parameter_names(self.param_groups)
        self.group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        if len({id(p) for p in self.params_in_order}) != len(self.params_in_order):
            raise ValueError("a parameter appears twice in the optimizer's parameter groups")
        self.regions = build_regions(self.params_in_order, [tensor_owned(i) for i in range(len(self.params_in_order))],
                                     layout_key)
        self.region_of = {i: region for region in self.regions for i in region.indices}
        self.flat_state: dict[str, list[Tensor | None]] = {}
        self.calls = 0
        self._staged_names: tuple[str, ...] = ()
        self._staged: dict[torch.dtype, tuple[Tensor, dict[str, Tensor]]] = {}  # float64, float32 buffers and views
        self._sync = True
        if self.regions[0].world_size > 1:
            for i, p in enumerate(self.params_in_order):
                p.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, i))

    def _gradient_ready(self, index: int, param: Tensor) -> None:
        if self._sync and self.overlap_reduce:
            self.region_of[index].gradient_ready(index)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally (DDP's no_sync): the reductions start only during the
        backward pass of the last micro-step, which runs outside."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def reduced_gradients(self) -> list[Tensor]:
        """This rank's chunk of the rank-averaged gradient for every region, clipped to `grad_clip` if set."""
        grads = [region.reduce_gradients() for region in self.regions]
        if self.grad_clip > 0:
            local = torch.stack([torch.linalg.vector_norm(g).double() for g in grads]).square().sum()
            self.grad_norm = all_reduce_sum(local.reshape(1))[0].sqrt()
            scale = (self.grad_clip / (self.grad_norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale.to(g.dtype))
        return grads

    def new_flat_state(self, name: str, dtype: torch.dtype | None, regions=None) -> None:
        """Allocate chunk-aligned zero buffers for state `name` (dtype None: the parameters' dtype)."""
        self.flat_state[name] = [
            torch.zeros(r.chunk, dtype=dtype or r.params.dtype, device=r.params.device)
            if regions is None or r in regions
            else None
            for r in self.regions
        ]
        for r, buf in zip(self.regions, self.flat_state[name]):
            if buf is not None:
                for piece in r.pieces:
                    self.state[self.params_in_order[piece.index]][name] = piece.of(buf)

    def kernels_run(self) -> bool:
        """Whether Triton kernels run on these parameters: fp32 on CUDA, or any device under Triton's interpreter."""
        fp32 = {p.dtype for p in self.params_in_order} == {torch.float32}
        return fp32 and (self.params_in_order[0].device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

    @torch.no_grad()
    def step(self, loss=None):
        """One step: `stage_step`, `update`, `finish_step`. `loss`: the global-batch loss (a tensor or float) or a
        closure returning it; returned."""
        if callable(loss):
            with torch.enable_grad():
                loss = loss()
        self.stage_step()
        self.update(loss)
        self.finish_step()
        return loss

    def device_step(self, loss: Tensor | None = None) -> None:
        """`update`, which clips the gradient after averaging it (`reduced_gradients`)."""
        self.update(loss)

    def update(self, loss: Tensor | None = None) -> None:
        """The step's device work on this rank's chunks; subclasses implement it."""
        raise NotImplementedError(f"{type(self).__name__} implements no update")

    def host_scalars(self) -> dict[str, float]:
        """The next step's scalars that change from step to step (or on resume), computed on the host in float64:
        each group's decay 1 − ℓλ as `decay<group>`. Subclasses add theirs (a group's step coefficient `step<group>`
        for `decoupled_step`)."""
        return {f"decay{g}": 1 - group["lr"] * group["weight_decay"] for g, group in enumerate(self.param_groups)}

    def stage_step(self) -> None:
        """Copy `host_scalars` into the device buffers that `staged` reads (allocated once: a CUDA graph keeps their
        addresses), in float64 and float32."""
        values = self.host_scalars()
        if tuple(values) != self._staged_names:
            device = self.params_in_order[0].device
            self._staged_names = tuple(values)
            for dtype in (torch.float64, torch.float32):
                buffer = torch.zeros(len(values), dtype=dtype, device=device)
                self._staged[dtype] = buffer, dict(zip(values, buffer.unbind()))
        host = torch.tensor(list(values.values()), dtype=torch.float64)
        wide, narrow = self._staged[torch.float64][0], self._staged[torch.float32][0]
        wide.copy_(host.pin_memory() if wide.is_cuda else host, non_blocking=True)
        narrow.copy_(wide)

    def staged(self, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """The staged scalar `name` as a 0-dim device tensor: float64 for float64 work, else float32 (what a Python
        float becomes in a float32 or bf16 kernel)."""
        return self._staged[torch.float64 if dtype == torch.float64 else torch.float32][1][name]

    def finish_step(self) -> None:
        self.calls += 1

    def capture_problem(self) -> str | None:
        """bf16 state rounded stochastically takes a new seed every step, which a graph would fix."""
        stochastic = getattr(self, "fused", False) and any(
            buf is not None and buf.dtype == torch.bfloat16 for bufs in self.flat_state.values() for buf in bufs)
        if stochastic:
            return (f"{type(self).__name__}'s bf16 state is rounded stochastically with a new seed every step, which "
                    "a CUDA graph would fix; use --optim-state-dtype fp32")
        return None

    def decoupled_step(self, theta: Tensor, direction: Tensor, group: int, value: float = 1.0) -> None:
        """θ ← (1 − ℓλ)·θ + value·c·direction in place, c the group's staged step coefficient `step<group>` (its
        sign and scale are the optimizer's); the decay is skipped where λ = 0."""
        if self.param_groups[group]["weight_decay"]:
            theta.mul_(self.staged(f"decay{group}", theta.dtype))
        theta.addcmul_(direction, self.staged(f"step{group}", theta.dtype), value=value)

    @torch.no_grad()
    def gathered(self, name: str, indices: set[int] | None = None) -> dict[int, Tensor]:
        """Full tensors of flat state `name` by parameter index (those in `indices`, else every one that has it),
        views into gathered buffers: a collective."""
        out = {}
        for region, buf in zip(self.regions, self.flat_state[name]):
            wanted = [i for i in region.indices if indices is None or i in indices]
            if buf is not None and wanted:
                full = region.gather(buf)
                for i in wanted:  # the flat buffer is laid out like the parameters
                    start, shape = region.offset[i], self.params_in_order[i].shape
                    out[i] = full[start : start + shape.numel()].view(shape)
        return out

    def first_moments(self, steering_only: bool = False) -> dict[str, Tensor]:
        keys, out = moment_keys(self, steering_only), {}
        for key in sorted(set(keys.values())):  # the same order on every rank: gathering is a collective
            held = self.gathered(key, {i for i, name in keys.items() if name == key})
            out.update({self.names[i]: value for i, value in held.items()})
        return out

    @torch.no_grad()
    def set_first_moments(self, moments: Mapping[str, Tensor]) -> None:
        for name, value in moments.items():
            index, key = moment_key(self, name)
            region = self.region_of[index]
            region.scatter(self.flat_state[key][self.regions.index(region)], index, value)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (gradients stay views into them, whatever `set_to_none` says)."""
        for region in self.regions:
            region.zero_grad()

    def _tensor_state(self, index: int) -> dict:
        return {}

    def _load_tensor_state(self, index: int, state: dict) -> None:
        pass

    def _global_state(self) -> dict:
        return {"calls": self.calls}

    def _load_global_state(self, state: dict) -> None:
        self.calls = state["calls"]

    @torch.no_grad()
    def state_dict(self) -> dict:
        state: dict[int, dict] = {i: {} for i in range(len(self.params_in_order))}
        for name in self.flat_state:
            for i, value in self.gathered(name).items():
                state[i][name] = value.clone()
        for i in range(len(self.params_in_order)):
            state[i].update(self._tensor_state(i))
        groups = super().state_dict()["param_groups"]  # torch's packing: parameter indices in group order
        return {"state": state, "param_groups": groups, "global": self._global_state()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in groups] != sizes:
            raise ValueError(
                f"optimizer state has parameter groups of sizes {[len(g['params']) for g in groups]}, "
                f"this optimizer has {sizes}: the checkpoint was written for a different model or optimizer setup"
            )
        for group, saved in zip(self.param_groups, groups):
            if "names" in saved and "names" in group and saved["names"] != group["names"]:
                raise ValueError("optimizer state parameter names differ from this model's: wrong checkpoint?")
            group.update({k: v for k, v in saved.items() if k != "params"})
        for name, buffers in self.flat_state.items():
            for region, buf in zip(self.regions, buffers):
                if buf is None:
                    continue
                for i in region.indices:
                    region.scatter(buf, i, state_dict["state"][i][name].to(buf.device))
        for i in range(len(self.params_in_order)):
            self._load_tensor_state(i, state_dict["state"][i])
        self._load_global_state(state_dict.get("global", {}))
