"""The training step that a CUDA graph replays (run/capture.py, docs/runs.md#cuda-graphs). On the CPU: the rehearsal
of --compile-mode reduce-overhead (the step run eagerly from the static buffers a graph replays) gives the default
mode's losses bit for bit with every optimizer; every steady step after the warm-up issues the same operations with
the same scalars on the same tensors (what a replayed graph does), the batch and the biases reach them only by copies
into static buffers, and the optimizers' per-step scalars only through their staged device buffers; StepGraph's
order of eager steps, capture and replays, and its fallback when a capture fails, with CUDA's graph API stood in for;
a run that cannot be captured says why in one line and trains in the default mode. On CUDA (marked cuda): every
attention path with every optimizer captures and matches the default mode, and a capture that fails falls back to
the default mode."""
from __future__ import annotations

import importlib
import math

import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

import train_gpt
from optim import OPTIMIZERS
from run import capture
from run.log import RunLog, read_log
from run.process import setup_process
from tests.helpers import FakeCuda, tiny_args, train_losses

OPTIMIZER_FLAGS = {"adamw": {}, "sgdm": {}, "ecd": {}, "muon": {}, "soap": {"soap-precondition-frequency": 3}}
# A learning rate that changes every step, two micro-steps per step, sampled biases: every input a step has
STEP_FLAGS = {"lr-schedule": "cosine", "warmup-steps": 3, "micro-batch": 2, "batch-tokens": 128, "val-every": 0,
              "bias-mode": "bqbv"}


def run_flags(corpus, tmp_path, name: str, optimizer: str, **extra) -> list[str]:
    return tiny_args(corpus, tmp_path, name, optimizer=optimizer, **{**OPTIMIZER_FLAGS[optimizer], **STEP_FLAGS,
                                                                     **extra})


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZER_FLAGS))
def test_the_rehearsed_graph_step_gives_the_default_modes_losses(corpus, tmp_path, optimizer):
    train_gpt.main(run_flags(corpus, tmp_path, "default", optimizer, steps=7))
    train_gpt.main(run_flags(corpus, tmp_path, "graph", optimizer, steps=7, **{"compile-mode": "reduce-overhead"}))
    default, graph = train_losses(tmp_path / "default"), train_losses(tmp_path / "graph")
    assert len(default) == 7 and all(math.isfinite(v) for v in default.values())
    assert graph == default  # bit for bit: the same operations on the same numbers
    assert "a rehearsal; the same numbers as the default mode" in (tmp_path / "graph" / "log.txt").read_text()


VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class OpTrace(TorchDispatchMode):
    """Every aten operation run under it: its name, its non-tensor arguments and results, and each tensor argument
    as ("ext", address) when its storage existed before (parameters, state, static buffers) or ("new", k) for the
    k-th storage an operation of the trace made; plus where `mark` was called."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.writes: list[tuple[str, set[int]]] = []  # (operation, storages it writes), in order
        self.marks: dict[str, list[int]] = {}
        self.made: dict[int, int] = {}  # storage address -> k
        self.count = 0

    def mark(self, name: str) -> None:
        """Mark a point of the trace; from a "fn" mark on, storages made before count as pre-existing."""
        self.marks.setdefault(name, []).append(len(self.ops))
        if name == "fn":
            self.made, self.count = {}, 0

    def _name(self, t: torch.Tensor) -> tuple:
        ptr = t.untyped_storage().data_ptr()
        where = ("new", self.made[ptr]) if ptr in self.made else ("ext", ptr)
        return (*where, t.storage_offset(), tuple(t.shape), tuple(t.stride()), str(t.dtype))

    def _describe(self, x: object) -> object:
        if isinstance(x, torch.Tensor):
            return self._name(x)
        return x if isinstance(x, VALUES) else type(x).__name__  # e.g. the profiler's record_function handles

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        described = tuple(self._describe(x) for x in flat)
        if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(v) on the host: a graph keeps v, by value
            described = (("value", args[0].tolist()),)
        written = {a.untyped_storage().data_ptr() for a, spec in zip(args, func._schema.arguments)
                   if isinstance(a, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write}
        out = func(*args, **kwargs)
        inputs = {x.untyped_storage().data_ptr() for x in flat if isinstance(x, torch.Tensor)
                  and func is not torch.ops.aten.lift_fresh.default}
        results = []
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                ptr = x.untyped_storage().data_ptr()
                if ptr not in inputs:  # a fresh storage (its address may be a freed one's)
                    self.made[ptr], self.count = self.count, self.count + 1
                results.append(self._name(x))
            else:
                results.append(self._describe(x))  # a value read on the host (item(), tolist())
        self.ops.append((str(func), described, tuple(results)))
        self.writes.append((str(func), written))
        return out


def build_trainer(corpus, tmp_path, optimizer: str) -> train_gpt.Trainer:
    cfg = train_gpt.parse_config(run_flags(corpus, tmp_path, optimizer, optimizer, steps=20,
                                           **{"compile-mode": "reduce-overhead"}))
    return train_gpt.Trainer(cfg, setup_process(cfg.train), RunLog(True))


@pytest.mark.parametrize("optimizer", ["adamw", "ecd", "muon", "soap"])
def test_every_steady_step_does_the_same_work_on_the_same_tensors_fed_only_by_copies(corpus, tmp_path, optimizer,
                                                                                     monkeypatch):
    """What a CUDA graph needs to replay a step correctly, checked on the operations the CPU runs: the step function
    of every steady step after the warm-up (the learning rate and Adam's bias corrections change between them; for
    SOAP, on both sides of an eager basis refresh) issues the same operations with the same scalars on the same
    pre-existing tensors, and outside it only copies write the static buffers it reads. torch's AdamW takes its
    capturable path on CUDA only: here it is let onto the CPU (SGD's fused step, its capturable one, is CUDA's)."""
    if optimizer == "adamw":
        adam = importlib.import_module("torch.optim.adam")
        monkeypatch.setattr(adam, "_get_capturable_supported_devices", lambda **_: ["cpu"])
        monkeypatch.setattr(OPTIMIZERS["adamw"].optimizer, "_on_cuda", lambda self: True)
    trainer = build_trainer(corpus, tmp_path, optimizer)
    trainer.train_step()
    trainer.optimizer.prepare_capture()  # what the capture does first on CUDA
    graph = trainer.run_step
    assert isinstance(graph, capture.StepGraph)
    trace, step_fn = OpTrace(), graph.fn

    def traced_fn(*inputs):
        trace.mark("fn")
        loss = step_fn(*inputs)
        trace.mark("end")
        return loss

    graph.fn = traced_fn
    try:
        steady = []
        for _ in range(7):
            with trace:
                steady.append((trainer.optimizer.steady_step(), len(trace.ops)))
                trainer.train_step()
        fn_traces = [trace.ops[a:b] for a, b in zip(trace.marks["fn"], trace.marks["end"])]
        replayed = [i for i, (is_steady, _) in enumerate(steady) if is_steady and i + 1 >= capture.WARMUP_STEPS]
        assert len(replayed) >= 3, steady  # for SOAP, on both sides of a basis refresh (run eagerly)
        for i in replayed[1:]:  # what the graph captured at the first would do at each later one
            assert fn_traces[i] == fn_traces[replayed[0]], (i, first_difference(fn_traces[replayed[0]], fn_traces[i]))
        static = {t.untyped_storage().data_ptr() for t in capture.tensors(graph.static)}
        read = {arg[1] for op in fn_traces[-1] for arg in op[1] if isinstance(arg, tuple) and arg[:1] == ("ext",)}
        assert static <= read  # the step reads its batch and biases from the static buffers
        inside = {k for a, b in zip(trace.marks["fn"], trace.marks["end"]) for k in range(a, b)}
        outside_writes = [(name, written & static) for k, (name, written) in enumerate(trace.writes)
                          if k not in inside and written & static]
        assert outside_writes and {name for name, _ in outside_writes} == {"aten.copy_.default"}
        assert len(outside_writes) == len(static) * len(steady)  # each buffer once per step
    finally:
        trainer.close()


def first_difference(a: list, b: list) -> tuple:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k, x, y
    return len(a), len(b)


class StepOptimizer:
    """What StepGraph asks of an optimizer, recorded."""

    def __init__(self, steady: list[bool]) -> None:
        self.steady, self.calls = steady, []

    def steady_step(self) -> bool:
        return self.steady[len([c for c in self.calls if c == "step"])]

    def prepare_capture(self) -> None:
        self.calls.append("prepare")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append("zero_grad")


@pytest.mark.parametrize("fail", [False, True])
def test_the_step_graph_warms_up_captures_replays_and_falls_back(monkeypatch, fail):
    cuda, lines = FakeCuda(fail), []
    cuda.install(monkeypatch)
    steady = [False, True, True, True, False, True, True]  # a first step and a refresh (SOAP's) that differ
    optimizer = StepOptimizer(steady)
    seen, out = [], torch.zeros(())  # a graph's output lives at one address, rewritten by every replay

    def step(x):
        seen.append((x.item(), cuda.capturing is not None))
        return out.copy_(x * 2)

    graph = capture.StepGraph(cuda.recording(step), torch.device("cuda"), optimizer, lines.append)
    losses = []
    for k in range(len(steady)):
        losses.append(graph(torch.tensor(float(k))).item())
        optimizer.calls.append("step")
    assert losses == [2.0 * k for k in range(len(steady))]  # every step computed on its own input
    if not fail:
        assert cuda.events == ["capture", "replay", "replay", "replay", "replay"]  # from step 2; step 4 eager
        assert [capturing for _, capturing in seen].count(True) == 1 and graph.replays == 4
        assert optimizer.calls.count("prepare") == 1 and "zero_grad" not in optimizer.calls
        assert lines == ["CUDA graph: the training step is captured after 2 eager steps and replayed from now on "
                         "(steps that differ run eagerly)"]
    else:
        assert cuda.events == ["capture"] and graph.disabled.startswith("RuntimeError: CUDA error: operation not")
        assert lines == [f"CUDA graph: capturing the training step failed ({graph.disabled}); the run continues in "
                         "the default mode"] and "\n" not in lines[0]
        assert optimizer.calls.count("zero_grad") == 1  # the gradients the capture left behind
        assert [x for x, capturing in seen if not capturing] == [0, 1, 2, 3, 4, 5, 6]


def test_the_host_reads_only_the_outputs_of_a_replayed_step(corpus, tmp_path, monkeypatch):
    """A replay runs no Python, so what the captured step function sets on the trainer or the optimizer keeps the
    value of the last step that ran it, which after an eager step (SOAP's basis refresh) is no longer the one the graph
    rewrites. With CUDA's graph API stood in for (FakeCuda: a replay reruns the step but puts back the attributes it
    rebinds), a run that alternates replays and eager steps logs the default mode's losses and gradient norms."""
    flags = {"steps": 9, "grad-clip": 0.05, "log-every": 1}
    train_gpt.main(run_flags(corpus, tmp_path, "default", "soap", **flags))
    cuda, graphs, graph_step = FakeCuda(), [], capture.graph_step
    cuda.install(monkeypatch)

    def on_cuda(fn, *args, **kwargs):
        graph = graph_step(fn, *args, **kwargs)
        graph.device, graph.fn = torch.device("cuda"), cuda.recording(graph.fn)
        cuda.frozen = [fn.__self__, fn.__self__.optimizer]  # the trainer's and the optimizer's attributes
        graphs.append(graph)
        return graph

    monkeypatch.setattr(capture, "graph_step", on_cuda)
    train_gpt.main(run_flags(corpus, tmp_path, "graph", "soap", **flags, **{"compile-mode": "reduce-overhead"}))
    [graph] = graphs
    assert cuda.events[0] == "capture" and graph.replays >= 3
    assert graph.eager_steps > capture.WARMUP_STEPS  # a basis refresh ran eagerly between replays
    default, replayed = (read_log(tmp_path / name) for name in ("default", "graph"))
    numbers = [[(r["train_loss"], r["grad_norm"]) for r in log if "train_loss" in r] for log in (default, replayed)]
    assert len(numbers[0]) == 9 and numbers[1] == numbers[0]


def test_a_run_that_cannot_be_captured_says_why_and_trains_in_the_default_mode(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "gauge", steps=3, **{"val-every": 0, "compile-mode": "reduce-overhead",
                                                                     "gauge": "dress"}))
    text = (tmp_path / "gauge" / "log.txt").read_text()
    assert ("--compile-mode reduce-overhead: no CUDA graph: --gauge dress rewrites the weights from the host after "
            "every step, which replayed steps have not been validated with; the step runs in the default mode") in text
    assert len(train_losses(tmp_path / "gauge")) == 3


def test_each_reason_a_step_cannot_be_captured_is_one_line(corpus, tmp_path):
    cfg = train_gpt.parse_config(run_flags(corpus, tmp_path, "r", "ecd", **{"ecd-nu": 0.1}))
    model = train_gpt.GPT(cfg.model)  # the model the run's flags describe (here and below), as the trainer builds it
    ecd = OPTIMIZERS["ecd"].build(model, cfg.optim)
    assert "--ecd-nu 0" in capture.graph_problem(1, [], ecd)
    assert "2 processes" in capture.graph_problem(2, [], ecd)
    assert capture.graph_problem(1, ["--gauge dress"], ecd).startswith("--gauge dress rewrites the weights")
    bf16 = OPTIMIZERS["soap"].build(train_gpt.GPT(cfg.model), OPTIMIZERS["soap"].config(optim_state_dtype="bf16"))
    assert capture.graph_problem(1, [], bf16) is None  # the CPU rounds to nearest: nothing seeded per step
    bf16.fused = True  # the Triton kernels round stochastically with a seed per step
    assert "--optim-state-dtype fp32" in capture.graph_problem(1, [], bf16)
    for problem in (capture.graph_problem(1, [], ecd), capture.graph_problem(1, [], bf16)):
        assert "\n" not in problem


# -- on CUDA --------------------------------------------------------------------------------------------------------

CUDA_CASES = [(impl, optimizer, False) for impl in ("sdpa", "triton") for optimizer in sorted(OPTIMIZER_FLAGS)]
CUDA_CASES += [("flex", "adamw", True), ("triton", "adamw", True)]  # with torch.compile (FlexAttention needs it)


@pytest.mark.cuda
@pytest.mark.parametrize("impl, optimizer, compiled", CUDA_CASES)
def test_on_cuda_the_step_captures_and_replays_the_default_modes_numbers(corpus, tmp_path, impl, optimizer,
                                                                         compiled):
    flags = {"device": "cuda", "attention-impl": impl, "compile": compiled, "steps": 8, "n-head": 2,
             "n-embd": 128, "block-size": 64, "seq-len": 64, "batch-tokens": 512, "micro-batch": 4}
    train_gpt.main(run_flags(corpus, tmp_path, "default", optimizer, **flags))
    train_gpt.main(run_flags(corpus, tmp_path, "graph", optimizer, **flags, **{"compile-mode": "reduce-overhead"}))
    text = (tmp_path / "graph" / "log.txt").read_text()
    assert "CUDA graph: the training step is captured" in text and "failed" not in text, text[-3000:]
    default, graph = train_losses(tmp_path / "default"), train_losses(tmp_path / "graph")
    assert default.keys() == graph.keys() and len(default) == 8
    for step in default:  # bf16 kernels with atomics differ in rounding from run to run
        assert graph[step] == pytest.approx(default[step], rel=2e-2, abs=2e-2), (step, default, graph)


@pytest.mark.cuda
def test_on_cuda_a_step_that_cannot_be_captured_falls_back_to_the_default_mode(corpus, tmp_path, monkeypatch):
    device_step = OPTIMIZERS["adamw"].optimizer.device_step

    def reads_the_loss_on_the_host(self, loss=None):  # a host sync: illegal while capturing
        float(loss)
        device_step(self, loss)

    monkeypatch.setattr(OPTIMIZERS["adamw"].optimizer, "device_step", reads_the_loss_on_the_host)
    train_gpt.main(run_flags(corpus, tmp_path, "fallback", "adamw", device="cuda", steps=6, compile=False,
                             **{"compile-mode": "reduce-overhead"}))
    lines = [line for line in (tmp_path / "fallback" / "log.txt").read_text().splitlines()
             if "capturing the training step failed" in line]
    assert len(lines) == 1 and lines[0].endswith("the run continues in the default mode")
    losses = train_losses(tmp_path / "fallback")
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses.values())