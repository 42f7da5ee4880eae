"""How the training loop measures itself without making the host wait for the device (docs/runs.md#timing): the
training clock and its delayed log records (`TrainingClock`), and --profile-steps (`ProfileWindow`)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Union

import torch

Mark = Union["torch.cuda.Event", float]


class TrainingClock:
    """The training clock and the log records that wait for the device (docs/runs.md#timing): marks are CUDA events
    on a GPU, time.perf_counter on a CPU; the clock runs from `start` or `resume` to `pause` (which waits for the
    device); `later` holds a record until its scalars reach the host, and `ready` returns it a step later."""

    def __init__(self, device: torch.device, mfu_per_token_s: float | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.mfu_per_token_s = mfu_per_token_s  # MFU of one token per second (None: the device's peak is unknown)
        self.seconds = 0.0  # training time up to `origin`
        self.origin: Mark = self.mark()
        self.pending: tuple | None = None
        self.last: dict = {}  # step, tokens and training time of the last record returned by `ready`

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def at(self, mark: Mark, seconds: float, origin: Mark) -> float:
        """Training time at `mark` (which the device must have passed), `seconds` having passed at `origin`."""
        return seconds + (origin.elapsed_time(mark) / 1000 if self.cuda else mark - origin)

    def start(self, seconds: float, step: int, tokens: int) -> None:
        """Run the clock from `seconds` of training at `step` and `tokens`; the first rates count from there."""
        self.seconds, self.origin = seconds, self.mark()
        self.last = {"step": step, "tokens": tokens, "time": seconds}

    def resume(self) -> None:
        """Run the clock again after a pause, from the work issued after this call."""
        self.origin = self.mark()

    def pause(self) -> float:
        """Stop the clock once the device has caught up; the training time. Write `ready` first."""
        end = self.mark()
        if self.cuda:
            end.synchronize()
        self.seconds, self.origin = self.at(end, self.seconds, self.origin), end
        return self.seconds

    def later(self, record: dict, scalars: list[torch.Tensor]) -> None:
        """Hold `record` (with "step" and "tokens") until `scalars` reach the host."""
        stacked = torch.stack([s.detach().float().reshape(()) for s in scalars])
        host = stacked.to("cpu", non_blocking=True)  # from a GPU: into pinned memory, read once the mark has passed
        self.pending = record, host, self.mark(), self.seconds, self.origin

    def ready(self) -> tuple[dict, list[float]] | None:
        """The held record (None if none) with train_time_s, step_ms, tokens_per_s and mfu since the last one, the
        host's wall_time (Unix seconds), and the scalars as floats; waits for the device only if it has not passed the
        record's mark yet."""
        if self.pending is None:
            return None
        (record, host, mark, *run), self.pending = self.pending, None
        if self.cuda:
            mark.synchronize()
        seconds = self.at(mark, *run)
        elapsed = max(seconds - self.last["time"], 1e-9)
        record.update(train_time_s=seconds, elapsed_s=seconds,
                      step_ms=1e3 * elapsed / max(record["step"] - self.last["step"], 1),
                      tokens_per_s=(record["tokens"] - self.last["tokens"]) / elapsed,
                      wall_time=time.time())  # when its numbers reached the host: runs side by side line up on it
        record["mfu"] = self.mfu_per_token_s * record["tokens_per_s"] if self.mfu_per_token_s else None
        self.last = {"step": record["step"], "tokens": record["tokens"], "time": seconds}
        return record, host.tolist()


def parse_window(spec: str) -> tuple[int, int]:
    """(A, B) of `--profile-steps A:B`; ValueError with the flag's fix when it is malformed."""
    try:
        first, last = (int(part) for part in spec.split(":"))
    except ValueError:
        raise ValueError(f"--profile-steps {spec!r}: write A:B, the steps after step A up to step B, e.g. "
                         "10:12") from None
    if not 0 <= first < last:
        raise ValueError(f"--profile-steps {spec!r}: needs 0 <= A < B (the steps after step A up to step B)")
    return first, last


class ProfileWindow:
    """`--profile-steps A:B`: profiles optimizer steps A+1..B (as the log numbers them) with torch.profiler, writes
    the trace to `<run>/profile_steps_A-B.json` (chrome://tracing, Perfetto) and returns a summary. The loop calls
    `start` before the window's first step, `step_done` after each step and `stop` after its last (or when the run
    ends inside it); `start` and `stop` take seconds and belong outside the training clock."""

    TOP = 10  # entries in the summary

    def __init__(self, spec: str, device: torch.device) -> None:
        self.window = parse_window(spec) if spec else None
        self.cuda = device.type == "cuda"
        self.profiler: torch.profiler.profile | None = None
        self.first = 0  # the step after which the profiler started
        self.host_s: list[float] = []  # host time of each profiled step
        self.wall_start = self.step_start = 0.0  # perf_counter at `start`, and when the last step was done

    def opens_at(self, step: int) -> bool:
        return self.window is not None and self.profiler is None and self.window[0] <= step < self.window[1]

    def closes_at(self, step: int) -> bool:
        return self.profiler is not None and step >= self.window[1]

    def start(self, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()
        self.first, self.host_s = step, []
        self.wall_start = self.step_start = time.perf_counter()

    def step_done(self) -> None:
        """After the host has issued a step: its host time, if the window is open."""
        if self.profiler is not None:
            now = time.perf_counter()
            self.host_s.append(now - self.step_start)
            self.step_start = now

    def stop(self, run_dir: Path | None) -> dict:
        """Stop, write the trace into `run_dir` (None: no trace, e.g. on ranks other than the first) and summarise."""
        if self.cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - self.wall_start
        profiler, self.profiler, self.window = self.profiler, None, None  # one window per run
        profiler.stop()
        steps = max(len(self.host_s), 1)
        summary = {"steps": [self.first + 1, self.first + len(self.host_s)], "wall_ms_per_step": 1e3 * wall_s / steps,
                   "host_ms_per_step": 1e3 * sum(self.host_s) / steps, "device_ms_per_step": None, "trace": None}
        if self.cuda:  # the kernels (and copies) by device time
            entries: dict[str, list[float]] = {}
            for event in profiler.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    entries.setdefault(event.name, []).append(event.time_range.elapsed_us() / 1e3)
            totals = {name: (len(times), sum(times)) for name, times in entries.items()}
            summary["device_ms_per_step"] = sum(ms for _, ms in totals.values()) / steps
        else:  # the operators by host time
            totals = {op.key: (op.count, op.self_cpu_time_total / 1e3) for op in profiler.key_averages()}
        busy = sum(ms for _, ms in totals.values()) or 1.0
        ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:self.TOP]
        summary["top"] = [{"name": name, "calls": calls, "ms_per_step": ms / steps, "share": ms / busy}
                          for name, (calls, ms) in ranked]
        if run_dir is not None:
            trace = run_dir / f"profile_steps_{summary['steps'][0] - 1}-{summary['steps'][1]}.json"
            profiler.export_chrome_trace(str(trace))
            summary["trace"] = trace.name
        return summary


def summary_lines(summary: dict) -> str:
    """The profile summary as log.txt shows it."""
    first, last = summary["steps"]
    device = summary["device_ms_per_step"]
    head = (f"profile of steps {first}-{last}: {summary['wall_ms_per_step']:.2f} ms per step (profiler on), host "
            f"{summary['host_ms_per_step']:.2f} ms issuing it" + (f", device busy {device:.2f} ms" if device is not None
                                                                  else "") + f"; trace {summary['trace']}")
    kind = "kernels by device time" if device is not None else "operators by host time"
    rows = [f"  {row['ms_per_step']:8.3f} ms/step {100 * row['share']:5.1f}% {row['calls']:6d}x  "
            f"{row['name'][:100]}" for row in summary["top"]]
    return "\n".join([head, f"  top {kind}:", *rows])
