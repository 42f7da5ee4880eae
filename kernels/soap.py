"""Fused elementwise step of SOAP (docs/optimizers.md#soap): Adam's moments of the rotated gradient and the
normalised direction in one pass over a flat chunk.

Per element of the chunk (g′ is the gradient in the eigenbasis, or the gradient itself where nothing is rotated):
    m ← β1·m + (1−β1)·g′;   v ← β2·v + (1−β2)·g′²;   d = m / (√v + ε)
reading g′, m, v once and writing m, v, d once (d may be g′'s own buffer). The bias correction and the learning
rate are applied by the optimizer where d meets the parameters (folded into the back-projection's GEMM). m and v are
stored in fp32 or in bf16 (kernels/bf16.py), a bf16 pair rounded stochastically with one 32-bit draw per element (the
low half for m, the high half for v) keyed by the element's index among all the model's parameters
(docs/optimizers.md#soap, bf16 moments).

`moments_reference`, the same step in torch ops, is the optimizer's path where the kernel does not run (CPU, float64,
--no-fused) and the AdamW part of Muon's; tests/test_soap_kernels.py shows they agree.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import ecd
from kernels.bf16 import as_kernel_arg, bf16_bits, copy_back, load_fp32, nearest_even_bits
from kernels.ecd import BLOCK, BlockTable


# The blocks of a chunk's (key, lo, hi) pieces; a block's key is its first element's.
block_table = functools.partial(ecd.block_table, element_keys=True)


@triton.jit
def _moments_kernel(G, M, V, D, START, LEN, KEY, beta1, beta2, eps, seed, STATE_BF16: tl.constexpr,
                    STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    b = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    mask = lanes < tl.multiple_of(tl.load(LEN + b), ALIGN)
    offs = tl.multiple_of(tl.load(START + b), ALIGN) + lanes
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m = load_fp32(M, offs, mask, STATE_BF16) * beta1 + g * (1 - beta1)
    v = load_fp32(V, offs, mask, STATE_BF16) * beta2 + g * g * (1 - beta2)
    d = tl.div_rn(m, tl.sqrt_rn(v) + eps)
    if STATE_BF16:
        if STOCHASTIC:
            bits = tl.randint(seed, tl.load(KEY + b) + lanes)
            m_bits, v_bits = bits & 0xFFFF, (bits >> 16) & 0xFFFF
        else:
            m_bits, v_bits = nearest_even_bits(m), nearest_even_bits(v)
        tl.store(M + offs, bf16_bits(m, m_bits), mask=mask)
        tl.store(V + offs, bf16_bits(v, v_bits), mask=mask)
    else:
        tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
        tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)
    tl.store(D + offs, d.to(D.dtype.element_ty), mask=mask)


def moments(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, d: torch.Tensor, table: BlockTable, beta1: float,
            beta2: float, eps: float, seed: int = 0, stochastic: bool = True) -> None:
    """m and v of one chunk updated in place and d = m/(√v + ε) written (see the module docstring); d may be g.
    `table` is `block_table`'s for the chunk; a bf16 m, v is rounded stochastically with random bits keyed by
    (seed, element key), or to nearest-even (stochastic=False)."""
    if not len(table.starts):
        return
    m_arg, bf16 = as_kernel_arg(m)
    v_arg, _ = as_kernel_arg(v)
    _moments_kernel[(len(table.starts),)](g, m_arg, v_arg, d, table.starts, table.lengths, table.keys, beta1, beta2,
                                          eps, seed, STATE_BF16=bf16, STOCHASTIC=stochastic, BLOCK=BLOCK,
                                          ALIGN=table.align)


def moments_reference(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, d: torch.Tensor,
                      table: BlockTable | None, beta1: float, beta2: float, eps: float | torch.Tensor, seed: int = 0,
                      stochastic: bool = False) -> None:
    """`moments` in torch ops over the whole chunk, computed in g's dtype widened to at least fp32, a bf16 m, v
    rounded to nearest (table, seed and stochastic are the kernel's and unused here). `eps` may be a 0-dim device
    tensor (Muon's bias-corrected ε, staged for a CUDA graph)."""
    compute = torch.promote_types(g.dtype, torch.float32)
    g = g.to(compute)
    m_c, v_c = m.to(compute), v.to(compute)
    m_c.mul_(beta1).add_(g, alpha=1 - beta1)
    v_c.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    torch.sqrt(v_c, out=d).add_(eps)
    torch.div(m_c, d, out=d)
    copy_back([m, v], [m_c, v_c])
