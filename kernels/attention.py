"""Causal self-attention with the symmetry-breaking biases b_Q, b_V (SPEC §1).

`attention(q, k, v, b_q, b_v, causal)` is the single entry point the model calls. q, k, v are (B, H, T, d);
b_q and b_v are None, (d,) shared across heads, or (H, d) per head. Semantics: scores = (q + b_Q)·kᵀ/√d,
softmax (causal mask), output = softmax(·)(v + b_V). Because each softmax row sums to one, adding b_V to the
values equals adding it to the output, which is what the implementations do.

`attention_reference` is the PyTorch SDPA implementation: it runs on every device and is the oracle the kernel
tests compare against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    """SDPA with b_Q added to the queries and b_V added to the output (SPEC §1)."""
    _, num_heads, _, head_dim = q.shape
    if b_q is not None:
        q = q + _broadcast_bias(b_q, num_heads, head_dim).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if b_v is not None:
        out = out + _broadcast_bias(b_v, num_heads, head_dim).to(out.dtype)
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b_q: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention with optional symmetry-breaking biases; the model's only attention call."""
    return attention_reference(q, k, v, b_q, b_v, causal)
