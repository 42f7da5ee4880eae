"""The checkpoint format (docs/runs.md#checkpoints): writing it atomically with a checksum, reading and verifying it,
the checkpoints of a run and the one --resume continues from, and --init-from's weights.

A checkpoint is a torch.save'd dict in format CHECKPOINT_FORMAT with a sha256 of its tensors; writes are atomic
(fileio.atomic_writer). Importing this module has no side effects.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import zipfile
from pathlib import Path

import torch
from torch import nn

from cli import option
from fileio import atomic_writer

CHECKPOINT_FORMAT = "symgpt-checkpoint-v1"


class CheckpointError(ValueError):
    """A checkpoint path that is missing, unreadable or damaged; `reason` says what is wrong with the file, without
    the advice of the message."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


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
    its training state (optimizers, loader, rng, metrics, hooks); a checkpoint without "optimizers" holds
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
