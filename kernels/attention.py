"""The Triton attention kernel with the symmetry-breaking biases b_Q, b_V
(docs/model.md#the-exact-rewrites-in-the-kernel: b_Q as the per-key logit bias c_j = b_Q·k_j/√d, b_V added in the
epilogue).

`attention_triton(q, k, v, b_q, b_v, causal)` computes softmax((q + b_Q)·kᵀ/√d, causal mask)·(v + b_V) for q, k, v
of shape (B, H, T, d) in fp16, bf16 or fp32 and d in {64, 128}, with b_q, b_v None, (d,) shared across heads or
(H, d) per head. Its reference is attention_reference (SDPA) in kernels/attention_paths.py, which chooses the path.

A FlashAttention-2 style kernel with the structure of Triton's fused-attention tutorial: tiled online softmax in
fp32 with the log-sum-exp saved, recomputation in the backward pass, a dK/dV pass over key blocks and a separate dQ
pass over query blocks, so no atomics. c is computed once per (batch, head) by a small kernel before the forward and
returned with the log-sum-exp, so the backward reuses it. The custom ops `symgpt::attention_fwd` /
`symgpt::attention_bwd` let torch.compile trace it without a graph break. Outputs and gradients are token-major,
(B, T, H, d) memory viewed as (B, H, T, d), so the model's `y.transpose(1, 2).contiguous()` is free.
Tests: tests/test_attention_kernel.py; benchmark: bench/attention.py.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch
import triton
import triton.language as tl

from kernels import ATTENTION_HEAD_DIMS

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2_E = 1.4426950408889634


# -----------------------------------------------------------------------------
# Triton kernels. Logits are kept in base 2: s = q·k · (log2(e)/√d), so the softmax uses exp2 and the saved
# log-sum-exp is lse2 = m + log2(l). Layouts (checked and, where needed, made so by the launchers): q, k and v share
# one set of strides (stride_b, stride_h, stride_t; unit stride along d), the one stride set every pass takes; the
# output O, the output gradient dO and the gradients dQ, dK, dV are token-major, (B, T, H, d) memory, whose offsets
# the kernels derive from H, T and d (_token_major); lse2, delta and the keys' logit biases c are (B·H, T) fp32.
# Each pass calls its inner loop once over the blocks that need no mask (the bulk of the work) and once, with
# MASKED=True, over the few that do: the causal diagonal, or the ragged tail where T is not a multiple of the block
# (the dK/dV pass needs both: see _attn_bwd_dkdv). A masked step applies the causal mask when CAUSAL and zeroes
# whatever lies past T. Register pressure is at the sm_90 limit in every pass, and small changes of live ranges
# decide whether it spills: so each range's bounds are computed just before its call, tiles read or written
# together share one offset computation, and stores add the offsets to the base pointer last.

@triton.jit
def _token_major(base, off_b, off_h, H, T, HEAD_DIM: tl.constexpr):
    """The (batch, head) matrix of a token-major (B, T, H, d) tensor at `base`; its rows are H·d apart."""
    return base + off_b * T * H * HEAD_DIM + off_h * HEAD_DIM


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
def _load_row_pair(A, B, rows, stride_t, T, HEAD_DIM: tl.constexpr, BOUNDS: tl.constexpr):
    """The same rows of two matrices laid out alike, (k, v) or (O, dO), as _load_rows, from one offset tile."""
    offs = rows[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]
    if BOUNDS:
        inside = rows[:, None] < T
        return tl.load(A + offs, mask=inside, other=0.0), tl.load(B + offs, mask=inside, other=0.0)
    return tl.load(A + offs), tl.load(B + offs)


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
def _score_tile(q, K, V, C, stride_t, offs_m, cols, T, qk_scale, HEAD_DIM: tl.constexpr, HAS_BQ: tl.constexpr,
                CAUSAL: tl.constexpr, MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """(k, v, s) of the key block `cols` for the query rows offs_m (forward and dQ passes): the base-2 scores
    s = q·kᵀ·log2(e)/√d + c, −inf where a MASKED step masks them (causal, or keys past T)."""
    k, v = _load_row_pair(K, V, cols, stride_t, T, HEAD_DIM=HEAD_DIM, BOUNDS=MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
    if HAS_BQ:
        s += _load_per_token(C, cols, T, 0.0, BOUNDS=MASKED)[None, :]
    if MASKED:
        keep = cols[None, :] < T
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= cols[None, :])
        s = tl.where(keep, s, float("-inf"))
    return k, v, s


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K, V, C, stride_t, offs_m, lo, hi, T, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BQ: tl.constexpr, CAUSAL: tl.constexpr,
                    MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Online softmax over the key blocks starting in [lo, hi); K, V, C point at this (batch, head)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = tl.multiple_of(start_n, BLOCK_N) + tl.arange(0, BLOCK_N)
        k, v, s = _score_tile(q, K, V, C, stride_t, offs_m, cols, T, qk_scale, HEAD_DIM=HEAD_DIM, HAS_BQ=HAS_BQ,
                              CAUSAL=CAUSAL, MASKED=MASKED, INPUT_PRECISION=INPUT_PRECISION)
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
def _key_logit_bias(K, BQ, C, stride_b, stride_h, stride_t, stride_bqh, H, T, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """C[b, h, t] = (b_Q · k_t) · log2(e)/√d in fp32 for BLOCK keys of one (batch, head): b_Q's whole effect on the
    base-2 scores (docs/model.md#the-exact-rewrites-in-the-kernel)."""
    off_bh = tl.program_id(1)
    off_b, off_h = off_bh // H, off_bh % H
    offs_t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    k = _load_rows(K + off_b * stride_b + off_h * stride_h, offs_t, stride_t, T, HEAD_DIM=HEAD_DIM, BOUNDS=True)
    b_q = tl.load(BQ + off_h * stride_bqh + tl.arange(0, HEAD_DIM)).to(tl.float32)
    tl.store(C + off_bh * T + offs_t, tl.sum(k.to(tl.float32) * b_q[None, :], 1) * qk_scale, mask=offs_t < T)


@triton.jit
def _attn_fwd(Q, K, V, C, BV, O, LSE, stride_b, stride_h, stride_t, stride_bvh, H, T, qk_scale,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_BQ: tl.constexpr, HAS_BV: tl.constexpr,
              INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head). Writes O = softmax((q·kᵀ + b_Q·kᵀ)/√d)v + b_V and lse2
    (C holds the keys' logit biases b_Q·k/√d in base 2 when HAS_BQ)."""
    off_bh, off_b, off_h, start_m, offs_m = _query_block(H, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M)
    head = off_b * stride_b + off_h * stride_h
    q = _load_rows(Q + head, offs_m, stride_t, T, HEAD_DIM=HEAD_DIM, BOUNDS=True)
    K += head
    V += head
    C += off_bh * T

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bulk_end = start_m if CAUSAL else (T // BLOCK_N) * BLOCK_N  # keys no row of this block needs masked
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, C, stride_t, offs_m, 0, bulk_end, T, qk_scale,
                                    HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL, MASKED=False,
                                    INPUT_PRECISION=INPUT_PRECISION)
    masked_end = min(start_m + BLOCK_M, T) if CAUSAL else T  # after the bulk loop: see the note above
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, C, stride_t, offs_m, bulk_end, masked_end, T, qk_scale,
                                    HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL, MASKED=True,
                                    INPUT_PRECISION=INPUT_PRECISION)

    out = acc / l_i[:, None]
    if HAS_BV:
        out += tl.load(BV + off_h * stride_bvh + tl.arange(0, HEAD_DIM)).to(tl.float32)[None, :]
    _store_rows(_token_major(O, off_b, off_h, H, T, HEAD_DIM=HEAD_DIM), offs_m, H * HEAD_DIM, T, out,
                HEAD_DIM=HEAD_DIM)
    tl.store(LSE + off_bh * T + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)


@triton.jit
def _attn_bwd_preprocess(O, DO, BV, DELTA, stride_bvh, H, T, HEAD_DIM: tl.constexpr, HAS_BV: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    """delta_i = Σ_j P_ij dP_ij = dO_i · (O_i − b_V): the softmax-backward row term (b_V is not part of P·V)."""
    off_bh = tl.program_id(1)
    off_b, off_h = off_bh // H, off_bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o, do = _load_row_pair(_token_major(O, off_b, off_h, H, T, HEAD_DIM=HEAD_DIM),
                           _token_major(DO, off_b, off_h, H, T, HEAD_DIM=HEAD_DIM), offs_m, H * HEAD_DIM, T,
                           HEAD_DIM=HEAD_DIM, BOUNDS=True)
    o, do = o.to(tl.float32), do.to(tl.float32)
    if HAS_BV:
        o -= tl.load(BV + off_h * stride_bvh + tl.arange(0, HEAD_DIM)).to(tl.float32)[None, :]
    tl.store(DELTA + off_bh * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, ds_sum, k, v, c, Q, DO, LSE, DELTA, stride_t, offs_n, lo, hi, H, T, qk_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BQ: tl.constexpr,
                         CAUSAL: tl.constexpr, MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Accumulate dK (without b_Q's term), dV and Σ_i dS_ij of one key block over the query blocks starting in
    [lo, hi) (transposed: keys are rows); c is the block's key logit biases."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = tl.multiple_of(start_m, BLOCK_M) + tl.arange(0, BLOCK_M)
        q = _load_rows(Q, rows, stride_t, T, HEAD_DIM=HEAD_DIM, BOUNDS=MASKED)
        do = _load_rows(DO, rows, H * HEAD_DIM, T, HEAD_DIM=HEAD_DIM, BOUNDS=MASKED)
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
def _attn_bwd_dkdv(Q, K, V, BQ, C, DO, LSE, DELTA, DK, DV, stride_b, stride_h, stride_t, stride_bqh, H, T,
                   qk_scale, sm_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_BQ: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dK = Σ dSᵀ(q + b_Q)/√d = (Σ dSᵀq + b_Q Σ dSᵀ)/√d and dV = Σ Pᵀ dO for BLOCK_N keys of one
    (batch, head).

    The query blocks that see these keys run in three ranges: the masked diagonal (causal only: the rows of the key
    block itself), the unmasked bulk below it, and the masked ragged tail past the last full query block. The
    diagonal comes first and the tail last, so unlike the forward and dQ passes, whose masked blocks are adjacent,
    this pass has two masked ranges around its bulk; both use the same MASKED step (the causal mask keeps every
    entry of the tail, whose rows all follow these keys)."""
    off_bh = tl.program_id(1)
    off_b, off_h = off_bh // H, off_bh % H
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)

    head = off_b * stride_b + off_h * stride_h
    k, v = _load_row_pair(K + head, V + head, offs_n, stride_t, T, HEAD_DIM=HEAD_DIM, BOUNDS=True)
    c = _load_per_token(C + off_bh * T, offs_n, T, 0.0, BOUNDS=True) if HAS_BQ else tl.zeros([BLOCK_N], tl.float32)
    Q += head
    DO = _token_major(DO, off_b, off_h, H, T, HEAD_DIM=HEAD_DIM)
    LSE += off_bh * T
    DELTA += off_bh * T

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    ds_sum = tl.zeros([BLOCK_N], tl.float32)
    bulk_start = start_n + BLOCK_N if CAUSAL else 0  # a multiple of BLOCK_M; no earlier row sees these keys
    dk, dv, ds_sum = _attn_bwd_dkdv_inner(dk, dv, ds_sum, k, v, c, Q, DO, LSE, DELTA, stride_t, offs_n, start_n,
                                          min(bulk_start, T), H, T, qk_scale, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
                                          HAS_BQ=HAS_BQ, CAUSAL=CAUSAL, MASKED=True, INPUT_PRECISION=INPUT_PRECISION)
    bulk_end = (T // BLOCK_M) * BLOCK_M
    dk, dv, ds_sum = _attn_bwd_dkdv_inner(dk, dv, ds_sum, k, v, c, Q, DO, LSE, DELTA, stride_t, offs_n, bulk_start,
                                          bulk_end, H, T, qk_scale, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
                                          HAS_BQ=HAS_BQ, CAUSAL=CAUSAL, MASKED=False, INPUT_PRECISION=INPUT_PRECISION)
    dk, dv, ds_sum = _attn_bwd_dkdv_inner(dk, dv, ds_sum, k, v, c, Q, DO, LSE, DELTA, stride_t, offs_n,
                                          max(bulk_end, bulk_start), T, H, T, qk_scale, HEAD_DIM=HEAD_DIM,
                                          BLOCK_M=BLOCK_M, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL, MASKED=True,
                                          INPUT_PRECISION=INPUT_PRECISION)
    if HAS_BQ:  # b_Q's rank-1 term: dK_j += b_Q Σ_i dS_ij (the 1/√d follows below)
        dk += ds_sum[:, None] * tl.load(BQ + off_h * stride_bqh + tl.arange(0, HEAD_DIM)).to(tl.float32)[None, :]

    _store_row_pair(_token_major(DK, off_b, off_h, H, T, HEAD_DIM=HEAD_DIM),
                    _token_major(DV, off_b, off_h, H, T, HEAD_DIM=HEAD_DIM), offs_n, H * HEAD_DIM, T, dk * sm_scale,
                    dv, HEAD_DIM=HEAD_DIM)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, C, stride_t, offs_m, lo, hi, T, qk_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BQ: tl.constexpr, CAUSAL: tl.constexpr,
                       MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Accumulate dQ of one query block over the key blocks starting in [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = tl.multiple_of(start_n, BLOCK_N) + tl.arange(0, BLOCK_N)
        k, v, s = _score_tile(q, K, V, C, stride_t, offs_m, cols, T, qk_scale, HEAD_DIM=HEAD_DIM, HAS_BQ=HAS_BQ,
                              CAUSAL=CAUSAL, MASKED=MASKED, INPUT_PRECISION=INPUT_PRECISION)
        p = tl.math.exp2(s - lse[:, None])  # 0 where masked (s = −inf) and on rows past T (lse = +inf)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, C, DO, LSE, DELTA, DQ, stride_b, stride_h, stride_t, H, T, qk_scale, sm_scale,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_BQ: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dQ = Σ dS k/√d for BLOCK_M query rows of one (batch, head); also the gradient of q + b_Q
    (b_Q itself enters only through the key logit biases C)."""
    off_bh, off_b, off_h, start_m, offs_m = _query_block(H, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M)
    head = off_b * stride_b + off_h * stride_h
    q = _load_rows(Q + head, offs_m, stride_t, T, HEAD_DIM=HEAD_DIM, BOUNDS=True)
    do = _load_rows(_token_major(DO, off_b, off_h, H, T, HEAD_DIM=HEAD_DIM), offs_m, H * HEAD_DIM, T,
                    HEAD_DIM=HEAD_DIM, BOUNDS=True)
    lse = _load_per_token(LSE + off_bh * T, offs_m, T, float("inf"), BOUNDS=True)
    delta = _load_per_token(DELTA + off_bh * T, offs_m, T, 0.0, BOUNDS=True)
    K += head
    V += head
    C += off_bh * T

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bulk_end = start_m if CAUSAL else (T // BLOCK_N) * BLOCK_N  # keys no row of this block needs masked
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, C, stride_t, offs_m, 0, bulk_end, T, qk_scale,
                            HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL, MASKED=False,
                            INPUT_PRECISION=INPUT_PRECISION)
    masked_end = min(start_m + BLOCK_M, T) if CAUSAL else T  # after the bulk loop: see the note above
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, C, stride_t, offs_m, bulk_end, masked_end, T, qk_scale,
                            HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, HAS_BQ=HAS_BQ, CAUSAL=CAUSAL, MASKED=True,
                            INPUT_PRECISION=INPUT_PRECISION)
    _store_rows(_token_major(DQ, off_b, off_h, H, T, HEAD_DIM=HEAD_DIM), offs_m, H * HEAD_DIM, T, dq * sm_scale,
                HEAD_DIM=HEAD_DIM)


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
# offline sm_90 build (bench/kernels.py). Other GPUs (and the CPU interpreter): smaller, shallower tiles; dK/dV with 8
# warps, which the sm_80 build needs to stay clear of spills at both head dims (bench/kernels.py; 4 warps spilled).
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
    ("other", "dkdv", 64): Tile(32, 64, 8, 2),
    ("other", "dkdv", 128): Tile(32, 64, 8, 2),
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


def _as_token_major(x: torch.Tensor) -> torch.Tensor:
    """x itself when its memory is token-major (the op's own outputs, and the model's output gradient), else a
    token-major copy: the layout the kernels derive for O, dO, dQ, dK and dV."""
    return x if x.transpose(1, 2).is_contiguous() else _token_major_empty(x).copy_(x)


def _shared_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v as the kernels take them: one set of strides for the three (size-1 dimensions aside) and unit stride
    along d. The model's q, k, v, views of one QKV projection, already share it; others become contiguous copies."""
    def strides(x: torch.Tensor) -> list[int]:
        return [s for s, n in zip(x.stride(), x.shape) if n > 1]

    if strides(q) == strides(k) == strides(v) and (q.shape[-1] == 1 or q.stride(-1) == 1):
        return q, k, v
    return q.contiguous(), k.contiguous(), v.contiguous()


def _bias_arg(bias: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The pointer and per-head stride for a bias; a (d,) bias is read with head stride 0."""
    if bias is None:
        return dummy, 0
    bias = bias.contiguous()
    return bias, (bias.shape[-1] if bias.dim() == 2 else 0)


def _launch(kernel, tuned, pass_name: str, q: torch.Tensor, grid, args: tuple, meta: dict) -> None:
    """Run one pass: the shipped tile (tile_for) or, with SYMGPT_ATTENTION_AUTOTUNE=1, the autotuned kernel.
    `grid(block_m, block_n)` is the launch grid."""
    meta = dict(meta, HEAD_DIM=q.shape[-1], INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if os.environ.get(AUTOTUNE_ENV) == "1":
        tuned[lambda cfg: grid(cfg["BLOCK_M"], cfg["BLOCK_N"])](*args, **meta)
    else:
        tile = tile_for(pass_name, q)
        kernel[grid(tile.block_m, tile.block_n)](*args, **meta, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                                                 num_warps=tile.num_warps, num_stages=tile.num_stages)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b_q: torch.Tensor | None,
             b_v: torch.Tensor | None, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, stats): stats[0] is lse2 and, with b_Q, stats[1] the keys' logit biases c (one fp32 allocation), which
    the backward reuses."""
    q, k, v = _shared_layout(q, k, v)
    B, H, T, D = q.shape
    qk_scale = LOG2_E / math.sqrt(D)
    o = _token_major_empty(q)
    stats = q.new_empty((1 if b_q is None else 2, B, H, T), dtype=torch.float32)
    lse, c = stats[0], stats[-1]  # without b_Q, c is a pointer the kernels never read
    if b_q is not None:
        bq, stride_bqh = _bias_arg(b_q, q)
        _key_logit_bias[(triton.cdiv(T, _ROWS_BLOCK), B * H)](k, bq, c, *q.stride()[:3], stride_bqh, H, T, qk_scale,
                                                             HEAD_DIM=D, BLOCK=_ROWS_BLOCK)
    bv, stride_bvh = _bias_arg(b_v, q)
    meta = dict(CAUSAL=causal, HAS_BQ=b_q is not None, HAS_BV=b_v is not None)
    _launch(_attn_fwd, _attn_fwd_tuned, "fwd", q, lambda m, n: (triton.cdiv(T, m), B * H),
            (q, k, v, c, bv, o, lse, *q.stride()[:3], stride_bvh, H, T, qk_scale), meta)
    return o, stats


def _backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              stats: torch.Tensor, b_q: torch.Tensor | None, b_v: torch.Tensor | None, causal: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv); dq is also the gradient of q + b_Q."""
    q, k, v = _shared_layout(q, k, v)
    do, o = _as_token_major(do), _as_token_major(o)
    B, H, T, D = q.shape
    sm_scale = 1.0 / math.sqrt(D)
    qk_scale = sm_scale * LOG2_E
    bq, stride_bqh = _bias_arg(b_q, q)
    bv, stride_bvh = _bias_arg(b_v, q)
    lse, c = stats[0], stats[-1]  # c: the forward's key logit biases

    delta = torch.empty_like(lse)
    _attn_bwd_preprocess[(triton.cdiv(T, _ROWS_BLOCK), B * H)](o, do, bv, delta, stride_bvh, H, T, HEAD_DIM=D,
                                                               HAS_BV=b_v is not None, BLOCK_M=_ROWS_BLOCK)
    dq, dk, dv = _token_major_empty(q), _token_major_empty(k), _token_major_empty(v)
    meta = dict(CAUSAL=causal, HAS_BQ=b_q is not None)
    _launch(_attn_bwd_dkdv, _attn_bwd_dkdv_tuned, "dkdv", q, lambda m, n: (triton.cdiv(T, n), B * H),
            (q, k, v, bq, c, do, lse, delta, dk, dv, *q.stride()[:3], stride_bqh, H, T, qk_scale, sm_scale), meta)
    _launch(_attn_bwd_dq, _attn_bwd_dq_tuned, "dq", q, lambda m, n: (triton.cdiv(T, m), B * H),
            (q, k, v, c, do, lse, delta, dq, *q.stride()[:3], H, T, qk_scale, sm_scale), meta)
    return dq, dk, dv


_attention_fwd_op = torch.library.custom_op("symgpt::attention_fwd", _forward, mutates_args=())
_attention_bwd_op = torch.library.custom_op("symgpt::attention_bwd", _backward, mutates_args=())


@_attention_fwd_op.register_fake
def _(q, k, v, b_q, b_v, causal):
    B, H, T, _ = q.shape
    return _token_major_empty(q), q.new_empty((1 if b_q is None else 2, B, H, T), dtype=torch.float32)


@_attention_bwd_op.register_fake
def _(do, q, k, v, o, stats, b_q, b_v, causal):
    return _token_major_empty(q), _token_major_empty(k), _token_major_empty(v)


def _bias_grad(grad: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Σ over batch and time of a (B, H, T, d) gradient, per head for an (H, d) bias, over heads for (d,)."""
    g = grad.sum(dim=(0, 2), dtype=torch.float32)
    return (g if bias.dim() == 2 else g.sum(0)).to(bias.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, b_q, b_v, causal = inputs
    ctx.save_for_backward(q, k, v, *output, b_q, b_v)
    ctx.causal = causal


def _attention_backward(ctx, grad_out, grad_stats):
    q, k, v, o, stats, b_q, b_v = ctx.saved_tensors
    dq, dk, dv = _attention_bwd_op(grad_out, q, k, v, o, stats, b_q, b_v, ctx.causal)
    db_q = _bias_grad(dq, b_q) if b_q is not None and ctx.needs_input_grad[3] else None
    db_v = _bias_grad(grad_out, b_v) if b_v is not None and ctx.needs_input_grad[4] else None
    return dq, dk, dv, db_q, db_v, None


_attention_fwd_op.register_autograd(_attention_backward, setup_context=_setup_context)


# -----------------------------------------------------------------------------
# Entry point

def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b_q: torch.Tensor | None,
                  b_v: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"attention_triton: q, k, v must share one (B, H, T, d) shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention_triton: q, k, v must share one dtype in {DTYPES}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype} (use attention_reference for others)")
    _, num_heads, _, head_dim = q.shape
    span = max(q.numel(), *(1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) for x in (q, k, v)))
    if span >= 2**31:  # the outputs hold q.numel() elements; a view of a projection reaches further
        raise ValueError(f"attention_triton: q, k, v span {span} elements; the kernel's int32 offsets need fewer "
                         "than 2**31 (split the batch)")
    if head_dim not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"attention_triton: head dim {head_dim} is not supported; the kernel handles "
                         f"{ATTENTION_HEAD_DIMS} (use attention_reference for others)")
    for name, bias in (("b_q", b_q), ("b_v", b_v)):
        if bias is not None:
            if bias.shape not in ((head_dim,), (num_heads, head_dim)):
                raise ValueError(f"attention_triton: {name} has shape {tuple(bias.shape)}; it must be ({head_dim},) "
                                 f"shared across heads or ({num_heads}, {head_dim}) per head")
            if bias.device != q.device:
                raise ValueError(f"attention_triton: {name} is on {bias.device} but q is on {q.device}")


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b_q: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """The Triton kernel on any device Triton runs on (CUDA, or the CPU interpreter with TRITON_INTERPRET=1), with
    the shipped tile of each pass (TILES, tile_for) or, with SYMGPT_ATTENTION_AUTOTUNE=1, autotuned tiles."""
    _check_inputs(q, k, v, b_q, b_v)
    return torch.ops.symgpt.attention_fwd(q, k, v, b_q, b_v, causal)[0]
