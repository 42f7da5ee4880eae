"""Attention with the symmetry-breaking biases on three exact paths, and which one a run takes
(docs/model.md#three-exact-implementations, docs/model.md#choosing-the-implementation).

`attend(q, k, v, b_q, b_v, causal, impl)` is the model's only attention call. q, k, v are (B, H, T, d); b_q and
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

Which path a training run takes (`choose`, --attention-impl auto|triton|sdpa|flex) is decided once, before
torch.compile, and recorded in config.json and every checkpoint: a forced path, or under auto the row of
kernels/attention_table.json for this GPU, head dim and dtype (rows written from measurements by `python -m
bench.attention --write-table`); a GPU without a row takes the library path, sdpa, which is also a model's path until
a run sets one (DEFAULT_IMPLEMENTATION). Whatever reads a checkpoint (eval, sample, export) runs the path the run
recorded. The choice changes rounding only, never what is computed.
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import ATTENTION_HEAD_DIMS

IMPLEMENTATIONS = ("triton", "sdpa", "flex")  # attend(impl=...)
# The one default path: a model's until a run chooses (and a reader of a checkpoint that recorded no choice), and
# what --attention-impl auto takes where the table has no usable row.
DEFAULT_IMPLEMENTATION = "sdpa"
CHOICES = ("auto", *IMPLEMENTATIONS)  # --attention-impl
TABLE = Path(__file__).with_name("attention_table.json")
TABLE_KEY = ("gpu", "head_dim", "dtype")


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
    """Why `attend(impl="triton")` would not run the Triton kernel for these inputs; None when it does."""
    if device_type != "cuda":
        return f"the Triton kernel runs on CUDA devices (this one is {device_type})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the Triton kernel is used for float16 and bfloat16 (this call is {dtype_name(dtype)})"
    if head_dim not in ATTENTION_HEAD_DIMS:
        return f"the Triton kernel handles head dims {ATTENTION_HEAD_DIMS} (this model's is {head_dim})"
    return None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b_q: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    causal: bool = True,
    impl: str = DEFAULT_IMPLEMENTATION,
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
        raise ValueError(f"attend: impl {impl!r} is not one of {IMPLEMENTATIONS}")
    return attention_reference(q, k, v, b_q, b_v, causal)


# -----------------------------------------------------------------------------
# Which path a run takes

class AttentionChoiceError(ValueError):
    """A forced path that cannot run here, or an unreadable table: a refusal that names the fix."""


def path_problem(impl: str, device: torch.device, dtype: torch.dtype, head_dim: int, compiled: bool) -> str | None:
    """Why path `impl` cannot serve a training run here; None when it can."""
    if impl == "triton":
        return kernel_problem(device.type, dtype, head_dim)
    if impl == "flex":
        if device.type != "cuda":
            return f"FlexAttention has no backward pass on {device.type} (torch {torch.__version__})"
        if not compiled:
            return "FlexAttention needs torch.compile and this model runs eagerly (--no-compile)"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_table(path: Path = TABLE) -> list[dict]:
    """The rows of the table: {gpu, head_dim, dtype, impl, source} each."""
    try:
        rows = json.loads(path.read_text())["rows"]
        if not all(isinstance(r, dict) and r.get("impl") in IMPLEMENTATIONS and type(r.get("head_dim")) is int
                   and all(isinstance(r.get(k), str) for k in ("gpu", "dtype", "source")) for r in rows):
            raise ValueError("each row needs gpu, dtype and source (text), head_dim (an integer) and a path among "
                             + ", ".join(IMPLEMENTATIONS))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AttentionChoiceError(f"{path}: not a table of attention paths ({type(exc).__name__}: {exc}); restore "
                                   "it (git checkout) or pass --attention-impl sdpa|triton|flex") from None
    return rows


def choose(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int, *, compiled: bool,
           table: Path = TABLE) -> dict:
    """The record of the path a run takes: requested, choice, source (why). A forced path that cannot run here
    raises AttentionChoiceError; under auto, a table row whose path cannot run here gives sdpa, as no row does."""
    if requested != "auto":
        problem = path_problem(requested, device, dtype, head_dim, compiled)
        if problem:
            usable = [i for i in IMPLEMENTATIONS if not path_problem(i, device, dtype, head_dim, compiled)]
            raise AttentionChoiceError(f"--attention-impl {requested}: {problem}; use auto or one of "
                                       + ", ".join(usable))
        return {"requested": requested, "choice": requested, "source": "--attention-impl"}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    key = (gpu, head_dim, dtype_name(dtype))
    row = next((r for r in read_table(table) if tuple(r[k] for k in TABLE_KEY) == key), None)
    where = f"{gpu}, head dim {head_dim}, {key[2]}"
    if row is None:
        source = (f"no row for {where} in {table.name}: the library path (measure and add the row with "
                  "`python -m bench.attention --write-table`)")
        return {"requested": "auto", "choice": DEFAULT_IMPLEMENTATION, "source": source}
    problem = path_problem(row["impl"], device, dtype, head_dim, compiled)
    if problem:
        source = f"{table.name} gives {row['impl']} for {where}, which cannot run here ({problem}): the library path"
        return {"requested": "auto", "choice": DEFAULT_IMPLEMENTATION, "source": source}
    return {"requested": "auto", "choice": row["impl"], "source": f"{table.name}, {where}: {row['source']}"}


def set_implementation(model: torch.nn.Module, impl: str) -> None:
    """Set `attention_impl` (a plain attribute the attention modules pass to `attention`) on every module of
    `model` that has one."""
    for module in model.modules():
        if hasattr(module, "attention_impl"):
            module.attention_impl = impl


def configure(model: torch.nn.Module, requested: str, *, device: torch.device, dtype: torch.dtype | None,
              compiled: bool, log: Callable[[str], None]) -> dict:
    """The trainer's entry point: choose for `model` (dtype None: float32), set it on the model, log it; returns the
    record for config.json."""
    config = model.config
    if config.attention != "standard":
        record = {"requested": requested, "choice": None, "source": "the model has no dot-product attention"}
    else:
        record = choose(requested, device, dtype or torch.float32, config.head_dim, compiled=compiled)
        set_implementation(model, record["choice"])
    log(f"attention: {record['choice']} ({record['source']})")
    return record
