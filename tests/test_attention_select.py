"""The library paths of attention with the biases and the choice between implementations (docs/model.md).

Exactness: SDPA on q + b_Q with b_V added to the output (`attention_reference`) and FlexAttention with b_Q as a
per-key score term (`attention_flex`) against a float64 oracle that applies the biases by their definition (b_V added
to the values inside the softmax average, b_Q to the queries before the product): forward and every gradient, fp32
and fp16 on the CPU (FlexAttention: forward only, torch has no CPU backward for it), bf16 under `cuda`. Selection
(kernels/attention_select.py): with injected candidates and timer, so its logic runs on the CPU.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

import train_gpt
from kernels import attention_select as sel
from kernels.attention import attention, attention_flex, attention_reference
from tests.conftest import train_tiny_run

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative, against float64


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


def relative_errors(fn, call: sel.AttentionCall, device: str = "cpu", grads: bool = True) -> dict[str, float]:
    """‖fn − oracle‖ / ‖oracle‖ for the output and, with `grads`, the gradients of q, k, v and the learned biases,
    on the model's layout of q, k, v (views of one projection)."""
    leaves, biases, grad_out = call.inputs(torch.device(device))
    names = ["qkv"] + [n for n, b in zip(("b_q", "b_v"), biases) if b is not None and b.requires_grad]

    def run(leaf_values, bias_values, dtype_fn):
        q, k, v = sel.split_heads(leaf_values[0], call.heads)
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
    sel.AttentionCall(2, 3, 33, 64, torch.float32, True, "shared", "shared", learned=True),
    sel.AttentionCall(1, 2, 17, 32, torch.float32, False, "head", "head", learned=True),
    sel.AttentionCall(2, 2, 40, 64, torch.float32, True, "head", "none"),
    sel.AttentionCall(1, 4, 9, 16, torch.float32, True),
    sel.AttentionCall(2, 3, 33, 64, torch.float16, True, "shared", "shared", learned=True),
    sel.AttentionCall(1, 2, 24, 128, torch.float16, False, "head", "head", learned=True),
    sel.AttentionCall(2, 2, 19, 64, torch.float16, True, "none", "shared"),
]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.describe())
def test_sdpa_path_is_exact_forward_and_backward(call: sel.AttentionCall) -> None:
    errors = relative_errors(attention_reference, call)
    learned = {name for name, kind in (("b_q", call.b_q), ("b_v", call.b_v)) if kind != "none" and call.learned}
    assert set(errors) == {"out", "qkv"} | learned
    assert max(errors.values()) < TOLERANCE[call.dtype], errors


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.describe())
def test_flex_path_forward_is_exact_on_the_cpu(call: sel.AttentionCall) -> None:
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
    assert torch.equal(attention(q, k, v, b_q, b_v, impl="sdpa"), reference)
    assert torch.equal(attention(q, k, v, b_q, b_v, impl="triton"), reference)  # no kernel on the CPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(attention(q, k, v, b_q, b_v, impl="flex"), reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="impl 'cudnn'"):
        attention(q, k, v, impl="cudnn")


# -----------------------------------------------------------------------------
# Selection with injected candidates and timer

CALL = sel.AttentionCall(2, 2, 16, 32, torch.float32, True, "shared", "shared")
CPU = torch.device("cpu")


class FakeTimer:
    """Milliseconds per candidate, recording which candidates it was asked to time."""

    def __init__(self, ms: dict[str, float]) -> None:
        self.ms, self.calls = ms, []

    def __call__(self, name: str, step) -> float:
        step()  # a real forward+backward, so a broken step would surface
        self.calls.append(name)
        return self.ms[name]


def stand_ins(*names: str) -> dict:
    """Candidates that compute the right function (SDPA) under the given names."""
    return {name: attention_reference for name in names}


def choose(timer, tmp_path: Path, candidates=None, call=CALL, env=None, **kwargs) -> dict:
    return sel.choose("auto", call, CPU, compiled=True, candidates=candidates or stand_ins("sdpa", "triton", "flex"),
                      timer=timer, cache=tmp_path / "cache.json", env=env or {}, **kwargs)


def test_fastest_wins_and_near_ties_go_to_the_library() -> None:
    assert sel.fastest({"sdpa": 1.0, "triton": 0.8, "flex": 0.9}) == "triton"
    assert sel.fastest({"sdpa": 1.0, "triton": 0.99}) == "sdpa"  # within 2%: the library
    assert sel.fastest({"flex": 0.5, "triton": 0.5}) == "triton"
    assert sel.fastest({"flex": 0.5, "triton": 0.6, "sdpa": 0.7}) == "flex"


def test_a_cache_miss_measures_and_a_hit_does_not(tmp_path: Path) -> None:
    timer = FakeTimer({"sdpa": 2.0, "triton": 1.0, "flex": 3.0})
    first = choose(timer, tmp_path)
    assert (first["choice"], first["source"], first["timings_ms"]) == ("triton", "measured", timer.ms)
    assert sorted(timer.calls) == ["flex", "sdpa", "triton"]
    cached = json.loads((tmp_path / "cache.json").read_text())
    assert list(cached) == [sel.cache_key(CALL, CPU, True)] and cached[sel.cache_key(CALL, CPU, True)]["choice"] == \
        "triton"

    timer.calls.clear()
    again = choose(timer, tmp_path)
    assert timer.calls == [] and again["choice"] == "triton" and again["source"].startswith("cached measurement")
    assert again["timings_ms"] == first["timings_ms"]

    other = sel.AttentionCall(2, 2, 16, 32, torch.float32, False, "shared", "shared")  # bidirectional: another key
    choose(FakeTimer({"sdpa": 1.0, "triton": 2.0, "flex": 3.0}), tmp_path, call=other)
    assert len(json.loads((tmp_path / "cache.json").read_text())) == 2
    assert choose(timer, tmp_path, call=other)["choice"] == "sdpa" and timer.calls == []


def test_cache_key_names_the_gpu_software_kernel_call_and_compilation() -> None:
    key = sel.cache_key(CALL, CPU, compiled=False)
    for part in ("cpu", f"torch {torch.__version__}", "triton ", "kernel ", CALL.describe(), "eager"):
        assert part in key
    assert key != sel.cache_key(CALL, CPU, compiled=True)


def test_a_failing_or_wrong_candidate_is_skipped_with_its_reason(tmp_path: Path) -> None:
    def fails_to_compile(*args):
        raise RuntimeError("CompilationError: out of resource: shared memory\nmore detail")

    def wrong(q, k, v, b_q, b_v, causal):
        return attention_reference(q, k, v, None, b_v, causal)  # forgets b_Q

    lines = []
    timer = FakeTimer({"sdpa": 2.0, "triton": 1.0, "flex": 0.5})
    record = choose(timer, tmp_path, candidates={"sdpa": attention_reference, "triton": fails_to_compile,
                                                 "flex": wrong})
    assert record["choice"] == "sdpa" and timer.calls == ["sdpa"]
    assert record["skipped"]["triton"] == "RuntimeError: CompilationError: out of resource: shared memory"
    assert "differs from SDPA" in record["skipped"]["flex"]
    lines.append(sel.summary_line(record))
    assert "triton: RuntimeError: CompilationError" in lines[0] and "flex: ValueError: its output differs" in lines[0]
    with pytest.raises(RuntimeError, match="no implementation ran.*triton: RuntimeError"):
        choose(timer, tmp_path / "other", candidates={"triton": fails_to_compile, "flex": wrong})


def test_every_rank_uses_rank_0s_choice(tmp_path: Path) -> None:
    boxes: list = []

    def broadcast(record):  # rank 0 sends; the others receive what rank 0 sent
        if record is not None:
            boxes.append(record)
        return boxes[-1]

    rank0 = choose(FakeTimer({"sdpa": 2.0, "triton": 1.0, "flex": 3.0}), tmp_path, broadcast=broadcast)
    timer1 = FakeTimer({"sdpa": 0.1, "triton": 9.0, "flex": 9.0})  # rank 1 alone would pick sdpa
    rank1 = sel.choose("flex", CALL, CPU, compiled=True, rank=1, candidates=stand_ins("sdpa"), timer=timer1,
                       cache=tmp_path / "rank1.json", env={sel.ENV: "sdpa"}, broadcast=broadcast)
    assert rank1 == rank0 and rank1["choice"] == "triton" and timer1.calls == []
    assert not (tmp_path / "rank1.json").exists()

    with pytest.raises(sel.Unavailable, match=sel.ENV):  # rank 0 refuses: it tells the others instead of leaving
        choose(timer1, tmp_path, broadcast=broadcast, env={sel.ENV: "fastest"})  # them waiting
    with pytest.raises(sel.Unavailable, match=rf"^\${sel.ENV}='fastest' is not one of"):  # rank 0's refusal, as is
        choose(timer1, tmp_path, broadcast=broadcast, rank=1)
    with pytest.raises(RuntimeError, match="no implementation ran"):  # rank 0 fails (not a refusal of the input)
        choose(timer1, tmp_path / "fresh", broadcast=broadcast,
               candidates={"triton": lambda *args: 1 / 0, "flex": lambda *args: 1 / 0})
    with pytest.raises(RuntimeError, match="rank 0 could not choose.*no implementation ran"):
        choose(timer1, tmp_path, broadcast=broadcast, rank=1)


def test_the_environment_variable_forces_a_choice(tmp_path: Path) -> None:
    timer = FakeTimer({"sdpa": 2.0, "triton": 1.0, "flex": 3.0})
    record = choose(timer, tmp_path, env={sel.ENV: "flex"})
    assert (record["requested"], record["choice"], record["source"]) == ("flex", "flex", f"${sel.ENV}")
    assert timer.calls == [] and not (tmp_path / "cache.json").exists()
    forced = sel.choose("triton", CALL, CPU, compiled=True, candidates=stand_ins("sdpa", "triton"), env={})
    assert (forced["choice"], forced["source"]) == ("triton", "--attention-impl")


def test_an_unreadable_cache_is_measured_again_and_replaced(tmp_path: Path) -> None:
    (tmp_path / "cache.json").write_text("{not json")
    record = choose(FakeTimer({"sdpa": 2.0, "triton": 1.0, "flex": 3.0}), tmp_path)
    assert record["source"] == "measured" and "ignoring the unreadable cache" in record["notes"][0]
    assert json.loads((tmp_path / "cache.json").read_text())[sel.cache_key(CALL, CPU, True)]["choice"] == "triton"


@pytest.mark.parametrize("entry", [{"choice": ["triton"]}, {"choice": "triton", "timings_ms": [1.0]},
                                   {"choice": "triton", "failed": {"flex": 3}}, "triton"])
def test_a_malformed_cache_entry_is_measured_again_and_replaced(tmp_path: Path, entry) -> None:
    (tmp_path / "cache.json").write_text(json.dumps({sel.cache_key(CALL, CPU, True): entry}))
    record = choose(FakeTimer({"sdpa": 2.0, "triton": 1.0, "flex": 3.0}), tmp_path)
    assert record["source"] == "measured" and "ignoring the malformed entry" in record["notes"][0]
    assert "triton 1.000 ms" in sel.summary_line(record)
    assert json.loads((tmp_path / "cache.json").read_text())[sel.cache_key(CALL, CPU, True)]["timings_ms"] == {
        "sdpa": 2.0, "triton": 1.0, "flex": 3.0}


def test_auto_on_the_cpu_is_sdpa_without_timing(tmp_path: Path) -> None:
    def no_timing(name, step):
        raise AssertionError(f"timed {name}")

    record = sel.choose("auto", CALL, CPU, compiled=False, timer=no_timing, cache=tmp_path / "c.json", env={})
    assert (record["choice"], record["source"]) == ("sdpa", "the only candidate")
    assert "CUDA" in record["skipped"]["triton"] and "no backward" in record["skipped"]["flex"]
    assert record["seconds"] < 0.1 and not (tmp_path / "c.json").exists()
    with pytest.raises(ValueError, match="--attention-impl triton: the Triton kernel runs on CUDA"):
        sel.choose("triton", CALL, CPU, compiled=False, env={})
    with pytest.raises(ValueError, match="--attention-impl flex: FlexAttention has no backward"):
        sel.choose("flex", CALL, CPU, compiled=False, env={})


def test_the_call_follows_the_model_config() -> None:
    cfg = train_gpt.GPTConfig(n_head=4, n_embd=256, bias_mode="learned", bias_per_head=True, objective="mlm")
    assert sel.AttentionCall.of_model(cfg, 8, 128, torch.bfloat16) == sel.AttentionCall(
        8, 4, 128, 64, torch.bfloat16, False, "head", "head", True)
    cfg = train_gpt.GPTConfig(bias_mode="bv")
    assert sel.AttentionCall.of_model(cfg, 8, 512, torch.float32) == sel.AttentionCall(
        8, 12, 512, 64, torch.float32, True, "none", "shared", False)
    assert sel.AttentionCall.of_model(train_gpt.GPTConfig(attention="relational", bias_mode="none"), 8, 512,
                                      torch.float32) is None


# -----------------------------------------------------------------------------
# The model: no graph break for either path; the trainer's record; resume

def tiny_model(impl: str, **overrides) -> train_gpt.GPT:
    torch.manual_seed(0)
    model = train_gpt.GPT(train_gpt.GPTConfig(**{**dict(vocab_size=64, block_size=16, n_layer=2, n_head=2,
                                                          n_embd=64, bias_mode="learned"), **overrides}))
    sel.set_implementation(model, impl)
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
    sel.set_implementation(model, "sdpa")
    with torch.no_grad():
        torch.testing.assert_close(model(idx, idx)[1], eager, rtol=1e-5, atol=1e-5)


def test_the_trainer_records_the_choice_and_resume_selects_again(tmp_path: Path) -> None:
    run = train_tiny_run(tmp_path, "--attention-impl", "sdpa", "--checkpoint-every", "2")
    record = json.loads((run / "config.json").read_text())["attention"]
    assert (record["requested"], record["choice"], record["source"]) == ("sdpa", "sdpa", "--attention-impl")
    assert "attention: sdpa (--attention-impl; 2x2x32x16 float32 causal" in (run / "log.txt").read_text()

    # a resumed run keeps the request it was given (sdpa) unless a flag changes it, and then decides anew
    train_gpt.main(["--resume", str(run), "--steps", "6", "--attention-impl", "auto"])
    record = json.loads((run / "config.json").read_text())["attention"]
    assert (record["requested"], record["choice"], record["source"]) == ("auto", "sdpa", "the only candidate")
    assert "attention: sdpa (the only candidate;" in (run / "log.txt").read_text()


def test_a_forced_implementation_that_cannot_run_stops_the_run_before_training(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as excinfo:
        train_tiny_run(tmp_path, "--attention-impl", "triton")
    error = capsys.readouterr().err
    assert excinfo.value.code == 2 and "Traceback" not in error
    assert "error: --attention-impl triton: the Triton kernel runs on CUDA devices" in error
    assert not (tmp_path / "tiny" / "checkpoints").exists()


# -----------------------------------------------------------------------------
# CUDA: bf16 exactness with gradients, the compiled model on every path, a real measurement

CUDA_CALLS = [
    sel.AttentionCall(2, 4, 256, 64, torch.bfloat16, True, "shared", "shared", learned=True),
    sel.AttentionCall(2, 2, 200, 128, torch.bfloat16, False, "head", "head", learned=True),
    sel.AttentionCall(2, 4, 300, 64, torch.bfloat16, True, "head", "shared"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["sdpa", "flex", "triton"])
@pytest.mark.parametrize("call", CUDA_CALLS, ids=lambda c: c.describe())
def test_cuda_paths_are_exact_in_bf16(impl: str, call: sel.AttentionCall) -> None:
    fn = torch.compile(sel.IMPLEMENTATION_FNS[impl]) if impl == "flex" else sel.IMPLEMENTATION_FNS[impl]
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
def test_cuda_auto_measures_every_candidate(tmp_path: Path) -> None:
    call = sel.AttentionCall(4, 12, 512, 64, torch.bfloat16, True, "shared", "shared")
    record = sel.choose("auto", call, torch.device("cuda"), compiled=True, cache=tmp_path / "c.json", env={})
    assert record["source"] == "measured" and record["choice"] in record["timings_ms"]
    assert set(record["timings_ms"]) | set(record["skipped"]) == {"triton", "sdpa", "flex"}
    assert {"triton", "sdpa"} <= set(record["timings_ms"]), record["skipped"]
    again = sel.choose("auto", call, torch.device("cuda"), compiled=True, cache=tmp_path / "c.json", env={})
    assert again["choice"] == record["choice"] and again["seconds"] < record["seconds"]
