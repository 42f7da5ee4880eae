"""bf16 optimizer state inside Triton kernels, stored as raw 16-bit patterns (int16) so that the same kernel code runs
in Triton's CPU interpreter, which has no bf16 (docs/optimizers.md).

Reading widens exactly; writing rounds fp32 to bf16 either stochastically (add 16 random low bits, then truncate:
unbiased, so updates far below a bf16 ulp are not lost on average) or to nearest-even. The random bits come from
`tl.randint(seed, offset)`, keyed by the caller so that a resumed run draws the same bits. The optimizers' torch
paths compute in fp32 and round back to nearest (`copy_back`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_fp32(PTR, offs, mask, BF16: tl.constexpr):
    """Elements as fp32; a bf16 tensor arrives as int16 bit patterns and is widened exactly."""
    if BF16:
        return (tl.load(PTR + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(PTR + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def nearest_even_bits(x):
    """The low-bit increment that makes `bf16_bits` round to nearest-even."""
    return 0x7FFF + ((x.to(tl.int32, bitcast=True) >> 16) & 1)


@triton.jit
def bf16_bits(x, increment):
    """fp32 → bf16 bit patterns (int16): add `increment` (16 random bits: stochastic rounding; `nearest_even_bits`:
    round-to-nearest-even) below the kept bits and truncate. Inf and NaN pass through."""
    bits = x.to(tl.int32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    return (tl.where(finite, bits + increment, bits) >> 16).to(tl.int16)


@triton.jit
def round_to_bf16_bits(x, seed, offs, STOCHASTIC: tl.constexpr):
    """fp32 → bf16 bit patterns, stochastically with the random bits of (seed, offs), or to nearest-even."""
    if STOCHASTIC:
        increment = (tl.randint(seed, offs) & 0xFFFF).to(tl.int32)
    else:
        increment = nearest_even_bits(x)
    return bf16_bits(x, increment)


def as_kernel_arg(state: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A state tensor as the kernels take it: bf16 as its int16 bit patterns (and whether it was bf16)."""
    return (state.view(torch.int16), True) if state.dtype == torch.bfloat16 else (state, False)


def copy_back(states: list[torch.Tensor], wide: list[torch.Tensor]) -> None:
    """Write state updated in torch ops in a wider dtype (`state.to(dtype)`) back where it is stored narrower."""
    for state, value in zip(states, wide):
        if value is not state:
            state.copy_(value)
