"""The Triton attention kernel against a float64 SDPA reference: forward and every gradient (docs/model.md).

On CPU the kernel runs in Triton's interpreter. The interpreter is chosen when `@triton.jit` runs, i.e. when
`kernels.attention` is imported with TRITON_INTERPRET=1, and it must not leak into other test modules (nor into
the CUDA tests of this one). So this file runs itself once as a subprocess with the variable set
(`python tests/test_attention_kernel.py RESULT.json`): that process imports a fresh `kernels.attention`, runs every
CPU case plus the custom-op and torch.compile checks, and writes the errors as JSON; each pytest case then asserts
on its own entry. The CUDA cases (bf16 included; the interpreter has no bf16) run in-process with the compiled kernel.

Every run poisons fresh allocations with NaN (`fill_uninitialized_memory`), so an element the kernel forgot to
write shows up as a non-finite value.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # the interpreter run: ~15 s

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}  # ‖out − ref‖ / ‖ref‖ against float64


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    B: int
    H: int
    T: int
    D: int
    causal: bool
    b_q: str = "none"  # "none", "shared" (d,), "head" (H, d)
    b_v: str = "none"
    dtype: str = "float32"
    blocks: tuple[int, int] | None = (32, 16)  # None: the shipped tile table (kernels.attention.TILES)
    bias_grad: bool = True  # learned biases (require grad) or sampled ones (do not)
    layout: str = "bhtd"  # of q, k, v and dO; see LAYOUTS


CPU_CASES = [
    Case("f32_causal_tail_shared", 2, 3, 33, 64, True, "shared", "shared"),
    Case("f32_full_tail_head_tokmajor", 1, 2, 65, 64, False, "head", "head", layout="bthd"),
    Case("f32_causal_T1", 1, 1, 1, 64, True, "shared", "shared", blocks=(16, 16)),
    Case("f32_full_T1_d128_nobias", 1, 2, 1, 128, False, blocks=(16, 16)),
    Case("f32_causal_d128_bq_head", 2, 2, 17, 128, True, "head", blocks=(16, 16)),
    Case("f32_full_notail_bv_shared", 1, 2, 48, 64, False, b_v="shared", blocks=(16, 16)),
    Case("f32_full_d128_nobias", 1, 1, 33, 128, False),
    Case("f32_causal_notail_nobias_tokmajor", 1, 2, 64, 64, True, layout="bthd"),
    Case("f32_causal_sampled_head", 2, 2, 40, 64, True, "head", "head", blocks=(32, 32), bias_grad=False),
    Case("f32_causal_d128_shared_tokmajor", 1, 3, 50, 128, True, "shared", "shared", layout="bthd"),
    Case("f16_causal_tail_shared", 2, 2, 33, 64, True, "shared", "shared", dtype="float16"),
    Case("f16_full_d128_head", 1, 2, 17, 128, False, "head", "head", dtype="float16", blocks=(16, 16)),
    Case("f16_causal_T1_nobias", 1, 1, 1, 64, True, dtype="float16", blocks=(16, 16)),
    Case("f16_full_sampled_bq_tokmajor", 1, 2, 65, 64, False, "shared", dtype="float16", bias_grad=False,
         layout="bthd"),
    Case("f16_causal_d128_bv_head", 1, 2, 48, 128, True, b_v="head", dtype="float16"),
    Case("f32_causal_shipped_tiles", 1, 2, 70, 64, True, "shared", "head", blocks=None),
    Case("f16_full_d128_shipped_tiles", 1, 1, 40, 128, False, "head", "shared", dtype="float16", blocks=None),
    Case("f32_causal_qkv_views_shared", 2, 2, 40, 64, True, "shared", "shared", layout="qkv"),
    Case("f16_full_mixed_layouts_head", 1, 2, 33, 64, False, "head", "head", dtype="float16", layout="mixed"),
]

CUDA_CASES = [
    Case("bf16_causal_shared_autotune", 2, 3, 1000, 64, True, "shared", "shared", dtype="bfloat16", blocks=None),
    Case("bf16_full_d128_head_autotune", 2, 2, 257, 128, False, "head", "head", dtype="bfloat16", blocks=None,
         layout="bthd"),
    Case("bf16_causal_T1", 1, 2, 1, 64, True, "shared", "shared", dtype="bfloat16", blocks=(64, 32)),
    Case("bf16_causal_nobias", 2, 4, 512, 64, True, dtype="bfloat16", blocks=(128, 64)),
    Case("bf16_causal_d128_sampled_bq", 1, 2, 300, 128, True, "shared", dtype="bfloat16", blocks=(128, 32),
         bias_grad=False, layout="bthd"),
    Case("f16_full_both", 2, 2, 333, 64, False, "shared", "head", dtype="float16", blocks=(64, 64)),
    Case("f32_causal_head", 1, 2, 200, 64, True, "head", "head", blocks=(64, 32)),
    Case("f32_full_d128_shared", 1, 2, 130, 128, False, "shared", "shared", blocks=(64, 32)),
]


def _relative_error(out: torch.Tensor, ref: torch.Tensor, floor: float) -> float:
    """‖out − ref‖ / max(‖ref‖, floor); the floor matters only where the exact gradient is zero (T = 1)."""
    ref = ref.double().cpu()
    return ((out.double().cpu() - ref).norm() / max(ref.norm().item(), floor)).item()


def _bias(kind: str, case: Case, mean: float, std: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
    """A bias drawn as in docs/model.md#symmetry-breaking-biases (float32, like the model's), or None."""
    if kind == "none":
        return None
    shape = (case.H, case.D) if kind == "head" else (case.D,)
    return mean + std * torch.randn(shape, generator=gen)


# How q, k, v and dO are laid out in memory, each viewed as (B, H, T, d): "bhtd" contiguous (dO too, which the op
# copies to token-major); "bthd" token-major, each its own (B, T, H, d) tensor (dO too); "qkv" views of one
# (B, T, 3, H, d) tensor, as the model's QKV projection gives them, with a token-major dO; "mixed" q contiguous, k and
# v token-major (the op makes the three share one layout), dO contiguous.
TRANSPOSED = {"bhtd": (False, False, False), "bthd": (True, True, True), "mixed": (False, True, True)}


@contextlib.contextmanager
def forced_tiles(blocks: tuple[int, int] | None):
    """Run every pass with (BLOCK_M, BLOCK_N) = blocks (swapped for dK/dV, whose keys per program come first), 4
    warps and 3 stages (Triton's defaults) instead of the shipped tile table; None: the table."""
    from kernels import attention as attn

    shipped = attn.tile_for
    if blocks is not None:
        m, n = blocks
        attn.tile_for = lambda pass_name, q: attn.Tile(*((n, m) if pass_name == "dkdv" else (m, n)), 4, 3)
    try:
        yield
    finally:
        attn.tile_for = shipped


def _leaves(case: Case, gen: torch.Generator, device: str) -> tuple[list[torch.Tensor], Callable, torch.Tensor]:
    """(leaf tensors, a function from leaves (or their gradients) to q, k, v as (B, H, T, d), dO) in case.layout."""
    bhtd, bthd = (case.B, case.H, case.T, case.D), (case.B, case.T, case.H, case.D)

    def draw(shape):
        return torch.randn(shape, generator=gen).to(device, getattr(torch, case.dtype))

    if case.layout == "qkv":
        leaves = [draw((case.B, case.T, 3, case.H, case.D)).requires_grad_()]
        return leaves, lambda xs: [x.transpose(1, 2) for x in xs[0].unbind(2)], draw(bthd).transpose(1, 2)
    transposed = TRANSPOSED[case.layout]
    leaves = [draw(bthd if t else bhtd).requires_grad_() for t in transposed]
    grad_out = draw(bthd).transpose(1, 2) if case.layout == "bthd" else draw(bhtd)
    return leaves, lambda xs: [x.transpose(1, 2) if t else x for x, t in zip(xs, transposed)], grad_out


def run_case(case: Case, device: str) -> dict[str, dict[str, float]]:
    """Run the kernel and the float64 reference on fresh random inputs; return per-tensor errors."""
    from kernels.attention import attention_triton
    from kernels.attention_paths import attention_reference

    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    leaves, views, grad_out = _leaves(case, gen, device)
    biases = [_bias(case.b_q, case, 0.5, torch.linspace(0.05, 0.15, case.D), gen),
              _bias(case.b_v, case, 0.5, torch.full((case.D,), 0.05), gen)]
    biases = [None if b is None else b.to(device).requires_grad_(case.bias_grad) for b in biases]

    with forced_tiles(case.blocks):
        out = attention_triton(*views(leaves), *biases, causal=case.causal)
        out.backward(grad_out)

    ref_leaves = [x.detach().cpu().double().requires_grad_() for x in leaves]
    ref_biases = [None if b is None else b.detach().cpu().double().requires_grad_() for b in biases]
    ref = attention_reference(*views(ref_leaves), *ref_biases, causal=case.causal)
    ref.backward(grad_out.cpu().double())

    floor = grad_out.double().norm().item() if case.T == 1 else 0.0  # at T = 1, measure dQ, dK against ‖dO‖
    got, want = views([x.grad for x in leaves]), views([x.grad for x in ref_leaves])
    pairs = {"out": (out, ref), **{name: (g, w) for name, g, w in zip(("dq", "dk", "dv"), got, want)}}
    for name, b, rb in zip(("db_q", "db_v"), biases, ref_biases):
        if b is not None:
            pairs[name] = (b.grad, rb.grad) if case.bias_grad else (b.grad, None)
    result = {}
    for name, (got, want) in pairs.items():
        if want is None:  # a sampled bias must stay without a gradient
            result[name] = {"err": 0.0 if got is None else math.inf, "nonfinite": 0}
        else:
            result[name] = {"err": _relative_error(got.detach(), want, floor),
                            "nonfinite": int((~torch.isfinite(got)).sum())}
    return result


def _check(case: Case, result: dict) -> None:
    assert "traceback" not in result, f"{case.name} raised:\n{result.get('traceback')}"
    tol = TOLERANCE[case.dtype]
    for name, r in result.items():
        assert r["nonfinite"] == 0, f"{case.name}: {name} has {r['nonfinite']} unwritten/non-finite elements"
        assert r["err"] < tol, f"{case.name}: {name} relative error {r['err']:.3g} >= {tol:g}"


@pytest.fixture
def poisoned_empty():
    """Make torch.empty fill with NaN, so elements a kernel never writes cannot pass."""
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.utils.deterministic.fill_uninitialized_memory = flags[2]


# -----------------------------------------------------------------------------
# CPU: the interpreter subprocess

@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.helpers import run_in_interpreter

    return run_in_interpreter(__file__, tmp_path_factory.mktemp("attention_interpreter"), timeout=600)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpreter_matches_reference(interpreter_results: dict, case: Case) -> None:
    _check(case, interpreter_results[case.name])


@pytest.mark.parametrize("check", ["opcheck_fwd", "opcheck_bwd", "compile_fullgraph", "model_compile_fullgraph"])
def test_interpreter_custom_op(interpreter_results: dict, check: str) -> None:
    assert interpreter_results[check] == "ok", interpreter_results[check]


def _opcheck_and_compile() -> dict[str, str]:
    """torch.library.opcheck on both ops, and a fullgraph torch.compile (aot_eager) of forward + backward."""
    from kernels.attention import attention_triton

    gen = torch.Generator().manual_seed(7)
    q, k, v, grad_out = (torch.randn(1, 2, 20, 64, generator=gen) for _ in range(4))
    b_q = (0.5 + 0.1 * torch.randn(2, 64, generator=gen)).requires_grad_()
    b_v = (0.5 + 0.1 * torch.randn(64, generator=gen)).requires_grad_()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    checks = {}

    def run(name, fn):
        try:
            with forced_tiles((16, 16)):
                fn()
            checks[name] = "ok"
        except Exception:
            checks[name] = traceback.format_exc()

    run("opcheck_fwd", lambda: torch.library.opcheck(torch.ops.symgpt.attention_fwd.default,
                                                     (q, k, v, b_q, b_v, True)))
    with forced_tiles((16, 16)):
        out, stats = torch.ops.symgpt.attention_fwd(q, k, v, b_q, b_v, True)
    run("opcheck_bwd", lambda: torch.library.opcheck(
        torch.ops.symgpt.attention_bwd.default,
        (grad_out, *(x.detach() for x in (q, k, v, out, stats, b_q, b_v)), True)))

    def compiled_matches_eager():
        def loss_fn(q, k, v, b_q, b_v):
            return (attention_triton(q, k, v, b_q, b_v, causal=True) * grad_out).sum()
        inputs = (q, k, v, b_q, b_v)
        eager = torch.autograd.grad(loss_fn(*inputs), inputs)
        compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
        got = torch.autograd.grad(compiled(*inputs), inputs)
        for e, g in zip(eager, got):
            torch.testing.assert_close(g, e, rtol=0, atol=0)

    run("compile_fullgraph", compiled_matches_eager)
    run("model_compile_fullgraph", _model_compiles_without_graph_break)
    return checks


def _model_compiles_without_graph_break() -> None:
    """The GPT with attention_impl "triton" (the kernel, here in the interpreter: the CUDA-only dispatch rule is
    lifted) compiles in one graph (aot_eager, fullgraph), with the values and gradients of eager mode."""
    import kernels.attention as attn
    import kernels.attention_paths as paths
    from tests.helpers import tiny_gpt

    paths.kernel_problem = lambda *args: None
    model = tiny_gpt(0, block_size=16, n_layer=1, n_head=1, n_embd=64, bias_mode="learned")
    paths.set_implementation(model, "triton")
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    calls = []
    kernel = attn.attention_triton
    attn.attention_triton = lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs)
    eager_loss = model(idx, idx)[1]
    assert calls, "the model did not call the kernel"
    eager = torch.autograd.grad(eager_loss, list(model.parameters()))
    loss = torch.compile(model, backend="aot_eager", fullgraph=True)(idx, idx)[1]
    got = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def _interpreter_main(path: str) -> None:
    """Entry point of the TRITON_INTERPRET=1 subprocess: run every CPU case and check, write JSON to path."""
    from tests.helpers import patch_triton_interpreter

    patch_triton_interpreter()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    results: dict = {}
    for case in CPU_CASES:
        try:
            results[case.name] = run_case(case, "cpu")
        except Exception:
            results[case.name] = {"traceback": traceback.format_exc()}
    results.update(_opcheck_and_compile())
    Path(path).write_text(json.dumps(results))


# -----------------------------------------------------------------------------
# CUDA: the compiled kernel in-process

@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: c.name)
def test_cuda_matches_reference(poisoned_empty, case: Case) -> None:
    _check(case, run_case(case, "cuda"))


@pytest.mark.cuda
def test_cuda_compile_fullgraph() -> None:
    """The model's attend() under torch.compile (inductor, fullgraph): same values and gradients as eager."""
    from kernels.attention_paths import attend

    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(3))
    b_q = (0.5 + 0.1 * torch.randn(64, generator=gen)).cuda().requires_grad_()
    b_v = (0.5 + 0.1 * torch.randn(4, 64, generator=gen)).cuda().requires_grad_()
    grad_out = torch.randn(2, 4, 256, 64, generator=gen).cuda().bfloat16()

    def loss_fn(q, k, v, b_q, b_v):
        return (attend(q, k, v, b_q, b_v, causal=True).float() * grad_out.float()).sum()

    inputs = (q, k, v, b_q, b_v)
    eager = torch.autograd.grad(loss_fn(*inputs), inputs)
    got = torch.autograd.grad(torch.compile(loss_fn, fullgraph=True)(*inputs), inputs)
    for e, g in zip(eager, got):  # the same kernels, so q, k, v grads agree exactly; the fp32 bias sums may be
        exact = g.dtype == torch.bfloat16  # reduced in another order by inductor
        torch.testing.assert_close(g, e, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)


# -----------------------------------------------------------------------------
# In-process, no kernel launch: dispatch and input validation

def test_shipped_tiles_fit_every_pass_and_shrink_to_short_sequences() -> None:
    from kernels.attention import TILES, tile_for

    for (_, pass_name, _), tile in TILES.items():
        rows_per_step, per_program = (tile.block_m, tile.block_n) if pass_name == "dkdv" else (tile.block_n,
                                                                                               tile.block_m)
        assert per_program % rows_per_step == 0 and min(tile.block_m, tile.block_n) >= 16, (pass_name, tile)
    for pass_name in ("fwd", "dkdv", "dq"):
        assert tile_for(pass_name, torch.empty(1, 1, 20, 64)).block_m <= 32  # T = 20: no tile taller than 32
        assert tile_for(pass_name, torch.empty(1, 1, 1, 64)) == dataclasses.replace(
            TILES[("other", pass_name, 64)], block_m=16, block_n=16)


def test_autotuning_only_when_asked(monkeypatch) -> None:
    from kernels import attention as attn

    calls = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append((self.name, meta.get("BLOCK_M"), meta.get("num_warps")))

    q = torch.empty(1, 1, 256, 64)
    monkeypatch.delenv(attn.AUTOTUNE_ENV, raising=False)
    attn._launch(Fake("plain"), Fake("tuned"), "fwd", q, lambda m, n: (1,), (), {})
    monkeypatch.setenv(attn.AUTOTUNE_ENV, "1")
    attn._launch(Fake("plain"), Fake("tuned"), "fwd", q, lambda m, n: (1,), (), {})
    shipped = attn.TILES[("other", "fwd", 64)]
    assert calls == [("plain", shipped.block_m, shipped.num_warps), ("tuned", None, None)]


ALLOCATING = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "clone", "zeros", "new_zeros",
              "zeros_like", "_to_copy"}


def test_a_call_allocates_its_outputs_only_and_the_backward_reuses_c(monkeypatch) -> None:
    """Forward and backward with b_Q and b_V, on the model's layout (q, k, v views of one projection, dO
    token-major), allocate O, one fp32 (2, B, H, T) buffer holding lse2 and the keys' logit biases c, delta, dQ, dK
    and dV, and launch c's kernel once: the backward reads c from the forward's output instead of recomputing it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kernels import attention as attn

    launches, allocations = [], []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append(self.name)

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ALLOCATING:
                allocations.append((func.overloadpacket.__name__, tuple(out.shape), out.dtype))
            return out

    monkeypatch.setattr(attn, "_key_logit_bias", Kernel("c"))
    monkeypatch.setattr(attn, "_attn_bwd_preprocess", Kernel("delta"))
    monkeypatch.setattr(attn, "_launch", lambda kernel, tuned, name, *args: launches.append(name))
    B, H, T, D = 2, 3, 40, 64
    qkv = torch.randn(B, T, 3, H, D, dtype=torch.float16)
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
    grad_out = torch.randn(B, T, H, D, dtype=torch.float16).transpose(1, 2)
    b_q, b_v = torch.randn(D), torch.randn(H, D)
    with Allocations():
        out, stats = attn._forward(q, k, v, b_q, b_v, True)
        attn._backward(grad_out, q, k, v, out, stats, b_q, b_v, True)
    half, fp32 = torch.float16, torch.float32
    assert launches == ["c", "fwd", "delta", "dkdv", "dq"]
    assert allocations == [("new_empty", (B, T, H, D), half), ("new_empty", (2, B, H, T), fp32),
                           ("empty_like", (B, H, T), fp32)] + [("new_empty", (B, T, H, D), half)] * 3


def test_attention_on_cpu_is_the_reference() -> None:
    from kernels.attention_paths import attend, attention_reference

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 9, 64, generator=gen) for _ in range(3))
    b_q, b_v = torch.randn(64, generator=gen), torch.randn(3, 64, generator=gen)
    assert torch.equal(attend(q, k, v, b_q, b_v), attention_reference(q, k, v, b_q, b_v))


@pytest.mark.parametrize("bad, match", [
    ({"shape": (1, 2, 8, 96)}, "head dim 96"),
    ({"k_shape": (1, 2, 9, 64)}, "share one"),
    ({"dtype": torch.float64}, "dtype"),
    ({"b_q": (3, 64)}, "b_q has shape"),
    ({"expand": (2**21, 2, 8, 64)}, "2147483648 elements"),
])
def test_attention_triton_rejects_bad_input(bad: dict, match: str) -> None:
    from kernels.attention import attention_triton

    shape = bad.get("shape", (1, 2, 8, 64))
    q = torch.randn(shape, dtype=bad.get("dtype", torch.float32))
    k = torch.randn(bad.get("k_shape", shape), dtype=q.dtype)
    b_q = torch.randn(bad["b_q"]) if "b_q" in bad else None
    if "expand" in bad:  # 2**31 elements of q as a stride-0 view: the offsets' bound, without the memory
        q = k = q.expand(bad["expand"])
    with pytest.raises(ValueError, match=match):
        attention_triton(q, k, q, b_q)


if __name__ == "__main__":
    _interpreter_main(sys.argv[1])
