"""Run directories and checkpoints: one API for the trainer, eval/, export, sample and bench/ (docs/runs.md).

    <run>/config.json   what ran: flags, batch layout, data record, preset report
    <run>/log.txt       the trainer's code (once), then every printed line;   <run>/log.jsonl   one record per log step
    <run>/code/         the source as it ran;   <run>/checkpoints/latest.pt (and step_XXXXXX.pt)
    <run>/.lock         held by the trainer that owns the run while it runs

A checkpoint is a torch.save'd dict in format CHECKPOINT_FORMAT with a sha256 of its tensors; writes are atomic
(data.shards.atomic_writer). Importing this module has no side effects.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cli import option
from data.shards import atomic_writer, dead_temporaries
from optim.distributed import init_process_group

REPO_ROOT = Path(__file__).resolve().parent
CHECKPOINT_FORMAT = "symgpt-checkpoint-v1"
CODE_PACKAGES = ("", "kernels", "optim", "gauge", "data")  # what <run>/code keeps


class CheckpointError(ValueError):
    """A checkpoint path that is missing, unreadable or damaged; `reason` says what is wrong with the file, without
    the advice of the message."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class RunInUseError(RuntimeError):
    """Another live trainer owns the run directory."""


# ---------------------------------------------------------------------------------------------------------------
# Where a process trains


def world_size_from_env() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def batch_layout(hp, world: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) of each rank: the largest micro-batch <= --micro-batch that splits the rank's
    share of the global batch evenly, and the number of micro-steps it takes. Raises ValueError (naming the flags
    and a fix) when the batch does not split over the ranks."""
    if hp.batch_tokens % hp.seq_len:
        raise ValueError(f"--batch-tokens {hp.batch_tokens} must be a multiple of --seq-len {hp.seq_len}")
    sequences = hp.batch_tokens // hp.seq_len
    if sequences % world:
        raise ValueError(
            f"--batch-tokens {hp.batch_tokens} is {sequences} sequences of --seq-len {hp.seq_len}, which do not split "
            f"over {world} processes: set --batch-tokens to a multiple of {hp.seq_len} x {world} = "
            f"{hp.seq_len * world}, e.g. {hp.seq_len * world * max(1, round(sequences / world))}")
    per_rank = sequences // world
    micro = max(m for m in range(1, min(hp.micro_batch, per_rank) + 1) if per_rank % m == 0)
    return micro, per_rank // micro


@dataclass
class Runtime:
    """Where this process trains: its rank among `world`, its device and autocast dtype, and the per-rank batch
    layout (micro_batch sequences per pass, grad_accum passes per step; see batch_layout)."""

    rank: int
    world: int
    device: torch.device
    micro_batch: int
    grad_accum: int
    autocast_dtype: torch.dtype | None

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else \
            contextlib.nullcontext()

    @property
    def dtype_name(self) -> str:
        """The precision the model computes in: bf16 (autocast) or fp32 (a CPU run, whatever --dtype says)."""
        return "bf16" if self.autocast_dtype == torch.bfloat16 else "fp32"

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def setup(hp) -> Runtime:
    """Process group (torchrun sets RANK/WORLD_SIZE/LOCAL_RANK), device, autocast and the per-rank batch layout of
    the training flags `hp` (train_gpt.TrainConfig)."""
    world = world_size_from_env()
    use_cuda = hp.device == "cuda" or (hp.device == "auto" and torch.cuda.is_available())
    micro_batch, grad_accum = batch_layout(hp, world)
    if world > 1:
        init_process_group(backend="nccl" if use_cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    autocast_dtype = torch.bfloat16 if use_cuda and hp.dtype == "bf16" else None
    return Runtime(dist.get_rank() if world > 1 else 0, world, device, micro_batch, grad_accum, autocast_dtype)


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU (datasheet) for MFU; None when unknown or on CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint files


def run_dir_of(checkpoint: str | os.PathLike) -> Path | None:
    """The run directory a checkpoint belongs to (<run>/checkpoints/FILE -> <run>); None for a file elsewhere."""
    parent = Path(checkpoint).absolute().parent
    return parent.parent if parent.name == "checkpoints" else None


def resolve_checkpoint_path(path: str | os.PathLike, flag: str = "--resume") -> Path:
    """A checkpoint file, or a run directory (-> its checkpoints/latest.pt); an error naming the flag and file."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoints" / "latest.pt"
    if not path.is_file():
        raise CheckpointError(f"{flag}: no checkpoint at {path}; a run writes one at its end, every "
                              "--checkpoint-every steps and when it is interrupted (SIGINT/SIGTERM)")
    return path


def tensor_checksum(checkpoint: dict) -> str:
    """sha256 over every tensor of a checkpoint (dicts in key order, lists in order; each tensor's place, dtype,
    shape and bytes), so a flipped bit anywhere in weights or optimizer state changes it. The names a tied weight is
    filled in under on load (see link_tied) do not count, so a loaded checkpoint saved again keeps its checksum."""
    digest = hashlib.sha256()
    aliases = {f"/model/{alias}" for alias in checkpoint.get("tied", {})}

    def walk(node: object, where: str) -> None:
        if where in aliases:
            return
        if isinstance(node, dict):
            for key in sorted(node, key=str):
                walk(node[key], f"{where}/{key}")
        elif isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                walk(item, f"{where}/{i}")
        elif torch.is_tensor(node):
            flat = node.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{where}:{flat.dtype}:{tuple(node.shape)};".encode())
            digest.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")  # the buffer, not a copy

    walk({k: v for k, v in checkpoint.items() if k != "checksum"}, "")
    return digest.hexdigest()


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", mmap: bool = False,
                    verify: bool = False) -> dict:
    """Load and check a checkpoint written by `save_checkpoint` (mmap: tensors are read only when touched; verify:
    recompute the tensors' sha256 and compare it with the stored one). A tied weight stored once (see
    checkpoint_model_state) is filled in under each of its names."""
    try:
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut one has no central directory
            raise ValueError("not a complete torch.save archive: empty, truncated or another kind of file")
        ckpt = torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except Exception as exc:  # torch reports a foreign or truncated file through several types, none naming it
        reason = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint ({reason}); give a file written by train_gpt.py "
                              "(<run>/checkpoints/latest.pt or step_XXXXXX.pt) or its run directory",
                              reason=f"unreadable: {reason}") from exc
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a {CHECKPOINT_FORMAT} checkpoint", reason=f"not {CHECKPOINT_FORMAT}")
    if verify and "checksum" in ckpt and tensor_checksum(ckpt) != ckpt["checksum"]:
        raise CheckpointError(f"{path}: its tensors do not match the checksum written with them (the file was "
                              "damaged after it was written)", reason="its tensors do not match its checksum")
    return link_tied(ckpt)


def step_of(path: Path) -> int:
    """The step in a step checkpoint's name (checkpoints/step_000500.pt -> 500)."""
    return int(re.sub(r"\D", "", path.stem) or 0)


def run_checkpoints(run_dir: Path) -> list[Path]:
    """A run's checkpoints/step_XXXXXX.pt in step order, then latest.pt (if present)."""
    folder = Path(run_dir) / "checkpoints"
    steps = sorted(folder.glob("step_*.pt"), key=step_of)
    latest = folder / "latest.pt"
    return steps + ([latest] if latest.is_file() else [])


def newer_checkpoints(run_dir: Path, step: int) -> list[str]:
    """The checkpoints of a run from later steps than `step`, as "PATH (step N)": step files by their name, and
    latest.pt when it reads (a damaged latest.pt has no step to compare)."""
    newer = []
    for path in run_checkpoints(run_dir):
        if path.name == "latest.pt":
            try:
                later = load_checkpoint(path, mmap=True)["step"]
            except CheckpointError:
                continue
        else:
            later = step_of(path)
        if later > step:
            newer.append(f"{path} (step {later})")
    return newer


def save_run_checkpoint(run_dir: Path, checkpoint: dict, keep: int) -> None:
    """A run's checkpoint: checkpoints/latest.pt and, unless keep is 0, checkpoints/step_XXXXXX.pt of its step;
    then every step file up to this step but the newest `keep` is removed (keep -1: all are kept). Step files of
    later steps (left by an earlier stretch of the run that this one replaces) are not counted."""
    folder = Path(run_dir) / "checkpoints"
    step = checkpoint["step"]
    save_checkpoint([folder / "latest.pt"] + [folder / f"step_{step:06d}.pt"] * bool(keep), checkpoint)
    if keep >= 0:
        earlier = [p for p in run_checkpoints(run_dir) if p.name != "latest.pt" and step_of(p) <= step]
        for path in earlier[:len(earlier) - keep]:
            path.unlink(missing_ok=True)


def resolve_resume(source: str | os.PathLike) -> tuple[Path, list[str]]:
    """The checkpoint `--resume SOURCE` continues from, verified, and notes on what was passed over. A file is
    used as given; a run directory uses checkpoints/latest.pt, or when that is missing or damaged the newest intact
    step_XXXXXX.pt (--keep-checkpoints K). Raises CheckpointError when nothing intact is found."""
    source = Path(source)
    latest = source / "checkpoints" / "latest.pt"
    steps = [p for p in reversed(run_checkpoints(source)) if p != latest] if source.is_dir() else []
    if not steps:
        path = resolve_checkpoint_path(source)
        try:
            load_checkpoint(path, mmap=True, verify=True)
        except CheckpointError as exc:
            if not source.is_dir():
                raise
            raise CheckpointError(f"--resume {source}: {path} is damaged ({exc.reason}) and the run kept no "
                                  "step_XXXXXX.pt to fall back on (--keep-checkpoints K); start a new run") from exc
        return path, []
    passed = [] if latest.is_file() else [f"{latest} (missing)"]
    for path in [latest] * latest.is_file() + steps:
        try:
            load_checkpoint(path, mmap=True, verify=True)
        except CheckpointError as exc:
            passed.append(f"{path} ({exc.reason})")
            continue
        notes = [f"passed over {p}" for p in passed]
        if notes:
            notes.append(f"resuming from {path} instead, the newest intact checkpoint of {source}")
        return path, notes
    raise CheckpointError(f"--resume {source}: no intact checkpoint: {'; '.join(passed)}; start a new run")


def link_tied(ckpt: dict) -> dict:
    """The checkpoint with each tied name of its model (ckpt["tied"], see checkpoint_model_state) pointing at the
    stored tensor; checkpoints that stored every name have no "tied" entry."""
    for alias, name in ckpt.get("tied", {}).items():
        ckpt["model"].setdefault(alias, ckpt["model"][name])
    return ckpt


def checkpoint_model_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state, tied): CPU copies of the model's tensors, each parameter once, and {alias: stored name} for the
    names of a parameter stored under an earlier one (the tied lm_head.weight is transformer.wte.weight: one copy,
    154 MB at 124M parameters, instead of two). Copies, because sharded optimizers make parameters views into
    padded flat buffers that torch.save would write whole."""
    state, tied, first_name = {}, {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first_name:
            tied[name] = first_name[id(tensor)]
            continue
        first_name[id(tensor)] = name
        state[name] = tensor.detach().to("cpu", copy=True)
    return state, tied


def model_checkpoint(model: nn.Module, config: dict, step: int, **training_state) -> dict:
    """A checkpoint of `model` at `step` with its run config (sections of config.RunConfig.to_dict); the trainer adds
    its training state (optimizers, loader, sampler, rng, metrics, hooks); a checkpoint without "optimizers" holds
    model weights only (--init-from takes it, --resume does not)."""
    state, tied = checkpoint_model_state(model)
    return {"format": CHECKPOINT_FORMAT, "step": step, "config": config, "model": state, "tied": tied,
            **training_state}


def save_checkpoint(paths: str | os.PathLike | list, checkpoint: dict) -> None:
    """Write to each of `paths` atomically with the tensors' checksum (computed once): a failure leaves the previous
    checkpoint intact and no temporary file; the error names the file and the free space."""
    checkpoint["checksum"] = tensor_checksum(checkpoint)
    for path in map(Path, paths if isinstance(paths, list) else [paths]):
        _write_checkpoint(path, checkpoint)


def _write_checkpoint(path: Path, checkpoint: dict) -> None:
    try:
        with atomic_writer(path) as f:
            torch.save(checkpoint, f)
    except (OSError, RuntimeError) as exc:
        free = shutil.disk_usage(path.parent).free if path.parent.is_dir() else 0
        os_error = exc if isinstance(exc, OSError) else exc.__context__  # torch wraps the file's own error
        reason = os_error.strerror if isinstance(os_error, OSError) and os_error.strerror else str(exc).strip()
        raise OSError(f"could not write checkpoint {path}: {reason} ({free / 2**20:,.0f} MiB free there); the "
                      "previous checkpoint, if any, is intact") from exc


def load_initial_weights(model: nn.Module, source: str | os.PathLike) -> str:
    """Copy the model weights of a checkpoint (file or run directory) into `model` for --init-from; returns a line
    saying what was adapted: a larger vocabulary keeps its initialisation in the extra rows, positions beyond
    block_size are dropped, and parameters of another bias mode (learned b_q, b_v) are skipped or keep theirs."""
    path = resolve_checkpoint_path(source, flag="--init-from")
    ckpt = load_checkpoint(path, mmap=True)
    saved, cfg = ckpt["config"]["model"], model.config
    for name in ("n_layer", "n_head", "n_embd", "activation"):
        if saved.get(name, getattr(cfg, name)) != getattr(cfg, name):
            raise CheckpointError(f"--init-from {path}: its model has {option(name)} {saved[name]}, this run "
                                  f"{getattr(cfg, name)}; set {option(name)} {saved[name]}")
    if saved["block_size"] < cfg.block_size:
        raise CheckpointError(f"--init-from {path}: its model has --block-size {saved['block_size']}, this run "
                              f"{cfg.block_size}; set --block-size {saved['block_size']} or less")
    notes = [f"initial weights from {path}"]
    if saved["vocab_size"] != cfg.vocab_size:
        notes.append(f"vocabulary {saved['vocab_size']} -> {cfg.vocab_size}"
                     + (" (the extra rows keep their initialisation)" if cfg.vocab_size > saved["vocab_size"] else ""))
    if saved["block_size"] != cfg.block_size:
        notes.append(f"positions {saved['block_size']} -> {cfg.block_size}")
    if saved.get("bias_mode", cfg.bias_mode) != cfg.bias_mode:
        notes.append(f"bias mode {saved['bias_mode']} -> {cfg.bias_mode}")
    state = model.state_dict()  # shares storage with the parameters
    skipped = []
    with torch.no_grad():
        for name, tensor in ckpt["model"].items():
            if name not in state or tensor.shape[1:] != state[name].shape[1:]:
                skipped.append(name)
                continue
            rows = min(tensor.size(0), state[name].size(0))
            state[name][:rows].copy_(tensor[:rows])
    if skipped:
        notes.append(f"not used: {', '.join(skipped)}")
    return " | ".join(notes)


# ---------------------------------------------------------------------------------------------------------------
# Run directories


def read_log(run_dir: str | os.PathLike) -> list[dict]:
    """A run's log.jsonl records (empty if there is none). A torn last line (what a crash or a full disk leaves) is
    skipped with a warning naming the file; a damaged line elsewhere is an error naming the file and line."""
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text(errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                warnings.warn(f"{path}: skipping its last line {number}, which is incomplete (the run was cut off "
                              "while writing it)", stacklevel=2)
                break
            raise ValueError(f"{path}: line {number} is not a JSON record ({exc.msg}); the log is damaged") from exc
    return records


def cut_torn_line(path: Path) -> str:
    """Remove an incomplete last line (no newline: a record a crash or a full disk cut short) from the log `path`,
    so that the records appended after it stay readable; returns the removed text ("" when there was none)."""
    if not path.is_file():
        return ""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return ""
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(keep)
    return data[keep:].decode(errors="replace")


def run_holds_checkpoint(run_dir: Path) -> bool:
    checkpoints = run_dir / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.glob("*.pt"))


def existing_run_problem(run_dir: Path) -> str | None:
    """An error when a new run named --run-name would write into an earlier run's directory (one that holds a
    checkpoint; a directory an earlier run left without any is reused, see RunDirectory.claim) or into a directory
    that holds other files (no run's .lock)."""
    if run_holds_checkpoint(run_dir):
        return (f"--run-name {run_dir.name}: {run_dir} already holds a run; continue it with --resume {run_dir}, or "
                "choose another --run-name")
    if run_dir.is_dir() and not (run_dir / ".lock").exists() and any(run_dir.iterdir()):
        return (f"--run-name {run_dir.name}: {run_dir} exists and holds files that are not a run's; choose another "
                "--run-name or --run-dir")
    return None


class RunDirectory:
    """The directory of the run this process owns (rank 0 only): created or reopened, locked for as long as the
    run lasts (an advisory lock on <run>/.lock that the operating system releases when the process ends, however
    it ends, so a dead owner leaves no stale lock), with the leftovers of earlier crashes cleared."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = None

    @classmethod
    def choose(cls, parent: str, name: str, kind: str, continue_in: Path | None) -> tuple[RunDirectory, str | None]:
        """The resumed run's own directory (continue_in), parent/--run-name, or a fresh parent/TIMESTAMP-kind
        (claimed with an atomic mkdir; -2, -3, ... when taken, with a note saying so)."""
        if continue_in is not None or name:
            return cls(continue_in or Path(parent) / name), None
        stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}"
        Path(parent).mkdir(parents=True, exist_ok=True)
        for n in range(1, 10_000):
            path = Path(parent) / (stem if n == 1 else f"{stem}-{n}")
            try:
                path.mkdir()
            except FileExistsError:
                continue
            note = None if n == 1 else f"run directory {Path(parent) / stem} exists: using {path.name} instead"
            return cls(path), note
        raise RuntimeError(f"no free run directory name {stem}-N under {parent}")

    def claim(self, new_run: bool) -> list[str]:
        """Take the lock (RunInUseError naming the owner when another live process holds it), remove the temporary
        files that writers which no longer run left beside the trainer's files (data.shards.dead_temporaries of the
        directory and checkpoints/), and for a new run in a directory an earlier run left without a checkpoint, move
        that run's files aside. Returns what was done, for the log."""
        self.path.mkdir(parents=True, exist_ok=True)
        if new_run and (problem := existing_run_problem(self.path)):  # another run's, or not a run's at all
            raise RunInUseError(problem)
        handle = open(self.path / ".lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = ""
            for _ in range(40):  # the owner writes its name just after taking the lock: give it a moment
                handle.seek(0)
                owner = handle.read().strip()
                if owner:
                    break
                time.sleep(0.05)
            handle.close()
            owner = owner or "another process"
            raise RunInUseError(f"{self.path} is in use by {owner}: wait for it to finish or stop it, or choose "
                                "another --run-name") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        handle.flush()
        self._lock = handle
        notes = []
        for stale in dead_temporaries(self.path) + dead_temporaries(self.path / "checkpoints"):
            size = stale.stat().st_size
            stale.unlink(missing_ok=True)
            notes.append(f"removed {stale} ({size / 2**20:,.1f} MiB), left by an interrupted write")
        if new_run and (problem := existing_run_problem(self.path)):  # a checkpoint written before we locked
            self.release()
            raise RunInUseError(problem)
        leftovers = [p for p in self.path.iterdir() if p.name != ".lock" and not p.name.startswith("failed-")]
        if new_run and leftovers:
            stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
            while (aside := self.path / (f"failed-{stamp}" + f"-{n}" * (n > 1))).exists():  # two in one second
                n += 1
            aside.mkdir()
            for item in leftovers:
                item.rename(aside / item.name)
            notes.append(f"{self.path} held an earlier run that wrote no checkpoint: its files are kept in "
                         f"{aside.name}/ and this run starts in the directory")
        return notes

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the descriptor releases the lock
            self._lock = None

    def copy_code(self) -> None:
        """<run>/code: the trainer and its modules as they run (a resumed run refreshes it)."""
        for package in CODE_PACKAGES:
            for source in sorted((REPO_ROOT / package).glob("*.py")):
                target = self.path / "code" / package / source.name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)

    def write_json(self, name: str, obj: object) -> None:
        with atomic_writer(self.path / name) as f:
            f.write(json.dumps(obj, indent=2).encode())


# ---------------------------------------------------------------------------------------------------------------
# What a run reports


def module_available(name: str) -> bool:
    """Whether `import name` can succeed, without importing it."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


class WandbTracker:
    """Weights & Biases for a run (--wandb-project; master rank only): the config once, at the start, then the
    numbers of every log.jsonl record at its step, and the final summary. wandb is imported only here. The W&B run
    id is kept in <run>/wandb_run_id.txt, so a run resumed in its directory goes on in the same W&B run."""

    def __init__(self, project: str, run_name: str, run_dir: Path, config: dict) -> None:
        import wandb  # the config check made sure it is installed

        id_file = run_dir / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(8)
        self.run = wandb.init(project=project, name=run_name or run_dir.name, id=run_id, resume="allow",
                              dir=str(run_dir), config=config)
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

    def __init__(self, log_dir: Path, config: dict, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the config check made sure it is installed

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=step or None)
        self.step = step
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", step)

    def record(self, record: dict) -> None:
        self.step = record.get("step", self.step)
        prefix = "summary/" if record.get("summary") else ""
        for name, value in record_numbers(record).items():
            self.writer.add_scalar(prefix + name, value, self.step)
        self.writer.flush()

    def close(self, exit_code: int = 0) -> None:
        self.writer.close()


def open_trackers(hp, run_dir: Path, config: dict, step: int) -> list:
    """The trackers the flags ask for (--wandb-project, --tensorboard), opened for the run in `run_dir` at `step`."""
    trackers = []
    if hp.wandb_project:
        trackers.append(WandbTracker(hp.wandb_project, hp.wandb_run_name, run_dir, config))
    if hp.tensorboard:
        trackers.append(TensorBoardTracker(Path(hp.tensorboard) / run_dir.name, config, step))
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
        if not self.is_master:
            return
        self.text = open(run_dir / "log.txt", "a")
        torn = cut_torn_line(run_dir / "log.jsonl")
        self.records = open(run_dir / "log.jsonl", "a")
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
            self.text.write(text + "\n")
            self.text.flush()

    def record(self, record: dict) -> None:
        if self.records is not None:
            self.records.write(json.dumps(record) + "\n")
            self.records.flush()
        for tracker in self.trackers:
            tracker.record(record)

    def error(self, exc: BaseException) -> None:
        """Write an error that ends the run to log.txt (it is printed by Python as it propagates); the tracker's
        runs end as failed."""
        if self.text is not None:
            self.text.write("".join(traceback.format_exception(exc)))
            self.text.flush()
        for tracker in self.trackers:
            tracker.close(exit_code=1)
        self.trackers = []

    def close(self) -> None:
        for handle in (self.text, self.records):
            if handle is not None:
                handle.close()
        for tracker in self.trackers:
            tracker.close()
        self.text = self.records = None
        self.trackers = []


def open_run_directory(hp, kind: str, continue_in: Path | None, record: dict, code: str, log: RunLog,
                       rt: Runtime, step: int) -> RunDirectory:
    """The directory of this run on every rank (a collective under torchrun). Rank 0 chooses it (the resumed run's
    own, --run-dir/--run-name, or a new TIMESTAMP-kind), claims it (see RunDirectory.claim), copies the code, writes
    config.json (`record`), opens log.txt (which starts with `code`) and log.jsonl, opens the optional trackers at
    `step` and logs the header; the other ranks get its path. hp: the trainer's TrainConfig."""
    run_dir, refusal = None, None
    if rt.is_master:
        try:
            run_dir, note = RunDirectory.choose(hp.run_dir, hp.run_name, kind, continue_in)
            notes = [note] * bool(note) + run_dir.claim(new_run=continue_in is None)
        except RunInUseError as exc:
            refusal = str(exc)
    box = [run_dir.path if run_dir else None, refusal]
    if dist.is_initialized():
        dist.broadcast_object_list(box)  # every rank names the run in its messages, or exits with rank 0's refusal
    if box[1]:
        raise RunInUseError(box[1])
    if rt.is_master:
        run_dir.copy_code()
        run_dir.write_json("config.json", record)
        log.attach(run_dir.path, code)
        log.trackers = open_trackers(hp, run_dir.path, record, step)
        for line in notes:
            log.line(line)
        gpu = f" ({torch.cuda.get_device_name(rt.device)})" if rt.device.type == "cuda" else ""
        log.line(f"python {sys.version.split()[0]} | torch {torch.__version__} | device {rt.device}{gpu} | "
                 f"{rt.dtype_name} | world {rt.world}")
        log.line(f"run directory {run_dir.path} | code in code/ (train_gpt.py sha256 "
                 f"{hashlib.sha256(code.encode()).hexdigest()[:16]})")
    return run_dir or RunDirectory(box[0])


# Flags changed on --resume in the direction the non-finite stop advises: lower, longer, clipped (or clipped harder).
SAFER_ON_RESUME = {"optim.lr": lambda old, new: new < old, "train.warmup_steps": lambda old, new: new > old,
                   "train.grad_clip": lambda old, new: 0 < new < (old or math.inf)}


def non_finite_stop_message(what: str, step: int, lr: float, checkpoint_step: int | None, resumed: dict | None,
                            run_dir: Path) -> str:
    """The line a run that met a non-finite `what` at `step` stops with: what exists (no checkpoint, the unchanged
    checkpoint it resumed from, or a finite checkpoint of its own) and what to do in each case. A resumed run that
    diverged although it followed the advice (a lower --lr, ...) is told that its checkpoint was already on its way
    and pointed to an earlier step file of that run."""
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


class StopRequest:
    """SIGINT/SIGTERM ask the run to stop; the loop then writes a checkpoint and exits. `agreed()` is called once
    per step on every rank: on one process it returns the signal at once; under torchrun each call starts an
    all-reduce of this rank's signal on a CPU (gloo) group and returns the result of the previous call's, so every
    rank stops at the same step, one step after the signal, without a GPU sync (torchrun kills its workers 30 s
    after forwarding a signal). A second SIGINT interrupts at once."""

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
        self.signum = signum
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

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
