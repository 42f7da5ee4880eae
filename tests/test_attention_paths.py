"""The library paths of attention with the biases and the choice between paths (docs/model.md).

Exactness: SDPA on q + b_Q with b_V added to the output (`attention_reference`) and FlexAttention with b_Q as a
per-key score term (`attention_flex`) against a float64 oracle that applies the biases by their definition (b_V added
to the values inside the softmax average, b_Q to the queries before the product): forward and every gradient, fp32
and fp16 on the CPU (FlexAttention: forward only, torch has no CPU backward for it), bf16 under `cuda`. The choice:
a forced path or the table's row (kernels/attention_table.json), the table written from bench.attention's timings,
and no Triton import where no kernel runs.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import kernels.attention_paths as paths
import train_gpt
from bench import throughput
from kernels.attention_paths import attend, attention_flex, attention_reference
from tests.helpers import ROOT, tiny_gpt, train_tiny_run

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative, against float64


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention call: q, k, v of shape (batch, heads, seq_len, head_dim) in `dtype`, causal or not, b_Q and b_V
    each "none", "shared" (d,) or "head" (H, d), learned (trainable) or sampled."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    b_q: str = "none"
    b_v: str = "none"
    learned: bool = False

    def describe(self) -> str:
        return (f"{self.batch}x{self.heads}x{self.seq_len}x{self.head_dim}-{paths.dtype_name(self.dtype)}-"
                f"{'causal' if self.causal else 'full'}-bq_{self.b_q}-bv_{self.b_v}{'-learned' * self.learned}")

    def inputs(self, device: torch.device, seed: int = 0) -> tuple[list[torch.Tensor], list, torch.Tensor]:
        """(leaves, the biases [b_q, b_v], output gradient): one (B, T, 3·H·d) leaf that q, k, v are views of, as
        the model's QKV projection lays them out, plus the biases when learned."""
        gen = torch.Generator(device=device).manual_seed(seed)
        B, H, T, d = self.batch, self.heads, self.seq_len, self.head_dim
        qkv = torch.randn(B, T, 3 * H * d, device=device, generator=gen).to(self.dtype).requires_grad_()
        biases = []
        for kind, mean in ((self.b_q, 0.5), (self.b_v, 0.0)):
            shape = {"none": None, "shared": (d,), "head": (H, d)}[kind]
            biases.append(None if shape is None else (mean + 0.1 * torch.randn(shape, device=device, generator=gen)
                                                      ).requires_grad_(self.learned))
        grad_out = torch.randn(B, T, H * d, device=device, generator=gen).to(self.dtype)
        return [qkv] + [b for b in biases if b is not None and b.requires_grad], biases, grad_out


def split_heads(qkv: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """q, k, v as (B, H, T, d) views of the (B, T, 3·H·d) projection, as the model makes them."""
    B, T, C3 = qkv.shape
    return [t.view(B, T, heads, C3 // (3 * heads)).transpose(1, 2) for t in qkv.split(C3 // 3, dim=2)]


def oracle(q, k, v, b_q, b_v, causal):
    """softmax((q + b_Q)·kᵀ/√d) · (v + b_V), written out in float64: the biases where the definition puts them."""
    H, d = q.shape[1], q.shape[-1]

    def per_head(b):
        return 0 if b is None else (b.view(1, H, 1, d) if b.dim() == 2 else b.view(1, 1, 1, d))

    scores = (q + per_head(b_q)) @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        T = q.shape[2]
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ (v + per_head(b_v))


def relative_errors(fn, call: AttentionCall, device: str = "cpu", grads: bool = True) -> dict[str, float]:
    """‖fn − oracle‖ / ‖oracle‖ for the output and, with `grads`, the gradients of q, k, v and the learned biases,
    on the model's layout of q, k, v (views of one projection)."""
    leaves, biases, grad_out = call.inputs(torch.device(device))
    names = ["qkv"] + [n for n, b in zip(("b_q", "b_v"), biases) if b is not None and b.requires_grad]

    def run(leaf_values, bias_values, dtype_fn):
        q, k, v = split_heads(leaf_values[0], call.heads)
        out = dtype_fn(q, k, v, *bias_values, call.causal)
        return out.transpose(1, 2).reshape(call.batch, call.seq_len, -1)

    ref_leaves = [x.detach().double().cpu().requires_grad_() for x in leaves]
    lookup = dict(zip(names, ref_leaves))
    ref_biases = [None if b is None else lookup.get(n, b.detach().double().cpu())
                  for n, b in zip(("b_q", "b_v"), biases)]
    want = run(ref_leaves, ref_biases, oracle)
    want_grads = torch.autograd.grad(want, ref_leaves, grad_out.double().cpu())
    if grads:
        got = run(leaves, biases, fn)
        got_grads = torch.autograd.grad(got, leaves, grad_out)
    else:
        with torch.no_grad():
            got = run([x.detach() for x in leaves], [None if b is None else b.detach() for b in biases], fn)
        got_grads = []
    errors = {"out": ((got.double().cpu() - want).norm() / want.norm()).item()}
    for name, g, w in zip(names, got_grads, want_grads):
        errors[name] = ((g.double().cpu() - w).norm() / w.norm()).item()
        assert torch.isfinite(g).all(), name
    return errors


CALLS = [
    AttentionCall(2, 3, 33, 64, torch.float32, True, "shared", "shared", learned=True),
    AttentionCall(1, 2, 17, 32, torch.float32, False, "head", "head", learned=True),
    AttentionCall(2, 2, 40, 64, torch.float32, True, "head", "none"),
    AttentionCall(1, 4, 9, 16, torch.float32, True),
    AttentionCall(2, 3, 33, 64, torch.float16, True, "shared", "shared", learned=True),
    AttentionCall(1, 2, 24, 128, torch.float16, False, "head", "head", learned=True),
    AttentionCall(2, 2, 19, 64, torch.float16, True, "none", "shared"),
]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.describe())
def test_sdpa_path_is_exact_forward_and_backward(call: AttentionCall) -> None:
    errors = relative_errors(attention_reference, call)
    learned = {name for name, kind in (("b_q", call.b_q), ("b_v", call.b_v)) if kind != "none" and call.learned}
    assert set(errors) == {"out", "qkv"} | learned
    assert max(errors.values()) < TOLERANCE[call.dtype], errors


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.describe())
def test_flex_path_forward_is_exact_on_the_cpu(call: AttentionCall) -> None:
    with warnings.catch_warnings():  # eager FlexAttention warns that it is meant to be compiled
        warnings.simplefilter("ignore")
        errors = relative_errors(attention_flex, call, grads=False)
    assert errors["out"] < TOLERANCE[call.dtype], errors


def test_the_oracle_can_fail() -> None:
    """Dropping b_V (or adding b_Q after the product) is caught: the biases change the output measurably."""
    call = CALLS[0]

    def without_b_v(q, k, v, b_q, b_v, causal):
        return attention_reference(q, k, v, b_q, None, causal)

    assert relative_errors(without_b_v, call, grads=False)["out"] > 100 * TOLERANCE[call.dtype]


def test_attention_dispatches_by_impl() -> None:
    q, k, v = (torch.randn(1, 2, 9, 64) for _ in range(3))
    b_q, b_v = torch.randn(64), torch.randn(2, 64)
    reference = attention_reference(q, k, v, b_q, b_v)
    assert torch.equal(attend(q, k, v, b_q, b_v, impl="sdpa"), reference)
    assert torch.equal(attend(q, k, v, b_q, b_v, impl="triton"), reference)  # no kernel on the CPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(attend(q, k, v, b_q, b_v, impl="flex"), reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="impl 'cudnn'"):
        attend(q, k, v, impl="cudnn")


# -----------------------------------------------------------------------------
# The choice: a forced path, or the table's row for this GPU, head dim and dtype

CPU = torch.device("cpu")


def table(tmp_path: Path, *rows: dict) -> Path:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"about": "test", "rows": list(rows)}))
    return path


def row(impl: str, gpu: str = "cpu", head_dim: int = 64, dtype: str = "float32") -> dict:
    return {"gpu": gpu, "head_dim": head_dim, "dtype": dtype, "impl": impl, "source": f"measured {impl} fastest"}


def test_auto_takes_the_row_of_this_gpu_head_dim_and_dtype(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(paths, "path_problem", lambda *args: None)  # as on a GPU where every path runs
    path = table(tmp_path, row("flex", head_dim=128), row("triton"), row("flex", dtype="bfloat16"),
                 row("flex", gpu="NVIDIA H100 80GB HBM3"))
    record = paths.choose("auto", CPU, torch.float32, 64, compiled=True, table=path)
    assert (record["requested"], record["choice"]) == ("auto", "triton")
    assert record["source"] == "table.json, cpu, head dim 64, float32: measured triton fastest"
    assert paths.choose("auto", CPU, torch.bfloat16, 64, compiled=True, table=path)["choice"] == "flex"


def test_auto_without_a_row_or_with_a_row_that_cannot_run_takes_the_library_path(tmp_path: Path) -> None:
    record = paths.choose("auto", CPU, torch.float32, 64, compiled=False, table=table(tmp_path))
    assert record["choice"] == "sdpa"
    assert record["source"].startswith("no row for cpu, head dim 64, float32 in table.json: the library path")
    assert "python -m bench.attention --write-table" in record["source"]
    record = paths.choose("auto", CPU, torch.float32, 64, compiled=False, table=table(tmp_path, row("triton")))
    assert record["choice"] == "sdpa" and "gives triton" in record["source"]
    assert "cannot run here (the Triton kernel runs on CUDA devices" in record["source"]


def test_a_forced_path_runs_or_is_refused_with_the_reason() -> None:
    record = paths.choose("sdpa", CPU, torch.float32, 64, compiled=False)
    assert record == {"requested": "sdpa", "choice": "sdpa", "source": "--attention-impl"}
    with pytest.raises(paths.AttentionChoiceError, match="--attention-impl triton: the Triton kernel runs on CUDA "
                                                         "devices.*use auto or one of sdpa"):
        paths.choose("triton", CPU, torch.float32, 64, compiled=False)
    with pytest.raises(paths.AttentionChoiceError, match="--attention-impl flex: FlexAttention has no backward"):
        paths.choose("flex", CPU, torch.float32, 64, compiled=True)


@pytest.mark.parametrize("text", ["{not json", '{"rows": 3}', '{"table": []}', json.dumps({"rows": [row("fastest")]}),
                                  json.dumps({"rows": [{**row("sdpa"), "head_dim": "64"}]}),
                                  json.dumps({"rows": [{k: v for k, v in row("sdpa").items() if k != "source"}]})])
def test_an_unreadable_table_is_refused_naming_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "table.json"
    path.write_text(text)
    with pytest.raises(paths.AttentionChoiceError, match=f"{path}: not a table of attention paths"):
        paths.choose("auto", CPU, torch.float32, 64, compiled=True, table=path)


def test_the_shipped_table_is_valid_and_cites_a_measurement_for_every_row() -> None:
    for entry in paths.read_table(paths.TABLE):
        assert "bench.attention" in entry["source"] and " ms" in entry["source"], entry


def test_new_rows_replace_the_rows_of_their_gpu_head_dim_and_dtype(tmp_path: Path) -> None:
    path = table(tmp_path, row("flex"), row("sdpa", head_dim=128), row("flex", gpu="A100"))
    path.write_text(throughput.table_text([row("triton"), row("triton", dtype="bfloat16")], path, paths.TABLE_KEY))
    got = {(r["gpu"], r["head_dim"], r["dtype"]): r["impl"] for r in paths.read_table(path)}
    assert got == {("cpu", 64, "float32"): "triton", ("cpu", 64, "bfloat16"): "triton",
                   ("cpu", 128, "float32"): "sdpa", ("A100", 64, "float32"): "flex"}
    assert json.loads(path.read_text())["about"] == "test"


def test_no_entry_point_imports_triton_until_a_kernel_runs() -> None:
    """Importing the trainer, sampling, export and the config, --help and a CPU forward pass on the triton path
    (which runs SDPA there) leave Triton unimported."""
    # the child imports the entry points and nothing else (not the tests' helpers), so it builds its model itself
    code = ("import runpy, sys, torch\n"
            "import config, export, sample, train_gpt\n"
            "sys.argv = ['train_gpt.py', '--help']\n"
            "try:\n    runpy.run_path('train_gpt.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "model = train_gpt.GPT(train_gpt.GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=1, n_embd=64))\n"
            "model(torch.zeros(1, 8, dtype=torch.long))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton' or m in ('kernels.attention', "
            "'kernels.ecd')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


# -----------------------------------------------------------------------------
# The model: no graph break for either path; the trainer's record; resume

def tiny_model(impl: str, **overrides) -> train_gpt.GPT:
    model = tiny_gpt(**{"block_size": 16, "n_embd": 64, "bias_mode": "learned", **overrides})
    paths.set_implementation(model, impl)
    return model


def test_the_compiled_model_has_no_graph_break_on_the_sdpa_path() -> None:
    model = tiny_model("sdpa")
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    eager_loss = model(idx, idx)[1]
    eager = torch.autograd.grad(eager_loss, list(model.parameters()))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # raises at the first graph break
    loss = compiled(idx, idx)[1]
    got = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e)


def test_the_compiled_model_has_no_graph_break_on_the_flex_path() -> None:
    """Forward only: FlexAttention has no backward on the CPU (the CUDA test below covers the backward)."""
    model = tiny_model("flex")
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = model(idx, idx)[1]
        got = torch.compile(model, backend="eager", fullgraph=True)(idx, idx)[1]
    torch.testing.assert_close(got, eager)
    paths.set_implementation(model, "sdpa")
    with torch.no_grad():
        torch.testing.assert_close(model(idx, idx)[1], eager, rtol=1e-5, atol=1e-5)


def test_the_trainer_records_the_choice_and_resume_selects_again(tmp_path: Path) -> None:
    run = train_tiny_run(tmp_path, "--attention-impl", "sdpa", "--checkpoint-every", "2")
    record = json.loads((run / "config.json").read_text())["attention"]
    assert (record["requested"], record["choice"], record["source"]) == ("sdpa", "sdpa", "--attention-impl")
    assert "attention: sdpa (--attention-impl)" in (run / "log.txt").read_text()

    # a resumed run keeps the request it was given (sdpa) unless a flag changes it, and then decides anew
    train_gpt.main(["--resume", str(run), "--steps", "6", "--attention-impl", "auto"])
    record = json.loads((run / "config.json").read_text())["attention"]
    assert (record["requested"], record["choice"]) == ("auto", "sdpa")
    assert record["source"].startswith("no row for cpu, head dim 16, float32 in attention_table.json")
    assert "attention: sdpa (no row for cpu, head dim 16, float32" in (run / "log.txt").read_text()


def test_a_forced_implementation_that_cannot_run_stops_the_run_before_training(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as excinfo:
        train_tiny_run(tmp_path, "--attention-impl", "triton")
    error = capsys.readouterr().err
    assert excinfo.value.code == 2 and "Traceback" not in error
    assert "error: --attention-impl triton: the Triton kernel runs on CUDA devices" in error
    assert not (tmp_path / "tiny" / "checkpoints").exists()


# -----------------------------------------------------------------------------
# CUDA: bf16 exactness with gradients, the compiled model on every path, the shipped table

CUDA_CALLS = [
    AttentionCall(2, 4, 256, 64, torch.bfloat16, True, "shared", "shared", learned=True),
    AttentionCall(2, 2, 200, 128, torch.bfloat16, False, "head", "head", learned=True),
    AttentionCall(2, 4, 300, 64, torch.bfloat16, True, "head", "shared"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["sdpa", "flex", "triton"])
@pytest.mark.parametrize("call", CUDA_CALLS, ids=lambda c: c.describe())
def test_cuda_paths_are_exact_in_bf16(impl: str, call: AttentionCall) -> None:
    fn = torch.compile(attention_flex) if impl == "flex" else functools.partial(attend, impl=impl)
    errors = relative_errors(fn, call, device="cuda")
    assert max(errors.values()) < TOLERANCE[torch.bfloat16], errors


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["sdpa", "flex", "triton"])
def test_cuda_compiled_model_has_no_graph_break(impl: str) -> None:
    model = tiny_model(impl, n_head=1).cuda()  # head dim 64: the kernel's
    idx = torch.randint(0, 64, (4, 16), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager_loss = model(idx, idx)[1]
        eager = torch.autograd.grad(eager_loss, list(model.parameters()))
        loss = torch.compile(model, fullgraph=True)(idx, idx)[1]
        got = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=2e-2)
    for g, e in zip(got, eager):
        assert ((g - e).norm() / e.norm().clamp_min(1e-12)).item() < 5e-2


@pytest.mark.cuda
def test_cuda_auto_follows_the_shipped_table() -> None:
    device = torch.device("cuda")
    record = paths.choose("auto", device, torch.bfloat16, 64, compiled=True)
    rows = [r for r in paths.read_table() if (r["gpu"], r["head_dim"], r["dtype"]) == (
        torch.cuda.get_device_name(device), 64, "bfloat16")]
    assert record["choice"] == (rows[0]["impl"] if rows else "sdpa"), record
