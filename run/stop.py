"""How a run stops: a stop request (SIGINT/SIGTERM) every rank agrees on, the finiteness check of the state a
checkpoint would save, what a run that met a non-finite number says it leaves and what to do, and the line a run
refused on its input or stopped by the filesystem ends with. Importing this module has no side effects."""
from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from fileio import filesystem_error_line
from run.checkpoint import run_checkpoints, run_dir_of, step_of
from run.directory import RunDirectory, run_holds_checkpoint


# Flags changed on --resume in the direction the non-finite stop advises: lower, longer, clipped (or clipped harder).
SAFER_ON_RESUME = {"optim.lr": lambda old, new: new < old, "train.warmup_steps": lambda old, new: new > old,
                   "train.grad_clip": lambda old, new: 0 < new < (old or math.inf)}


class TrainingStopped(SystemExit):
    """A deliberate stop on every rank alike (non-finite state, a signal): the process group can be torn down."""


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every floating-point tensor is finite on every rank (a collective under torchrun; one host sync)."""
    finite = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    bad = (~torch.stack(finite).all()).to(torch.float64).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(bad)
    return bad.item() == 0


def non_finite_stop_message(what: str, step: int, *, lr: float, checkpoint_step: int | None, resumed: dict | None,
                            run_dir: Path) -> str:
    """The line a run that met a non-finite `what` at `step` stops with: what exists (no checkpoint, the unchanged
    checkpoint it resumed from, or a finite checkpoint of its own in `run_dir`) and what to do in each case, given
    --lr `lr`, the step of its last checkpoint (written or resumed from) and what --resume continued from
    (`resumed`). A resumed run that diverged although it followed the advice (a lower --lr, ...) is told that its
    checkpoint was already on its way and pointed to an earlier step file of that run."""
    advice = f"a lower --lr (now {lr:g}), more --warmup-steps or --grad-clip"
    if checkpoint_step is None:
        kept = (f"no checkpoint was written (the run diverged before its first); start a new run with {advice}"
                + (" — at the first step, the flags themselves are the likely cause" if step <= 1 else ""))
    elif resumed and checkpoint_step == resumed["step"]:
        source = Path(resumed["resumed_from"])
        safer, others = [], []
        for key, (old, new) in resumed["changed"].items():
            (safer if key in SAFER_ON_RESUME and SAFER_ON_RESUME[key](old, new) else others).append(
                f"{key} {old} -> {new}")
        kept = f"the checkpoint this run resumed from (step {checkpoint_step}, {source}) is unchanged and finite"
        if safer:
            earlier = [p for p in run_checkpoints(run_dir_of(source) or source.parent)
                       if p.name != "latest.pt" and step_of(p) < checkpoint_step]
            kept += (f", but the run diverged again with the safer settings given on --resume ({', '.join(safer)}"
                     + (f"; also changed: {', '.join(others)}" if others else "") + "): that state was probably "
                     "already diverging; resume from an earlier checkpoint, "
                     + (f"the newest being --resume {earlier[-1]}" if earlier else "but the run kept none "
                        f"(--keep-checkpoints K keeps step_XXXXXX.pt): start a new run with {advice}"))
        else:
            kept += ("; " + (f"the flags changed on --resume ({', '.join(others)}) are the first suspects; "
                             if others else "") + f"resume from it again with {advice}, or from an earlier "
                     "step_XXXXXX.pt")
    else:
        kept = (f"the finite checkpoint of step {checkpoint_step} is kept in {run_dir / 'checkpoints'}; continue "
                f"with --resume {run_dir} and {advice}")
    return f"step {step}: {what} is not finite; stopping: {kept}."


class StopRequest:
    """SIGINT/SIGTERM ask the run to stop; the loop then writes a checkpoint and exits. `agreed()` is called once
    per step on every rank: on one process it returns the signal at once; under torchrun each call starts an
    all-reduce of this rank's signal on a CPU (gloo) group and returns the result of the previous call's, so every
    rank stops at the same step, one step after the signal, without a GPU sync (torchrun kills its workers 30 s
    after forwarding a signal). Every later signal, of either kind, is the same request again: nothing interrupts
    the step and its checkpoint (a grid that dies sends SIGTERM, the grid that adopts the run may send SIGINT, a
    user presses Ctrl-C twice: docs/runs.md#signals); a later one says so on stderr."""

    def __init__(self, world: int) -> None:
        self.signum, self.world = 0, world
        self._previous: dict[int, object] = {}
        self._group = self._vote = self._pending = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        if self.world > 1:
            self._group = dist.new_group(backend="gloo")
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.signum:  # os.write: safe in a handler, which may interrupt a print
            os.write(2, f"{signal.Signals(signum).name} again: the run still stops at the end of this step, with "
                        "its checkpoint (SIGKILL stops it at once, losing the steps since its last checkpoint)\n"
                        .encode())
        self.signum = self.signum or signum

    def agreed(self) -> int:
        """The signal every rank has agreed to stop on, 0 for none (a collective under torchrun)."""
        if self.world == 1:
            return self.signum
        agreed = 0
        if self._pending is not None:
            self._pending.wait()
            agreed = int(self._vote.item())
        self._vote = torch.tensor([self.signum], dtype=torch.int64)
        self._pending = dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def __exit__(self, *exc_info) -> None:
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.wait()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def error_line(exc: Exception, run: RunDirectory | None, resuming: bool) -> str:
    """The line a run ends with when it refuses its input (the refusal as it is) or meets a filesystem error (the
    policy of every tool, fileio.filesystem_error_line, then what the run leaves: `run` is its directory once it
    has one)."""
    if not isinstance(exc, OSError):
        return str(exc)
    line = filesystem_error_line(exc, "--run-dir/--run-name (a resumed run goes on in the directory they name)"
                                 if resuming else "--run-dir")
    if not run:
        return line
    run_dir = run.path
    if run_holds_checkpoint(run_dir):
        return (f"{line}; the run stopped: its checkpoints in {run_dir / 'checkpoints'} are intact (latest.pt the "
                f"newest); once fixed, continue with --resume {run_dir}")
    return f"{line}; the run stopped before it wrote a checkpoint"
