"""The training step replayed from a CUDA graph: --compile-mode reduce-overhead or max-autotune
(docs/runs.md#cuda-graphs).

A CUDA graph records the kernels of one step, with their arguments and device addresses, and replays them with one
launch, so the host's cost of a step no longer grows with its number of kernels. What a replay reads must therefore
sit at the same addresses every step and change only by being written there: the batch and the biases are copied
into static buffers (`StepGraph`), the optimizer's per-step scalars (learning rates, bias corrections) into device
buffers it reads (`stage_step`, optim/base.py), and the gradients accumulate in place or into memory the graph owns.
Nothing inside may read a device value on the host or wait for the device. Steps the optimizer does differently (its
first, SOAP's basis refresh) run eagerly from the same buffers. Without CUDA the same copies feed the step run
eagerly: the rehearsal that the CPU tests check against the default mode. Importing this module has no side effects.
"""
from __future__ import annotations

from typing import Callable

import torch

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


def graph_problem(world: int, step_hooks: list[str], optimizer) -> str | None:
    """Why a run's step cannot be replayed from a CUDA graph (one line), or None: its gradients averaged between
    processes, a hook that acts between the backward pass and the optimizer step, or the optimizer's own reason."""
    if world > 1:
        return (f"a run on {world} processes averages its gradients between them, which the graph does not capture "
                "(one process per run, e.g. `python -m grid --runs-per-gpu`, is what it is for)")
    if step_hooks:
        return f"{', '.join(step_hooks)} acts on each step from the host"
    return optimizer.capture_problem()


def graph_step(fn: Callable[..., torch.Tensor], device: torch.device, world: int, step_hooks: list[str], optimizer,
               mode: str, log: Callable[[str], None]) -> Callable[..., torch.Tensor]:
    """The trainer's step under --compile-mode `mode` (reduce-overhead or max-autotune): a StepGraph of `fn`, or `fn`
    itself when `graph_problem` gives a reason, which `log` gets in one line."""
    problem = graph_problem(world, step_hooks, optimizer)
    if problem:
        log(f"--compile-mode {mode}: no CUDA graph: {problem}; the step runs in the default mode")
        return fn
    if device.type != "cuda":
        log(f"--compile-mode {mode}: no CUDA here, so no graph: the step runs eagerly from the static buffers a "
            "graph would replay (a rehearsal; the same numbers as the default mode)")
    return StepGraph(fn, device, optimizer, log)


class StepGraph:
    """Runs `fn(*inputs) -> loss` (the step's device work) from static copies of its tensor inputs: on CUDA, eagerly
    for `warmup` steps and whenever `optimizer.steady_step()` says the step differs from the last, else from one CUDA
    graph captured at the first steady step after the warm-up (after `optimizer.prepare_capture()`) and replayed
    from then on. The returned loss of a replay is the graph's own output, rewritten by the next replay: read it (or
    copy it) before the next step.

    After a failed capture the optimizer's gradients are reset (they point into the discarded graph's memory), `fn`
    runs directly, as in the default mode, and `disabled` says why. `log` gets one line for the capture and one for a
    failure."""

    def __init__(self, fn: Callable[..., torch.Tensor], device: torch.device, optimizer, log: Callable[[str], None],
                 warmup: int = WARMUP_STEPS) -> None:
        self.fn, self.device, self.optimizer, self.log, self.warmup = fn, device, optimizer, log, warmup
        self.static: tuple | None = None  # the inputs' static copies
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss: torch.Tensor | None = None  # the graph's output
        self.eager_steps = 0
        self.replays = 0
        self.disabled: str | None = None
        self.side_stream: torch.cuda.Stream | None = None

    def __call__(self, *inputs) -> torch.Tensor:
        if self.disabled:
            return self.fn(*inputs)
        self.copy_inputs(inputs)
        if self.device.type != "cuda":
            return self.fn(*self.static)
        if self.graph is not None and self.optimizer.steady_step():
            self.graph.replay()
            self.replays += 1
            return self.loss
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

    def eager(self) -> torch.Tensor:
        """One step without the graph, on a side stream (the warm-up a later capture needs: PyTorch's CUDA-graph
        recipe), ordered after and before the default stream's work."""
        current = torch.cuda.current_stream(self.device)
        self.side_stream = self.side_stream or torch.cuda.Stream(self.device)
        self.side_stream.wait_stream(current)
        with torch.cuda.stream(self.side_stream):
            loss = self.fn(*self.static)
        current.wait_stream(self.side_stream)
        return loss

    def capture(self) -> torch.Tensor:
        """Capture the step (which runs nothing on the device), then replay it for this step. A failure is logged in
        one line and the run continues without graphs. thread_local: the loader's thread may pin memory meanwhile."""
        graph = torch.cuda.CUDAGraph()
        try:
            self.optimizer.prepare_capture()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                loss = self.fn(*self.static)
        except Exception as exc:  # noqa: BLE001 (whatever breaks a capture, the default mode still runs)
            self.disabled = one_line(exc)
            self.log(f"CUDA graph: capturing the training step failed ({self.disabled}); the run continues in the "
                     "default mode")
            self.optimizer.zero_grad(set_to_none=True)
            return self.fn(*self.static)
        self.graph, self.loss = graph, loss
        self.log(f"CUDA graph: the training step is captured after {self.eager_steps} eager steps and replayed "
                 "from now on (steps that differ run eagerly)")
        graph.replay()
        self.replays += 1
        return loss
