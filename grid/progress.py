"""Where a grid stands: each run's state (from `grid.jsonl`) and its last logged step, loss, throughput and ETA
(from the tail of its log.jsonl), as one table: redrawn in place on a terminal, plain lines otherwise, and printed
once by `python -m grid status DIR` (docs/grid.md#progress)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from run.log import finished, format_duration, log_record_problem

TAIL_BYTES = 16384  # enough for the last few records of any log.jsonl
HEADER = ("run", "state", "step", "loss", "tok/s", "ETA", "device")


def tail_records(path: Path, size: int = TAIL_BYTES) -> list[dict]:
    """The complete records in the last `size` bytes of a run's log.jsonl (a long log is not read whole); a line
    that is no record (run.log.log_record_problem: damaged, or cut) is passed over."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            start = max(0, f.tell() - size)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first line read may be cut
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if log_record_problem(record) is None:
            records.append(record)
    return records


def run_finished(path: Path, steps: int, stop_at_target: bool = False) -> bool:
    """Whether the run in `path` completed: its log ends with the summary record at --steps (or at its target,
    when it stops there)."""
    records = tail_records(path / "log.jsonl", 4096)
    return finished(records[-1] if records else {}, steps, stop_at_target)


def progress_row(run: dict, state: dict) -> list[str]:
    """One table row from a planned run ({"name", "path", "steps", "batch_tokens"}) and its last grid.jsonl
    record: the last training record of its log gives step, loss, tokens/s and, while it runs, the ETA."""
    records = tail_records(Path(run["path"]) / "log.jsonl")
    train = next((r for r in reversed(records) if r.get("train_loss") is not None), {})
    step = train.get("step", 0)
    speed = train.get("tokens_per_s")
    status = state.get("state", "queued")
    eta = "-"
    if status == "running" and speed:
        eta = format_duration(max(run["steps"] - step, 0) * run["batch_tokens"] / speed)
    return [run["name"], status, f"{step}/{run['steps']}", f"{train['train_loss']:.4f}" if train else "-",
            f"{speed:,.0f}" if speed else "-", eta, state.get("placement", "-")]


def progress_table(rows: list[list[str]]) -> list[str]:
    """Rows as aligned text lines under HEADER."""
    widths = [max(len(str(row[i])) for row in [list(HEADER), *rows]) for i in range(len(HEADER))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [list(HEADER), *rows]]


def summary_line(name: str, states: list[str], started: float | None = None) -> str:
    counts = {s: states.count(s) for s in dict.fromkeys(states)}
    parts = ", ".join(f"{n} {s}" for s, n in counts.items())
    elapsed = f" | {format_duration(time.time() - started)}" if started else ""
    return f"grid {name}: {len(states)} runs: {parts}{elapsed}"


class Display:
    """Transitions as lines, and the table: redrawn in place below them on a terminal, printed as plain lines
    every `plain_every` seconds otherwise (logs stay readable)."""

    def __init__(self, stream: TextIO = sys.stdout, live: bool | None = None, plain_every: float = 60.0) -> None:
        self.stream = stream
        self.live = stream.isatty() if live is None else live
        self.plain_every = plain_every
        self.lines: list[str] = []
        self.drawn = 0
        self.last_plain = time.monotonic()

    def _clear(self) -> None:
        if self.drawn:
            self.stream.write(f"\x1b[{self.drawn}F\x1b[J")  # up to the table's first line, clear to the end
            self.drawn = 0

    def _draw(self) -> None:
        self.stream.write("\n".join(self.lines) + "\n")
        self.drawn = len(self.lines)

    def event(self, line: str) -> None:
        """Print a transition (on a terminal, above the table)."""
        self._clear()
        self.stream.write(line + "\n")
        if self.live and self.lines:
            self._draw()
        self.stream.flush()

    def refresh(self, lines: list[str], force: bool = False) -> None:
        """Show the table `lines`: redrawn on a terminal; otherwise printed when `force` or every plain_every s."""
        self.lines = lines
        if self.live:
            self._clear()
            self._draw()
        elif force or time.monotonic() - self.last_plain >= self.plain_every:
            self.stream.write("\n".join(lines) + "\n")
            self.last_plain = time.monotonic()
        self.stream.flush()
