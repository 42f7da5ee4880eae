"""Causal self-attention with the symmetry-breaking biases b_Q, b_V (docs/model.md#symmetry-breaking-biases).

`attention(q, k, v, b_q, b_v, causal)` is the single entry point the model calls. q, k, v are (B, H, T, d);
b_q and b_v are None, (d,) shared across heads, or (H, d) per head. Semantics: scores = (q + b_Q)·kᵀ/√d,
softmax (causal mask), output = softmax(·)(v + b_V). Because each softmax row sums to one, adding b_V to the
values equals adding it to the output, which is what the implementations do.

Three implementations of the same function live here (docs/model.md#three-exact-implementations):
- `attention_reference`: the library path, PyTorch SDPA on q + b_Q with b_V added to the output (autograd gives
  the biases' gradients). Runs on every device; in float64, the tests' oracle.
- `attention_triton`: a FlashAttention-2 style Triton kernel (structure of Triton's fused-attention tutorial:
  tiled online softmax in fp32 with the log-sum-exp saved, recomputation in the backward pass, a dK/dV pass over
  key blocks and a separate dQ pass over query blocks, so no atomics). b_Q enters only as a per-key logit bias,
  (q + b_Q)·k = q·k + b_Q·k (docs/model.md): c_j = b_Q·k_j/√d is computed once per (batch, head) in fp32 (a small
  kernel before the forward, fused into the backward's preprocess) and added to each score tile, so no q tile is
  ever modified; the dQ pass needs no bias, and dK_j gains b_Q Σ_i dS_ij/√d, one rank-1 term per key block. b_V is
  added to the output in the epilogue (and subtracted again where the backward needs softmax·v alone). It is
  registered as the custom op `symgpt::attention_fwd` / `symgpt::attention_bwd` so torch.compile traces it
  without a graph break. Gradients of b_Q and b_V (learned mode only) are sums of dQ and dO over batch and time
  (dQ is also the gradient of q + b_Q).
- `attention_flex`: FlexAttention with b_Q as the per-key score term c_j = b_Q·k_j/√d (a score_mod) and b_V added
  to the output; run under torch.compile on CUDA (torch 2.13 has no FlexAttention backward on the CPU).

`attention(..., impl)` dispatches: impl "triton" (the default) uses the Triton op for CUDA tensors in fp16/bf16
with d in {64, 128} and the reference otherwise; "sdpa" and "flex" name the other two. Which one a training run
uses is decided once before torch.compile by kernels/attention_select.py (--attention-impl).
The op returns its outputs and gradients in token-major layout, (B, T, H, d) memory viewed as (B, H, T, d), so the
model's `y.transpose(1, 2).contiguous()` is free. Tests: tests/test_attention_kernel.py (CPU through Triton's
interpreter, CUDA in-process); benchmark: bench/attention.py.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
IMPLEMENTATIONS = ("triton", "sdpa", "flex")  # attention(impl=...); see the module docstring
LOG2_E = 1.4426950408889634


# -----------------------------------------------------------------------------
# Reference (oracle)

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


# -----------------------------------------------------------------------------
# Triton kernels. Logits are kept in base 2: s = q·k · (log2(e)/√d), so the softmax uses exp2 and the saved
# log-sum-exp is lse2 = m + log2(l). Each pass calls its inner loop once over the blocks that need no mask (the bulk
# of the work) and once, with MASKED=True, over the few that do: the causal diagonal, or the ragged tail where T is
# not a multiple of the block (the dK/dV pass needs both: see _attn_bwd_dkdv). A masked step applies the causal mask
# when CAUSAL and zeroes whatever lies past T. Register pressure is at the sm_90 limit in every pass, and small
# changes of live ranges decide whether it spills (bench/attention_sass.py): so each range's bounds are computed
# just before its call, tiles read or written together share one offset computation, and stores add the offsets to
# the base pointer last.

@triton.jit
def _load_rows(base, rows, stride_t, T, HEAD_DIM: tl.constexpr, BOUNDS: tl.constexpr):
    """The (len(rows), d) tile of one (batch, head)'s (T, d) matrix at `base`; rows past T read as 0 when BOUNDS.
    The pointers are rebuilt per call: a (rows, d) tensor of 64-bit pointers kept live across a loop costs
    registers."""
    ptrs = base + rows[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]
    if BOUNDS:
        return tl.load(ptrs, mask=rows[:, None] < T, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _load_row_pair(A, B, rows, stride_at, stride_bt, T, HEAD_DIM: tl.constexpr, BOUNDS: tl.constexpr):
    """The same rows of two matrices of one (batch, head), as _load_rows: (k, v) or (q, dO)."""
    offs_d = tl.arange(0, HEAD_DIM)
    a_ptrs = A + rows[:, None] * stride_at + offs_d[None, :]
    b_ptrs = B + rows[:, None] * stride_bt + offs_d[None, :]
    if BOUNDS:
        return tl.load(a_ptrs, mask=rows[:, None] < T, other=0.0), tl.load(b_ptrs, mask=rows[:, None] < T, other=0.0)
    return tl.load(a_ptrs), tl.load(b_ptrs)


@triton.jit
def _store_rows(base, rows, stride_t, T, tile, HEAD_DIM: tl.constexpr):
    """Store a (len(rows), d) fp32 tile at `base` in its element type, skipping rows past T."""
    tl.store(base + (rows[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]), tile.to(base.dtype.element_ty),
             mask=rows[:, None] < T)


@triton.jit
def _store_row_pair(A, B, rows, stride_t, T, a, b, HEAD_DIM: tl.constexpr):
    """Store two fp32 tiles at the same rows of two matrices laid out alike (dK and dV), skipping rows past T."""
    offs = rows[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(A + offs, a.to(A.dtype.element_ty), mask=rows[:, None] < T)
    tl.store(B + offs, b.to(B.dtype.element_ty), mask=rows[:, None] < T)


@triton.jit
def _load_per_token(base, idx, T, other, BOUNDS: tl.constexpr):
    """One fp32 value per token (lse2, delta, the keys' logit biases c) at `idx`; `other` past T when BOUNDS."""
    if BOUNDS:
        return tl.load(base + idx, mask=idx < T, other=other)
    return tl.load(base + idx)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K, V, C, stride_kt, stride_vt, offs_m, lo, hi, T, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BQ: tl.constexpr, CAUSAL: tl.constexpr,
                    MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Online softmax over the key blocks starting in [lo, hi); K, V, C point at this (batch, head)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = tl.multiple_of(start_n, BLOCK_N) + tl.arange(0, BLOCK_N)
        k, v = _load_row_pair(K, V, cols, stride_kt, stride_vt, T, HEAD_DIM=HEAD_DIM, BOUNDS=MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if HAS_BQ:
            s += _load_per_token(C, cols, T, 0.0, BOUNDS=MASKED)[None, :]
        if MASKED:
            keep = cols[None, :] < T
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            s = tl.where(keep, s, float("-inf"))
        # every row sees at least one unmasked key in its first block, so m_new is finite and no NaN appears
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _query_block(H, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's (batch·head, batch, head, first row, rows) for a pass over query blocks (forward, dQ)."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # launch the longest rows first so the last wave is short
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_bh = tl.program_id(1)
    start_m = pid_m * BLOCK_M
    return off_bh, off_bh // H, off_bh % H, start_m, start_m + tl.arange(0, BLOCK_M)


@triton.jit
def _key_logit_bias_rows(K_head, BQ_head, stride_kt, offs_t, T, qk_scale, HEAD_DIM: tl.constexpr):
    """c_t = (b_Q · k_t) · log2(e)/√d in fp32 for the keys offs_t of one (batch, head): b_Q's whole effect on the
    base-2 scores, since (q + b_Q)·k = q·k + b_Q·k (docs/model.md#symmetry-breaking-biases)."""
    k = _load_rows(K_head, offs_t, stride_kt, T, HEAD_DIM=HEAD_DIM, BOUNDS=True)
    b_q = tl.load(BQ_head + tl.arange(0, HEAD_DIM)).to(tl.float32)
    return tl.sum(k.to(tl.float32) * b_q[None, :], 1) * qk_scale


@triton.jit
def _key_logit_bias(K, BQ, C, stride_kb, stride_kh, stride_kt, stride_bqh, H, T, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """C[b, h, t] = c_t for BLOCK keys of one (batch, head) (see _key_logit_bias_rows); runs before the forward."""
    off_bh = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = _key_logit_bias_rows(K + (off_bh // H) * stride_kb + (off_bh % H) * stride_kh, BQ + (off_bh % H) * stride_bqh,
                             stride_kt, offs_t, T, qk_scale, HEAD_DIM=HEAD_DIM)
    tl.store(C + off_bh * T + offs_t, c, mask=offs_t < T)


@triton.jit
def _attn_fwd(Q, K, V, C, BV, O, LSE,
              stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
              stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
              stride_bvh, H, T, qk_scale,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_BQ: tl.constexpr, HAS_BV: tl.constexpr,
              INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head). Writes O = softmax((q·kᵀ + b_Q·kᵀ)/√d)v + b_V and lse2
    (C holds the keys' logit biases b_Q·k/√d in base 2 when HAS_BQ)."""
    off_bh, off_b, off_h, start_m, offs_m = _query_block(H, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M)
    q = _load_rows(Q + off_b * stride_qb + off_h * stride_qh, offs_m, stride_qt, T, HEAD_DIM=HEAD_DIM, BOUNDS=True)
    K += off_b * stride_kb + off_h * stride_kh
    V += off_b * stride_vb + off_h * stride_vh
    C += off_bh * T

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bulk_end = start_m if CAUSAL else (T // BLOCK_N) * BLOCK_N  # keys no row of this block needs masked
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, C, stride_kt, stride_vt, offs_m, 0, bulk_end, T, qk_scale,
                                    HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL, MASKED=False,
                                    INPUT_PRECISION=INPUT_PRECISION)
    masked_end = min(start_m + BLOCK_M, T) if CAUSAL else T  # after the bulk loop: see the note above
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, C, stride_kt, stride_vt, offs_m, bulk_end, masked_end, T,
                                    qk_scale, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL,
                                    MASKED=True, INPUT_PRECISION=INPUT_PRECISION)

    out = acc / l_i[:, None]
    if HAS_BV:
        out += tl.load(BV + off_h * stride_bvh + tl.arange(0, HEAD_DIM)).to(tl.float32)[None, :]
    _store_rows(O + off_b * stride_ob + off_h * stride_oh, offs_m, stride_ot, T, out, HEAD_DIM=HEAD_DIM)
    tl.store(LSE + off_bh * T + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)


@triton.jit
def _attn_bwd_preprocess(O, DO, BV, DELTA, K, BQ, C,
                         stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot, stride_bvh,
                         stride_kb, stride_kh, stride_kt, stride_bqh, H, T, qk_scale,
                         HEAD_DIM: tl.constexpr, HAS_BV: tl.constexpr, HAS_BQ: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = Σ_j P_ij dP_ij = dO_i · (O_i − b_V): the softmax-backward row term (b_V is not part of P·V); and
    the keys' logit biases c (as the forward's _key_logit_bias) when HAS_BQ."""
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o, do = _load_row_pair(O + off_b * stride_ob + off_h * stride_oh, DO + off_b * stride_dob + off_h * stride_doh,
                           offs_m, stride_ot, stride_dot, T, HEAD_DIM=HEAD_DIM, BOUNDS=True)
    o, do = o.to(tl.float32), do.to(tl.float32)
    if HAS_BV:
        o -= tl.load(BV + off_h * stride_bvh + tl.arange(0, HEAD_DIM)).to(tl.float32)[None, :]
    tl.store(DELTA + off_bh * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)
    if HAS_BQ:
        c = _key_logit_bias_rows(K + off_b * stride_kb + off_h * stride_kh, BQ + off_h * stride_bqh, stride_kt,
                                 offs_m, T, qk_scale, HEAD_DIM=HEAD_DIM)
        tl.store(C + off_bh * T + offs_m, c, mask=offs_m < T)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, ds_sum, k, v, c, Q, DO, LSE, DELTA, stride_qt, stride_dot, offs_n, lo, hi, T,
                         qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BQ: tl.constexpr,
                         CAUSAL: tl.constexpr, MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Accumulate dK (without b_Q's term), dV and Σ_i dS_ij of one key block over the query blocks starting in
    [lo, hi) (transposed: keys are rows); c is the block's key logit biases."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = tl.multiple_of(start_m, BLOCK_M) + tl.arange(0, BLOCK_M)
        q, do = _load_row_pair(Q, DO, rows, stride_qt, stride_dot, T, HEAD_DIM=HEAD_DIM, BOUNDS=MASKED)
        lse = _load_per_token(LSE, rows, T, float("inf"), BOUNDS=MASKED)  # P = 0 on rows past T
        delta = _load_per_token(DELTA, rows, T, 0.0, BOUNDS=MASKED)
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale
        if HAS_BQ:
            s_t += c[:, None]
        p_t = tl.math.exp2(s_t - lse[None, :])
        if MASKED and CAUSAL:
            p_t = tl.where(rows[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
        if HAS_BQ:
            ds_sum += tl.sum(ds_t, 1)
    return dk, dv, ds_sum


@triton.jit
def _attn_bwd_dkdv(Q, K, V, BQ, C, DO, LSE, DELTA, DK, DV,
                   stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                   stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                   stride_gb, stride_gh, stride_gt, stride_bqh, H, T, qk_scale, sm_scale,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_BQ: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dK = Σ dSᵀ(q + b_Q)/√d = (Σ dSᵀq + b_Q Σ dSᵀ)/√d and dV = Σ Pᵀ dO for BLOCK_N keys of one
    (batch, head).

    The query blocks that see these keys run in three ranges: the masked diagonal (causal only: the rows of the key
    block itself), the unmasked bulk below it, and the masked ragged tail past the last full query block. The
    diagonal comes first and the tail last, so unlike the forward and dQ passes, whose masked blocks are adjacent,
    this pass has two masked ranges around its bulk; both use the same MASKED step (the causal mask keeps every
    entry of the tail, whose rows all follow these keys)."""
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)

    k, v = _load_row_pair(K + off_b * stride_kb + off_h * stride_kh, V + off_b * stride_vb + off_h * stride_vh, offs_n,
                          stride_kt, stride_vt, T, HEAD_DIM=HEAD_DIM, BOUNDS=True)
    c = _load_per_token(C + off_bh * T, offs_n, T, 0.0, BOUNDS=True) if HAS_BQ else tl.zeros([BLOCK_N], tl.float32)
    Q += off_b * stride_qb + off_h * stride_qh
    DO += off_b * stride_dob + off_h * stride_doh
    LSE += off_bh * T
    DELTA += off_bh * T

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    ds_sum = tl.zeros([BLOCK_N], tl.float32)
    bulk_start = start_n + BLOCK_N if CAUSAL else 0  # a multiple of BLOCK_M; no earlier row sees these keys
    dk, dv, ds_sum = _attn_bwd_dkdv_inner(dk, dv, ds_sum, k, v, c, Q, DO, LSE, DELTA, stride_qt, stride_dot, offs_n,
                                          start_n, min(bulk_start, T), T, qk_scale,
                                          HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL,
                                          MASKED=True, INPUT_PRECISION=INPUT_PRECISION)
    bulk_end = (T // BLOCK_M) * BLOCK_M
    dk, dv, ds_sum = _attn_bwd_dkdv_inner(dk, dv, ds_sum, k, v, c, Q, DO, LSE, DELTA, stride_qt, stride_dot, offs_n,
                                          bulk_start, bulk_end, T, qk_scale,
                                          HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL,
                                          MASKED=False, INPUT_PRECISION=INPUT_PRECISION)
    dk, dv, ds_sum = _attn_bwd_dkdv_inner(dk, dv, ds_sum, k, v, c, Q, DO, LSE, DELTA, stride_qt, stride_dot, offs_n,
                                          max(bulk_end, bulk_start), T, T, qk_scale,
                                          HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL,
                                          MASKED=True, INPUT_PRECISION=INPUT_PRECISION)
    if HAS_BQ:  # b_Q's rank-1 term: dK_j += b_Q Σ_i dS_ij (the 1/√d follows below)
        dk += ds_sum[:, None] * tl.load(BQ + off_h * stride_bqh + tl.arange(0, HEAD_DIM)).to(tl.float32)[None, :]

    _store_row_pair(DK + off_b * stride_gb + off_h * stride_gh, DV + off_b * stride_gb + off_h * stride_gh, offs_n,
                    stride_gt, T, dk * sm_scale, dv, HEAD_DIM=HEAD_DIM)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, C, stride_kt, stride_vt, offs_m, lo, hi, T, qk_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BQ: tl.constexpr, CAUSAL: tl.constexpr,
                       MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Accumulate dQ of one query block over the key blocks starting in [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = tl.multiple_of(start_n, BLOCK_N) + tl.arange(0, BLOCK_N)
        k, v = _load_row_pair(K, V, cols, stride_kt, stride_vt, T, HEAD_DIM=HEAD_DIM, BOUNDS=MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if HAS_BQ:
            s += _load_per_token(C, cols, T, 0.0, BOUNDS=MASKED)[None, :]
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            keep = cols[None, :] < T
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, C, DO, LSE, DELTA, DQ,
                 stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                 stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                 stride_gb, stride_gh, stride_gt, H, T, qk_scale, sm_scale,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_BQ: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dQ = Σ dS k/√d for BLOCK_M query rows of one (batch, head); also the gradient of q + b_Q
    (b_Q itself enters only through the key logit biases C)."""
    off_bh, off_b, off_h, start_m, offs_m = _query_block(H, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M)
    q, do = _load_row_pair(Q + off_b * stride_qb + off_h * stride_qh, DO + off_b * stride_dob + off_h * stride_doh,
                           offs_m, stride_qt, stride_dot, T, HEAD_DIM=HEAD_DIM, BOUNDS=True)
    lse = _load_per_token(LSE + off_bh * T, offs_m, T, float("inf"), BOUNDS=True)
    delta = _load_per_token(DELTA + off_bh * T, offs_m, T, 0.0, BOUNDS=True)
    K += off_b * stride_kb + off_h * stride_kh
    V += off_b * stride_vb + off_h * stride_vh
    C += off_bh * T

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bulk_end = start_m if CAUSAL else (T // BLOCK_N) * BLOCK_N  # keys no row of this block needs masked
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, C, stride_kt, stride_vt, offs_m, 0, bulk_end, T, qk_scale,
                            HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL, MASKED=False,
                            INPUT_PRECISION=INPUT_PRECISION)
    masked_end = min(start_m + BLOCK_M, T) if CAUSAL else T  # after the bulk loop: see the note above
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, C, stride_kt, stride_vt, offs_m, bulk_end, masked_end, T,
                            qk_scale, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL, MASKED=True,
                            INPUT_PRECISION=INPUT_PRECISION)
    _store_rows(DQ + off_b * stride_gb + off_h * stride_gh, offs_m, stride_gt, T, dq * sm_scale, HEAD_DIM=HEAD_DIM)


# -----------------------------------------------------------------------------
# Tile shapes. By default each pass runs one shipped tile choice per (GPU generation, head dim), so the first call on
# a new sequence length compiles one kernel per pass instead of autotuning dozens (minutes on a cold machine).
# SYMGPT_ATTENTION_AUTOTUNE=1 autotunes over the lists below instead, keyed by (T, d, causal) plus the dtypes of the
# tensor arguments (Triton adds those to every key).
# Forward and dQ: BLOCK_M query rows per program, BLOCK_N keys per step (BLOCK_M % BLOCK_N == 0); dK/dV: BLOCK_N keys
# per program, BLOCK_M query rows per step (BLOCK_N % BLOCK_M == 0).

@dataclasses.dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Hopper (sm_90): the shapes of Triton's fused-attention tutorial for Hopper (forward 128 x 64; backward 32 x 128
# for dK/dV and 128 x 32 for dQ, deep pipelines), with the warp counts that compile without register spills in the
# offline sm_90 build (bench/attention_sass.py). Other GPUs (and the CPU interpreter): smaller, shallower tiles.
# Chosen, not yet tuned on a GPU: measure with SYMGPT_ATTENTION_AUTOTUNE=1 and bench/attention.py, then update.
TILES: dict[tuple[str, str, int], Tile] = {
    ("hopper", "fwd", 64): Tile(128, 64, 4, 3),
    ("hopper", "fwd", 128): Tile(128, 64, 8, 3),
    ("hopper", "dkdv", 64): Tile(32, 128, 8, 4),
    ("hopper", "dkdv", 128): Tile(32, 128, 8, 4),
    ("hopper", "dq", 64): Tile(128, 32, 4, 4),
    ("hopper", "dq", 128): Tile(128, 32, 8, 3),
    ("other", "fwd", 64): Tile(64, 64, 4, 2),
    ("other", "fwd", 128): Tile(64, 32, 4, 2),
    ("other", "dkdv", 64): Tile(32, 64, 4, 2),
    ("other", "dkdv", 128): Tile(32, 64, 4, 2),
    ("other", "dq", 64): Tile(64, 32, 4, 2),
    ("other", "dq", 128): Tile(64, 32, 4, 2),
}
AUTOTUNE_ENV = "SYMGPT_ATTENTION_AUTOTUNE"


@functools.cache
def _is_hopper(device_index: int) -> bool:
    """Whether a CUDA device is sm_90 (looked up once: tile_for runs on every launch)."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def tile_for(pass_name: str, q: torch.Tensor) -> Tile:
    """The shipped tile of a pass ("fwd", "dkdv", "dq") for q's device and head dim, shrunk to a short sequence."""
    hopper = q.is_cuda and _is_hopper(q.device.index)
    tile = TILES[("hopper" if hopper else "other", pass_name, q.shape[-1])]
    t = max(16, triton.next_power_of_2(q.shape[2]))  # rows or keys past the sequence would be pure masking
    return dataclasses.replace(tile, block_m=min(tile.block_m, t), block_n=min(tile.block_n, t))


def _configs(pairs: list[tuple[int, int]], stages: tuple[int, ...]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n in pairs for s in stages for w in (4, 8)]


def _prune_small_t(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop tiles taller or wider than the sequence (their extra rows are pure masking) unless nothing is left."""
    t = max(16, triton.next_power_of_2(named_args["T"]))
    kept = [c for c in configs if max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) <= t]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


_TUNE_KEY = ["T", "HEAD_DIM", "CAUSAL"]
_PRUNE = {"early_config_prune": _prune_small_t}
_attn_fwd_tuned = triton.autotune(
    _configs([(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)], (3, 4)), key=_TUNE_KEY, prune_configs_by=_PRUNE,
)(_attn_fwd)
_attn_bwd_dkdv_tuned = triton.autotune(
    _configs([(32, 64), (64, 64), (32, 128), (64, 128)], (2, 3, 4)), key=_TUNE_KEY, prune_configs_by=_PRUNE,
)(_attn_bwd_dkdv)
_attn_bwd_dq_tuned = triton.autotune(
    _configs([(64, 32), (64, 64), (128, 32), (128, 64)], (2, 3, 4)), key=_TUNE_KEY, prune_configs_by=_PRUNE,
)(_attn_bwd_dq)
_ROWS_BLOCK = 64  # rows per program of the small row-wise kernels (backward preprocess, key logit biases)


# -----------------------------------------------------------------------------
# Launchers and the custom op

def _token_major_empty(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped like x (B, H, T, d) whose memory is laid out (B, T, H, d)."""
    b, h, t, d = x.shape
    return x.new_empty((b, t, h, d)).transpose(1, 2)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _bias_arg(bias: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The pointer and per-head stride for a bias; a (d,) bias is read with head stride 0."""
    if bias is None:
        return dummy, 0
    bias = bias.contiguous()
    return bias, (bias.shape[-1] if bias.dim() == 2 else 0)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _launch_meta(q: torch.Tensor) -> dict:
    return {"HEAD_DIM": q.shape[-1], "INPUT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32"}


def _launch(kernel, tuned, pass_name: str, q: torch.Tensor, blocks: list[int], grid, args: tuple, meta: dict) -> None:
    """Run one pass: the forced `blocks` (tests), the autotuned kernel (SYMGPT_ATTENTION_AUTOTUNE=1) or the shipped
    tile. `grid(block_m, block_n)` is the launch grid; blocks are given as (BLOCK_M, BLOCK_N) of this pass."""
    if blocks:
        kernel[grid(*blocks)](*args, **meta, BLOCK_M=blocks[0], BLOCK_N=blocks[1])
    elif os.environ.get(AUTOTUNE_ENV) == "1":
        tuned[lambda cfg: grid(cfg["BLOCK_M"], cfg["BLOCK_N"])](*args, **meta)
    else:
        tile = tile_for(pass_name, q)
        kernel[grid(tile.block_m, tile.block_n)](*args, **meta, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                                                 num_warps=tile.num_warps, num_stages=tile.num_stages)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b_q: torch.Tensor | None,
             b_v: torch.Tensor | None, causal: bool, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    B, H, T, D = q.shape
    qk_scale = LOG2_E / math.sqrt(D)
    o = _token_major_empty(q)
    lse = torch.empty((B, H, T), device=q.device, dtype=torch.float32)
    c = lse  # a placeholder pointer without b_Q
    if b_q is not None:
        bq, stride_bqh = _bias_arg(b_q, q)
        c = torch.empty_like(lse)
        _key_logit_bias[(triton.cdiv(T, _ROWS_BLOCK), B * H)](k, bq, c, *_strides(k), stride_bqh, H, T, qk_scale,
                                                             HEAD_DIM=D, BLOCK=_ROWS_BLOCK)
    bv, stride_bvh = _bias_arg(b_v, q)
    args = (q, k, v, c, bv, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o), stride_bvh, H, T,
            qk_scale)
    meta = dict(_launch_meta(q), CAUSAL=causal, HAS_BQ=b_q is not None, HAS_BV=b_v is not None)
    _launch(_attn_fwd, _attn_fwd_tuned, "fwd", q, blocks, lambda m, n: (triton.cdiv(T, m), B * H), args, meta)
    return o, lse


def _backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor, b_q: torch.Tensor | None, b_v: torch.Tensor | None, causal: bool,
              blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    do, q, k, v = (_last_dim_contiguous(x) for x in (do, q, k, v))
    B, H, T, D = q.shape
    sm_scale = 1.0 / math.sqrt(D)
    qk_scale = sm_scale * LOG2_E
    bq, stride_bqh = _bias_arg(b_q, q)
    bv, stride_bvh = _bias_arg(b_v, q)

    delta = torch.empty_like(lse)
    c = torch.empty_like(lse) if b_q is not None else lse  # the forward's key logit biases, recomputed here
    _attn_bwd_preprocess[(triton.cdiv(T, _ROWS_BLOCK), B * H)](
        o, do, bv, delta, k, bq, c, *_strides(o), *_strides(do), stride_bvh, *_strides(k), stride_bqh, H, T,
        qk_scale, HEAD_DIM=D, HAS_BV=b_v is not None, HAS_BQ=b_q is not None, BLOCK_M=_ROWS_BLOCK)

    dq, dk, dv = _token_major_empty(q), _token_major_empty(k), _token_major_empty(v)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq))
    meta = dict(_launch_meta(q), CAUSAL=causal, HAS_BQ=b_q is not None)
    _launch(_attn_bwd_dkdv, _attn_bwd_dkdv_tuned, "dkdv", q, blocks[::-1],  # keys per program come first in blocks
            lambda m, n: (triton.cdiv(T, n), B * H),
            (q, k, v, bq, c, do, lse, delta, dk, dv, *strides, stride_bqh, H, T, qk_scale, sm_scale), meta)
    _launch(_attn_bwd_dq, _attn_bwd_dq_tuned, "dq", q, blocks, lambda m, n: (triton.cdiv(T, m), B * H),
            (q, k, v, c, do, lse, delta, dq, *strides, H, T, qk_scale, sm_scale), meta)
    return dq, dk, dv


@torch.library.custom_op("symgpt::attention_fwd", mutates_args=())
def _attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b_q: torch.Tensor | None,
                      b_v: torch.Tensor | None, causal: bool, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse2); blocks = [] autotunes, [BLOCK_M, BLOCK_N] forces the tile shape (tests, interpreter)."""
    return _forward(q, k, v, b_q, b_v, causal, blocks)


@_attention_fwd_op.register_fake
def _(q, k, v, b_q, b_v, causal, blocks):
    B, H, T, _ = q.shape
    return _token_major_empty(q), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("symgpt::attention_bwd", mutates_args=())
def _attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, b_q: torch.Tensor | None, b_v: torch.Tensor | None, causal: bool,
                      blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv); dq is also the gradient of q + b_Q."""
    return _backward(do, q, k, v, o, lse, b_q, b_v, causal, blocks)


@_attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, b_q, b_v, causal, blocks):
    return _token_major_empty(q), _token_major_empty(k), _token_major_empty(v)


def _bias_grad(grad: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Σ over batch and time of a (B, H, T, d) gradient, per head for an (H, d) bias, over heads for (d,)."""
    g = grad.sum(dim=(0, 2), dtype=torch.float32)
    return (g if bias.dim() == 2 else g.sum(0)).to(bias.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, b_q, b_v, causal, blocks = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, b_q, b_v)
    ctx.causal, ctx.blocks = causal, blocks


def _attention_backward(ctx, grad_out, grad_lse):
    q, k, v, o, lse, b_q, b_v = ctx.saved_tensors
    dq, dk, dv = _attention_bwd_op(grad_out, q, k, v, o, lse, b_q, b_v, ctx.causal, ctx.blocks)
    db_q = _bias_grad(dq, b_q) if b_q is not None and ctx.needs_input_grad[3] else None
    db_v = _bias_grad(grad_out, b_v) if b_v is not None and ctx.needs_input_grad[4] else None
    return dq, dk, dv, db_q, db_v, None, None


_attention_fwd_op.register_autograd(_attention_backward, setup_context=_setup_context)


# -----------------------------------------------------------------------------
# Public entry points

def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b_q: torch.Tensor | None,
                  b_v: torch.Tensor | None, blocks: tuple[int, int] | None) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"attention_triton: q, k, v must share one (B, H, T, d) shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention_triton: q, k, v must share one dtype in {DTYPES}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype} (use attention_reference for others)")
    _, num_heads, _, head_dim = q.shape
    if q.numel() >= 2**31:
        raise ValueError(f"attention_triton: q has {q.numel()} elements; the kernel's int32 offsets need fewer than "
                         "2**31 (split the batch)")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"attention_triton: head dim {head_dim} is not supported; the kernel handles {HEAD_DIMS} "
                         "(use attention_reference for others)")
    for name, bias in (("b_q", b_q), ("b_v", b_v)):
        if bias is not None:
            if bias.shape not in ((head_dim,), (num_heads, head_dim)):
                raise ValueError(f"attention_triton: {name} has shape {tuple(bias.shape)}; it must be ({head_dim},) "
                                 f"shared across heads or ({num_heads}, {head_dim}) per head")
            if bias.device != q.device:
                raise ValueError(f"attention_triton: {name} is on {bias.device} but q is on {q.device}")
    if blocks is not None:
        m, n = blocks
        if not all(x >= 16 and x & (x - 1) == 0 for x in (m, n)) or m % n:
            raise ValueError(f"attention_triton: blocks={blocks} must be powers of two >= 16 with "
                             "BLOCK_M a multiple of BLOCK_N, e.g. (32, 16)")


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b_q: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    causal: bool = True,
    blocks: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The Triton kernel on any device Triton runs on (CUDA, or the CPU interpreter with TRITON_INTERPRET=1).

    blocks=None autotunes the tile shapes; (BLOCK_M, BLOCK_N) forces them (query rows per program and keys per
    step in the forward and dQ passes, swapped for the dK/dV pass), which tests use to exercise multi-block and
    ragged-tail paths on tiny inputs.
    """
    _check_inputs(q, k, v, b_q, b_v, blocks)
    out, _ = torch.ops.symgpt.attention_fwd(q, k, v, b_q, b_v, causal, list(blocks or ()))
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
    """Attention with optional symmetry-breaking biases; the model's only attention call.

    impl "triton": CUDA fp16/bf16 inputs with d in {64, 128} and as many keys as queries run the Triton kernel and
    everything else (CPU, fp32, other head dims, a generation step's queries against its KV cache) runs SDPA;
    "sdpa": always SDPA (attention_reference); "flex": FlexAttention (attention_flex).
    The model carries impl as a plain attribute, so torch.compile sees a constant and traces one path.
    """
    if impl == "flex":
        return attention_flex(q, k, v, b_q, b_v, causal)
    if impl == "triton":
        if (kernel_problem(q.device.type, q.dtype, q.shape[-1]) is None and k.shape == q.shape
                and k.dtype == q.dtype == v.dtype):
            return attention_triton(q, k, v, b_q, b_v, causal)
    elif impl != "sdpa":
        raise ValueError(f"attention: impl {impl!r} is not one of {IMPLEMENTATIONS}")
    return attention_reference(q, k, v, b_q, b_v, causal)
