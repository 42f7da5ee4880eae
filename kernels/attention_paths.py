"""Attention with the symmetry-breaking biases on three exact paths, and which one a run takes
(docs/model.md#three-exact-implementations, docs/model.md#choosing-the-implementation).

`attention(q, k, v, b_q, b_v, causal, impl)` is the model's only attention call. q, k, v are (B, H, T, d); b_q and
b_v are None, (d,) shared across heads, or (H, d) per head. Semantics: scores = (q + b_Q)·kᵀ/√d, softmax (causal
mask), output = softmax(·)(v + b_V). Because each softmax row sums to one, adding b_V to the values equals adding it
to the output, which is what every path does. The paths:
- "sdpa", `attention_reference`: PyTorch SDPA on q + b_Q with b_V added to the output (autograd gives the biases'
  gradients). Runs on every device; in float64, the tests' oracle and the Triton kernel's reference.
- "triton", kernels.attention.attention_triton: the Triton kernel, for CUDA fp16/bf16 inputs with d in {64, 128}
  (everything else, a generation step's queries against its KV cache included, runs SDPA). Imported by the first
  call that runs it, so importing this module (and every entry point) does not import Triton.
- "flex", `attention_flex`: FlexAttention with b_Q as the per-key score term c_j = b_Q·k_j/√d, under torch.compile
  on CUDA (torch 2.13 has no FlexAttention backward on the CPU).

Which path a training run takes is decided once, before torch.compile, by kernels/attention_select.py
(--attention-impl).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

HEAD_DIMS = (64, 128)  # the Triton kernel's
IMPLEMENTATIONS = ("triton", "sdpa", "flex")  # attention(impl=...)


# -----------------------------------------------------------------------------
# The library paths

def _broadcast_bias(bias: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Return the bias shaped (1, H, 1, d) or (1, 1, 1, d) so it broadcasts over (B, H, T, d)."""
    if bias.shape == (head_dim,):
        return bias.view(1, 1, 1, head_dim)
    if bias.shape == (num_heads, head_dim):
        return bias.view(1, num_heads, 1, head_dim)
    raise ValueError(f"bias of shape {tuple(bias.shape)} must be ({head_dim},) or ({num_heads}, {head_dim})")


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b_q: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """SDPA with b_Q added to the queries and b_V added to the output (docs/model.md#symmetry-breaking-biases)."""
    _, num_heads, _, head_dim = q.shape
    if b_q is not None:
        q = q + _broadcast_bias(b_q, num_heads, head_dim).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if b_v is not None:
        out = out + _broadcast_bias(b_v, num_heads, head_dim).to(out.dtype)
    return out


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=8)
def _causal_block_mask(seq_len: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, None, None, seq_len, seq_len, device=device)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b_q: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """FlexAttention with b_Q as the per-key score term c_j = b_Q·k_j/√d, since (q + b_Q)·k = q·k + b_Q·k, and b_V
    added to the output (docs/model.md#three-exact-implementations). c is computed in fp32; its gradient reaches k
    and b_Q through autograd. Inside torch.compile it is traced with the model; called eagerly on CUDA it runs a
    compiled FlexAttention (eager FlexAttention materialises the scores). The CPU has a forward only."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _, num_heads, seq_len, head_dim = q.shape
    compiling = torch.compiler.is_compiling()
    block_mask = None
    if causal:  # built with the model when compiling, else once per length
        block_mask = (create_block_mask(_causal, None, None, seq_len, seq_len, device=q.device) if compiling
                      else _causal_block_mask(seq_len, q.device))
    score_mod = None
    if b_q is not None:  # elementwise products and a sum: fp32 under autocast too
        key_bias = (k.float() * _broadcast_bias(b_q, num_heads, head_dim).float()).sum(-1) / math.sqrt(head_dim)

        def add_key_bias(score, b, h, q_idx, kv_idx):
            return score + key_bias[b, h, kv_idx]

        score_mod = add_key_bias

    flex = flex_attention if compiling or not q.is_cuda else _compiled_flex_attention()
    out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
    if b_v is not None:
        out = out + _broadcast_bias(b_v, num_heads, head_dim).to(out.dtype)
    return out


def kernel_problem(device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why `attention(impl="triton")` would not run the Triton kernel for these inputs; None when it does."""
    if device_type != "cuda":
        return f"the Triton kernel runs on CUDA devices (this one is {device_type})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the Triton kernel is used for float16 and bfloat16 (this call is {str(dtype).removeprefix('torch.')})"
    if head_dim not in HEAD_DIMS:
        return f"the Triton kernel handles head dims {HEAD_DIMS} (this model's is {head_dim})"
    return None



def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b_q: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    causal: bool = True,
    impl: str = "triton",
) -> torch.Tensor:
    """Attention with optional symmetry-breaking biases on the path `impl` (see the module docstring). The model
    carries impl as a plain attribute, so torch.compile sees a constant and traces one path."""
    if impl == "flex":
        return attention_flex(q, k, v, b_q, b_v, causal)
    if impl == "triton":
        if (kernel_problem(q.device.type, q.dtype, q.shape[-1]) is None and k.shape == q.shape
                and k.dtype == q.dtype == v.dtype):
            from kernels.attention import attention_triton  # Triton: imported where the kernel runs, not before

            return attention_triton(q, k, v, b_q, b_v, causal)
    elif impl != "sdpa":
        raise ValueError(f"attention: impl {impl!r} is not one of {IMPLEMENTATIONS}")
    return attention_reference(q, k, v, b_q, b_v, causal)
