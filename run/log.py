"""What a run reports: log.txt and log.jsonl (written by the master rank, read back by the tools), the optional
trackers (Weights & Biases, TensorBoard) fed the same records, and the lines a run ends with. Importing this module
has no side effects (wandb and tensorboard are imported only when a run asks for them)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shlex
import sys
import traceback
import warnings
from pathlib import Path

from fileio import DamagedFile, doing


NUMBERS = ("step", "tokens", "train_loss", "val_loss", "val_step", "lr", "grad_norm", "step_ms", "tokens_per_s",
           "mfu", "train_time_s", "elapsed_s")  # what the readers of log.jsonl compute with


def log_record_problem(record: object) -> str | None:
    """Why a parsed log.jsonl line is no record its readers can use (not a JSON object, or a number of NUMBERS
    that is none); None when it is one."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not a record"
    bad = next((key for key in NUMBERS if record.get(key) is not None
                and (isinstance(record[key], bool) or not isinstance(record[key], (int, float)))), None)
    return f"a record whose {bad} is {record[bad]!r}, not a number" if bad else None


def read_log(run_dir: str | os.PathLike) -> list[dict]:
    """A run's log.jsonl records (empty if there is none). A torn last line (what a crash or a full disk leaves) is
    skipped with a warning naming the file; a damaged line elsewhere (not JSON, not a record, a number that is none)
    is a DamagedFile error naming the file and line."""
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        return []
    with doing("read", path):
        lines = path.read_text(errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                warnings.warn(f"{path}: skipping its last line {number}, which is incomplete (the run was cut off "
                              "while writing it)", stacklevel=2)
                break
            raise DamagedFile(f"{path}: line {number} is not a JSON record ({exc.msg}); the log is damaged: restore "
                              "it, or remove the line") from exc
        if problem := log_record_problem(record):
            raise DamagedFile(f"{path}: line {number} is {problem}; the log is damaged: restore it, or remove the line")
        records.append(record)
    return records


def finished(last: dict, steps: int | None, stop_at_target: bool = False) -> bool:
    """Whether a run whose log.jsonl ends with the record `last` completed: the summary record at --steps (or at its
    target, when it stops there). The grid, eval.compare and the scorecard count only such runs."""
    return bool(last.get("summary")) and (last.get("step", 0) >= (steps or 0)
                                          or bool(stop_at_target and last.get("reached_target")))


def cut_torn_line(path: Path) -> str:
    """Remove an incomplete last line (no newline: a record a crash or a full disk cut short) from the log `path`,
    so that the records appended after it stay readable; returns the removed text ("" when there was none)."""
    if not path.is_file():
        return ""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return ""
    keep = data.rfind(b"\n") + 1
    os.truncate(path, keep)
    return data[keep:].decode(errors="replace")


def module_available(name: str) -> bool:
    """Whether `import name` can succeed, without importing it."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


class WandbTracker:
    """Weights & Biases for a run (--wandb-project; master rank only): the config once, at the start, then the
    numbers of every log.jsonl record at its step, and the final summary. wandb is imported only here. The W&B run
    id is kept in <run>/wandb_run_id.txt, so a run resumed in its directory goes on in the same W&B run."""

    def __init__(self, project: str, run_name: str, run_dir: Path, config_record: dict) -> None:
        import wandb  # the config check made sure it is installed

        id_file = run_dir / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(8)
        self.run = wandb.init(project=project, name=run_name or run_dir.name, id=run_id, resume="allow",
                              dir=str(run_dir), config=config_record)
        id_file.write_text(run_id + "\n")

    def record(self, record: dict) -> None:
        numbers = record_numbers(record)
        if record.get("summary"):
            self.run.summary.update(numbers)
        elif numbers and "step" in record:
            self.run.log(numbers, step=record["step"])

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


def record_numbers(record: dict) -> dict[str, float]:
    """The numbers of a log.jsonl record that trackers plot: ints and floats, not flags, not the step itself."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class TensorBoardTracker:
    """TensorBoard event files for a run (--tensorboard DIR; master rank only), in DIR/<run directory name> so that
    `tensorboard --logdir DIR` shows runs side by side: the config once, as text, then the numbers of every
    log.jsonl record as scalars at its step, and the final summary's under summary/. A resumed run writes to the
    same folder, and TensorBoard drops the earlier events from its resumed step on (purge_step), so no stretch of
    a curve is doubled. torch.utils.tensorboard (which needs the tensorboard package) is imported only here."""

    def __init__(self, log_dir: Path, config_record: dict, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the config check made sure it is installed

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=step or None)
        self.step = step
        self.writer.add_text("config", "```\n" + json.dumps(config_record, indent=2) + "\n```", step)

    def record(self, record: dict) -> None:
        self.step = record.get("step", self.step)
        prefix = "summary/" if record.get("summary") else ""
        for name, value in record_numbers(record).items():
            self.writer.add_scalar(prefix + name, value, self.step)
        self.writer.flush()

    def close(self, exit_code: int = 0) -> None:
        self.writer.close()


def open_trackers(hp, run_dir: Path, config_record: dict, step: int) -> list:
    """The trackers the flags ask for (--wandb-project, --tensorboard), opened for the run in `run_dir` at `step`."""
    trackers = []
    if hp.wandb_project:
        trackers.append(WandbTracker(hp.wandb_project, hp.wandb_run_name, run_dir, config_record))
    if hp.tensorboard:
        trackers.append(TensorBoardTracker(Path(hp.tensorboard) / run_dir.name, config_record, step))
    return trackers


class RunLog:
    """What the master rank reports: stdout, and once the run directory exists, log.txt (which starts with the
    trainer's code as the run started; a resumed run's code is in code/), log.jsonl and the optional trackers
    (WandbTracker, TensorBoardTracker). Lines printed before the directory exists are written to log.txt when it
    does."""

    def __init__(self, is_master: bool) -> None:
        self.is_master = is_master
        self.text = self.records = None
        self.trackers: list[WandbTracker | TensorBoardTracker] = []
        self.pending: list[str] = []

    def attach(self, run_dir: Path, code: str) -> None:
        with doing("append to", run_dir / "log.txt"):
            self.text = open(run_dir / "log.txt", "a")
        with doing("append to", run_dir / "log.jsonl"):
            torn = cut_torn_line(run_dir / "log.jsonl")
            self.records = open(run_dir / "log.jsonl", "a")
        with doing("append to", self.text.name):
            if self.text.tell() == 0:  # a resumed run's log holds the code already; its own is in code/
                self.text.write(code + "\n")
            self.text.write("=" * 100 + "\n")
            self.text.writelines(line + "\n" for line in self.pending)
            self.text.flush()
        if torn:
            self.line(f"{run_dir / 'log.jsonl'}: removed its incomplete last line, a record the previous run was "
                      f"cut off while writing: {torn}")

    def line(self, text: str) -> None:
        if not self.is_master:
            return
        print(text, flush=True)
        if self.text is None:
            self.pending.append(text)
        else:
            with doing("append to", self.text.name):
                self.text.write(text + "\n")
                self.text.flush()

    def record(self, record: dict) -> None:
        if self.records is not None:
            with doing("append to", self.records.name):
                self.records.write(json.dumps(record) + "\n")
                self.records.flush()
        for tracker in self.trackers:
            tracker.record(record)

    def error(self, exc: BaseException) -> None:
        """Write an error that ends the run to log.txt, where the filesystem still takes it (it is printed by Python
        as it propagates, or in one line); the tracker's runs end as failed."""
        if self.text is not None:
            with contextlib.suppress(OSError):  # a full disk, say: the error is the one being reported
                self.text.write("".join(traceback.format_exception(exc)))
                self.text.flush()
        for tracker in self.trackers:
            tracker.close(exit_code=1)
        self.trackers = []

    def close(self) -> None:
        for handle in (self.text, self.records):
            if handle is not None:
                with contextlib.suppress(OSError):  # what a full disk kept from them was reported as it failed
                    handle.close()
        for tracker in self.trackers:
            tracker.close()
        self.text = self.records = None
        self.trackers = []


def step_line(record: dict, texts: list[str], steps: int) -> str:
    """The printed line of a log step's record (timing.TrainingClock.ready's): step, loss, lr, the gradient norm
    and the hooks' `texts`, speed, MFU, training time and the time left for `steps` at this speed."""
    grad_norm = [f"grad norm {record['grad_norm']:.3f}"] if "grad_norm" in record else []
    eta = (steps - record["step"]) * record["step_ms"] / 1e3
    return " | ".join([f"step {record['step']}/{steps}", f"loss {record['train_loss']:.4f}", f"lr {record['lr']:.2e}",
                       *grad_norm, *texts, f"{record['step_ms']:.2f} ms/step", f"{record['tokens_per_s']:,.0f} tok/s"]
                      + ([f"mfu {100 * record['mfu']:.1f}%"] if record["mfu"] else [])
                      + [f"{record['train_time_s']:.1f}s", f"eta {format_duration(eta)}"])


def done_line(summary: dict, first_val: tuple[int, float] | None, final: bool) -> str:
    """The line a run ends with: steps, the validation loss from the first measured to the last (final runs),
    training time, and the step that reached --target-val-loss."""
    start = f"{first_val[1]:.4f} at step {first_val[0]} -> " if first_val and first_val[0] != summary["step"] else ""
    val = f"val loss {start}{summary['val_loss']:.4f} at step {summary['val_step']}, " if final else ""
    target = summary["reached_target"]
    return (f"done: {summary['step']} steps, {val}{summary['train_time_s']:.1f}s of training"
            + (f", target reached at step {target['step']}" if target else ""))


def next_steps(run_dir: Path) -> str:
    """The lines a finished run ends with: where it is and the three commands a user runs next."""
    run = shlex.quote(str(run_dir))
    return (f"the run is in {run} (log.txt, config.json, checkpoints/latest.pt); next:\n"
            f"  python -m eval.report --run {run}    # the evaluations and a page: {run}/report.md\n"
            f"  python -m sample --run {run} --prompt \"The meaning of\"\n"
            f"  python -m export to-hf --run {run} --out {shlex.quote(str(run_dir / 'hf'))}    # a Hugging Face model")


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
