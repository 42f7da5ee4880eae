"""Fused ECD (q = 1) step kernels (docs/optimizers.md): one pass for the step's dot products, one pass for the update.

The optimizer (optim.ecd.ECD) keeps parameters, gradients and Π in flat chunks; a chunk is cut into blocks of at
most BLOCK elements that never straddle two keys (a key is a weight-decay group, or a tensor with
projection="per_tensor"). Then:
1. `partial_dots`: per block, the six sums θ·θ, θ·g, g·g, Π·g, Π·θ, Π·Π in fp32 (one read of θ, g, Π);
   `sum_by_key` adds the blocks of each key in a fixed order in float64 (no atomics: the same result run to run).
2. the optimizer derives the step's scalars from those sums on the device (no host synchronisation);
3. `apply_update`: per element, Π ← A·Π − k·(g + λθ); θ ← θ + hΠ; with noise Π ← Π/s + ν̂z, reading the scalars
   from device memory (one read of θ, g, Π [, z], one write of θ, Π).
Π may be stored in bf16 (kernels/bf16.py). Each kernel's PyTorch reference beside it (`*_reference`) is the
optimizer's own path where the kernels do not run (CPU, float64, --no-fused); tests/test_ecd_kernels.py compares them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.bf16 import as_kernel_arg, load_fp32, round_to_bf16_bits

BLOCK = 2048  # elements per program: large enough to amortise the per-block scalars, small enough for many programs
ALIGN = 16  # elements: the alignment the kernels are told of when every block starts and ends on it


class BlockTable(NamedTuple):
    """The blocks of a chunk: int32 device tensors of their starts, lengths and keys, and `align`, the number of
    elements every start and length is a multiple of (ALIGN or 1), which the kernels take as a compile-time hint."""

    starts: torch.Tensor
    lengths: torch.Tensor
    keys: torch.Tensor
    align: int


def block_table(ranges: list[tuple[int, int, int]], device: torch.device, block: int = BLOCK,
                element_keys: bool = False) -> BlockTable:
    """The blocks covering the (key, lo, hi) ranges of a chunk, each block inside one range, its key the range's
    (with `element_keys`, kernels/soap.py's, plus the block's offset in the range). When every lo and hi is a multiple
    of ALIGN (all GPT-2 tensors have multiples of 16 elements), so is every block's start and length: the kernels then
    load and store 16 bytes at a time."""
    rows = [(lo, min(block, hi - lo), key + (lo - start if element_keys else 0))
            for key, start, hi in ranges for lo in range(start, hi, block)]
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 3).T.contiguous()
    aligned = block % ALIGN == 0 and all(lo % ALIGN == 0 and hi % ALIGN == 0 for _, lo, hi in ranges)
    return BlockTable(table[0].to(device), table[1].to(device), table[2].to(device), ALIGN if aligned else 1)


def key_gather_index(block_keys: list[int], num_keys: int) -> torch.Tensor:
    """(num_keys, most blocks per key) indices into the blocks' rows, padded with len(block_keys) (a zero row)."""
    members = [[b for b, k in enumerate(block_keys) if k == key] for key in range(num_keys)]
    width = max(1, max(len(m) for m in members))
    return torch.tensor([m + [len(block_keys)] * (width - len(m)) for m in members], dtype=torch.long)


def sum_by_key(rows: torch.Tensor, gather_index: torch.Tensor) -> torch.Tensor:
    """Float64 sums of `rows` (n, 6) per key in a fixed order (deterministic: no atomics)."""
    padded = torch.cat([rows.double(), rows.new_zeros(1, rows.shape[1], dtype=torch.float64)])
    return padded[gather_index].sum(1)


@triton.jit
def _load_block(THETA, GRAD, PI, START, LEN, b, PI_BF16: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """Offsets, mask and the fp32 θ, g, Π of block b of the table (start and length multiples of ALIGN)."""
    lanes = tl.arange(0, BLOCK)
    mask = lanes < tl.multiple_of(tl.load(LEN + b), ALIGN)
    offs = tl.multiple_of(tl.load(START + b), ALIGN) + lanes
    t = tl.load(THETA + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GRAD + offs, mask=mask, other=0.0).to(tl.float32)
    return offs, mask, t, g, load_fp32(PI, offs, mask, PI_BF16)


@triton.jit
def _partial_dots_kernel(THETA, GRAD, PI, START, LEN, OUT, PI_BF16: tl.constexpr, BLOCK: tl.constexpr,
                         ALIGN: tl.constexpr):
    b = tl.program_id(0)
    _, _, t, g, p = _load_block(THETA, GRAD, PI, START, LEN, b, PI_BF16, BLOCK, ALIGN)
    tl.store(OUT + b * 6 + 0, tl.sum(t * t, 0))
    tl.store(OUT + b * 6 + 1, tl.sum(t * g, 0))
    tl.store(OUT + b * 6 + 2, tl.sum(g * g, 0))
    tl.store(OUT + b * 6 + 3, tl.sum(p * g, 0))
    tl.store(OUT + b * 6 + 4, tl.sum(p * t, 0))
    tl.store(OUT + b * 6 + 5, tl.sum(p * p, 0))


def partial_dots(theta: torch.Tensor, grad: torch.Tensor, pi: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """(blocks, 6) fp32: θ·θ, θ·g, g·g, Π·g, Π·θ, Π·Π over each block of the chunk."""
    out = torch.empty(len(table.starts), 6, dtype=torch.float32, device=theta.device)
    pi_arg, pi_bf16 = as_kernel_arg(pi)
    if len(table.starts):
        _partial_dots_kernel[(len(table.starts),)](theta, grad, pi_arg, table.starts, table.lengths, out,
                                                   PI_BF16=pi_bf16, BLOCK=BLOCK, ALIGN=table.align)
    return out


def partial_dots_reference(theta: torch.Tensor, grad: torch.Tensor, pi: torch.Tensor, table: BlockTable
                           ) -> torch.Tensor:
    """partial_dots in torch ops, in the parameters' dtype widened to at least fp32 (float64 stays float64)."""
    compute = torch.promote_types(theta.dtype, torch.float32)
    rows = []
    for start, length in zip(table.starts.tolist(), table.lengths.tolist()):
        t, g, p = (x[start:start + length].to(compute) for x in (theta, grad, pi))
        rows.append(torch.stack([t.dot(t), t.dot(g), g.dot(g), p.dot(g), p.dot(t), p.dot(p)]))
    return torch.stack(rows) if rows else theta.new_zeros(0, 6, dtype=compute)


@triton.jit
def _apply_update_kernel(THETA, GRAD, PI, Z, START, LEN, KEY, A, NEG_K, LAM, H, INV_S, NU, seed, base,
                         HAS_LAM: tl.constexpr, HAS_Z: tl.constexpr, PI_BF16: tl.constexpr,
                         STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    b = tl.program_id(0)
    key = tl.load(KEY + b)
    offs, mask, t, g, p = _load_block(THETA, GRAD, PI, START, LEN, b, PI_BF16, BLOCK, ALIGN)
    neg_k = tl.load(NEG_K).to(tl.float32)
    p = p * tl.load(A + key).to(tl.float32) + g * neg_k  # docs/optimizers.md step 2, the renormalisation folded into A
    if HAS_LAM:
        p = p + t * (neg_k * tl.load(LAM + key).to(tl.float32))
    t = t + p * tl.load(H).to(tl.float32)  # step 3
    if HAS_Z:  # step 4 (the rescale by s/|Π| is resolved by the optimizer at the next step)
        z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
        p = p * tl.load(INV_S).to(tl.float32) + z * tl.load(NU).to(tl.float32)
    tl.store(THETA + offs, t.to(THETA.dtype.element_ty), mask=mask)
    if PI_BF16:
        tl.store(PI + offs, round_to_bf16_bits(p, seed, base + offs, STOCHASTIC), mask=mask)
    else:
        tl.store(PI + offs, p.to(PI.dtype.element_ty), mask=mask)


def apply_update(theta: torch.Tensor, grad: torch.Tensor, pi: torch.Tensor, z: torch.Tensor | None,
                 table: BlockTable, coef: dict[str, torch.Tensor], lam: torch.Tensor | None, seed: int = 0,
                 base: int = 0, stochastic: bool = True) -> None:
    """θ and Π of one chunk updated in place (see the module docstring); `coef` holds the device scalars A (per
    key), neg_k, h, inv_s, nu; `lam` the per-key weight decay (None: no decay). A bf16 Π is rounded
    stochastically with random bits keyed by (seed, base + offset in the chunk): `base` is the chunk's first global
    element, so the bits do not depend on how the elements are sharded."""
    if not len(table.starts):
        return
    pi_arg, pi_bf16 = as_kernel_arg(pi)
    _apply_update_kernel[(len(table.starts),)](
        theta, grad, pi_arg, z if z is not None else grad, table.starts, table.lengths, table.keys, coef["A"],
        coef["neg_k"], lam if lam is not None else coef["A"], coef["h"], coef["inv_s"], coef["nu"], seed, base,
        HAS_LAM=lam is not None, HAS_Z=z is not None, PI_BF16=pi_bf16, STOCHASTIC=stochastic, BLOCK=BLOCK,
        ALIGN=table.align)


def apply_update_reference(theta: torch.Tensor, grad: torch.Tensor, pi: torch.Tensor, z: torch.Tensor | None,
                           table: BlockTable, coef: dict[str, torch.Tensor], lam: torch.Tensor | None,
                           seed: int = 0, base: int = 0, stochastic: bool = False) -> None:
    """apply_update in torch ops, in the parameters' dtype widened to at least fp32, a bf16 Π rounded to nearest
    (seed, base and stochastic are the kernel's and unused here)."""
    compute = torch.promote_types(theta.dtype, torch.float32)
    neg_k, h, inv_s, nu = (coef[name].to(compute) for name in ("neg_k", "h", "inv_s", "nu"))
    for start, length, key in zip(table.starts.tolist(), table.lengths.tolist(), table.keys.tolist()):
        sl = slice(start, start + length)
        t, g, p = (x[sl].to(compute) for x in (theta, grad, pi))
        p = p * coef["A"][key].to(compute) + g * neg_k  # step 2, the renormalisation folded into A
        if lam is not None:
            p = p + t * (neg_k * lam[key].to(compute))
        t = t + p * h  # step 3
        if z is not None:  # step 4 (the rescale by s/|Π| is resolved by the optimizer at the next step)
            p = p * inv_s + z[sl].to(compute) * nu
        theta[sl], pi[sl] = t, p
