"""The training step replayed from a CUDA graph: --compile-mode reduce-overhead or max-autotune
(docs/runs.md#cuda-graphs).

A CUDA graph records the kernels of one step, with their arguments and device addresses, and replays them with one
launch, so the host's cost of a step no longer grows with its number of kernels. What a replay reads must therefore
sit at the same addresses every step and change only by being written there: the batch and the biases are copied
into static buffers (`StepGraph`), the optimizer's per-step scalars (learning rates, bias corrections) into device
buffers it reads (`stage_step`, optim/base.py), and the gradients accumulate in place or into memory the graph owns.
Nothing inside may read a device value on the host or wait for the device, and the host reads nothing the step writes
but its returned outputs: a replay runs no Python, so an attribute the step sets would keep the tensor of the step that
last ran it, which after an eager step is no longer the one the graph rewrites. Steps the optimizer does differently
(its first, SOAP's basis refresh) run eagerly from the same buffers. Without CUDA the same copies feed the step run
eagerly: the rehearsal that the CPU tests check against the default mode. Importing this module has no side effects.
"""
from __future__ import annotations

from typing import Callable

import torch

from run.process import Runtime

WARMUP_STEPS = 2  # eager steps before the capture: compilation, lazy state, the allocator's and libraries' set-up


def tensors(inputs: object) -> list[torch.Tensor]:
    """The tensors of nested lists and tuples, in order."""
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    return [t for item in inputs for t in tensors(item)] if isinstance(inputs, (list, tuple)) else []


def cloned(inputs: object) -> object:
    """Nested lists and tuples with each tensor cloned."""
    if isinstance(inputs, torch.Tensor):
        return inputs.clone()
    return type(inputs)(cloned(item) for item in inputs) if isinstance(inputs, (list, tuple)) else inputs


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def graph_problem(world: int, step_tools: list[str], optimizer) -> str | None:
    """Why a run's step is not replayed from a CUDA graph (one line), or None: its gradients averaged between
    processes, a tool that rewrites the weights between steps (hooks.TrainingHooks.step_tools), or the optimizer's
    own reason."""
    if world > 1:
        return (f"a run on {world} processes averages its gradients between them, which the graph does not capture "
                "(one process per run, e.g. `python -m grid --runs-per-gpu`, is what it is for)")
    if step_tools:
        return (f"{', '.join(step_tools)} rewrites the weights from the host after every step, which replayed steps "
                "have not been validated with")
    return optimizer.capture_problem()


def graph_step(fn: Callable[..., object], optimizer, rt: Runtime, *, mode: str, step_tools: list[str],
               log_line: Callable[[str], None]) -> Callable[..., object]:
    """The trainer's step `fn` on this process (`rt`) under --compile-mode `mode` (reduce-overhead or max-autotune):
    a StepGraph of `fn`, or `fn` itself when `graph_problem` gives a reason, which `log_line` gets."""
    problem = graph_problem(rt.world, step_tools, optimizer)
    if problem:
        log_line(f"--compile-mode {mode}: no CUDA graph: {problem}; the step runs in the default mode")
        return fn
    if rt.device.type != "cuda":
        log_line(f"--compile-mode {mode}: no CUDA here, so no graph: the step runs eagerly from the static buffers a "
                 "graph would replay (a rehearsal; the same numbers as the default mode)")
    return StepGraph(fn, rt.device, optimizer, log_line)


class StepGraph:
    """Runs `fn(*inputs) -> outputs` (the step's device work; tensors in nested tuples) from static copies of its
    tensor inputs: on CUDA, eagerly for `warmup` steps and whenever `optimizer.steady_step()` says the step differs
    from the last, else from one CUDA graph captured at the first steady step after the warm-up (after
    `optimizer.prepare_capture()`) and replayed from then on. The outputs of a replay are the graph's own, rewritten
    by the next replay: read them (or copy them) before the next step.

    After a failed capture the optimizer's gradients are reset (they point into the discarded graph's memory), `fn`
    runs directly, as in the default mode, and `disabled` says why. `log_line` gets one line for the capture and one
    for a failure."""

    def __init__(self, fn: Callable[..., object], device: torch.device, optimizer, log_line: Callable[[str], None],
                 warmup: int = WARMUP_STEPS) -> None:
        self.fn, self.device, self.optimizer, self.log_line, self.warmup = fn, device, optimizer, log_line, warmup
        self.static: tuple | None = None  # the inputs' static copies
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: object = None  # the graph's outputs
        self.eager_steps = 0
        self.replays = 0
        self.disabled: str | None = None
        self.side_stream: torch.cuda.Stream | None = None

    def __call__(self, *inputs) -> object:
        if self.disabled:
            return self.fn(*inputs)
        self.copy_inputs(inputs)
        if self.device.type != "cuda":
            return self.fn(*self.static)
        if self.graph is not None and self.optimizer.steady_step():
            self.graph.replay()
            self.replays += 1
            return self.outputs
        if self.graph is None and self.eager_steps >= self.warmup and self.optimizer.steady_step():
            return self.capture()
        self.eager_steps += 1
        return self.eager()

    def copy_inputs(self, inputs: tuple) -> None:
        """Copy the inputs' tensors into the static buffers (allocated at the first step); the only way they change."""
        if self.static is None:
            self.static = cloned(inputs)
            return
        for buffer, value in zip(tensors(self.static), tensors(inputs), strict=True):
            buffer.copy_(value, non_blocking=True)

    def eager(self) -> object:
        """One step without the graph, on a side stream (the warm-up a later capture needs: PyTorch's CUDA-graph
        recipe), ordered after and before the default stream's work."""
        current = torch.cuda.current_stream(self.device)
        self.side_stream = self.side_stream or torch.cuda.Stream(self.device)
        self.side_stream.wait_stream(current)
        with torch.cuda.stream(self.side_stream):
            outputs = self.fn(*self.static)
        current.wait_stream(self.side_stream)
        return outputs

    def capture(self) -> object:
        """Capture the step (which runs nothing on the device), then replay it for this step. A failure is logged in
        one line and the run continues without graphs. thread_local: the loader's thread may pin memory meanwhile."""
        graph = torch.cuda.CUDAGraph()
        try:
            self.optimizer.prepare_capture()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = self.fn(*self.static)
        except Exception as exc:  # noqa: BLE001 (whatever breaks a capture, the default mode still runs)
            self.disabled = one_line(exc)
            self.log_line(f"CUDA graph: capturing the training step failed ({self.disabled}); the run continues in "
                          "the default mode")
            self.optimizer.zero_grad(set_to_none=True)
            return self.fn(*self.static)
        self.graph, self.outputs = graph, outputs
        self.log_line(f"CUDA graph: the training step is captured after {self.eager_steps} eager steps and "
                      "replayed from now on (steps that differ run eagerly)")
        graph.replay()
        self.replays += 1
        return outputs
