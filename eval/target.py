"""What an evaluation command works on: the flags that name it (`--checkpoint PATH`, alias `--run`: a run directory,
a checkpoint file or an exported directory; `--out`; `--device`) and the checkpoint they name, loaded.

Outputs go to `<run>/eval/` (override with `--out`); a checkpoint outside a run directory writes next to itself, an
exported directory (`python -m export to-hf`, read as a step-0 checkpoint of its model) into its own eval/ (what is
written there and its record: eval.outputs).
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

import export
from cli import MODEL_HELP, add_model_flag
from eval.outputs import EVAL_DIRNAME, checkpoint_identity
from fileio import make_directory
from run.checkpoint import CheckpointError, non_finite_weights, run_dir_of
from run.process import resolve_device


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """The flags naming what to evaluate and where to write."""
    add_model_flag(parser, MODEL_HELP + " (a run directory: eval.dynamics and eval.structure read every checkpoint "
                                        "of the run, the others its latest.pt)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: <run>/eval)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")


def resolve_target(source: str | Path) -> tuple[Path, Path, bool]:
    """(run directory, model file, whether `source` is a run directory) for a --checkpoint value: a run directory
    and its checkpoints/latest.pt; a checkpoint file and its run (the directory above checkpoints/, else its own
    folder); an exported directory as its own run, with its model.safetensors."""
    try:
        file = export.model_file(source)
    except CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from None
    if export.is_exported(file):
        return file.parent, file, False
    if Path(source).is_dir():
        return Path(source), file, True
    return run_dir_of(file) or file.parent, file, False


def load_target_checkpoint(file: Path) -> dict:
    """The checkpoint of a model file from resolve_target (an exported model as a step-0 checkpoint); an error
    naming the file when it cannot be read, or when its weights hold NaN or infinite values (a diverged run, whose
    evaluation would be NaN: docs/evaluation.md#outputs-and-reports)."""
    try:
        checkpoint = export.load_as_checkpoint(file)
    except (CheckpointError, export.ExportError) as exc:
        raise SystemExit(f"error: {exc}") from None
    if problem := non_finite_weights(checkpoint["model"]):
        raise SystemExit(f"error: {file}: {problem}: the run had diverged; evaluate an earlier checkpoint")
    return checkpoint


def output_dir(args: argparse.Namespace, run_dir: Path) -> Path:
    return make_directory(args.out if args.out is not None else run_dir / EVAL_DIRNAME)


@dataclasses.dataclass
class Target:
    """What an evaluation CLI works on: the run, its checkpoint (loaded), where to write, the device."""

    run_dir: Path
    checkpoint_path: Path
    checkpoint: dict
    out: Path
    device: torch.device
    identity: dict


def open_target(args: argparse.Namespace) -> Target:
    """Resolve `--checkpoint`, `--out` and `--device` (see add_target_args) and map the checkpoint (mmap: the
    optimizer state, which these evaluations never touch, is not read)."""
    run_dir, checkpoint_path, _ = resolve_target(args.checkpoint)
    checkpoint = load_target_checkpoint(checkpoint_path)
    return Target(run_dir, checkpoint_path, checkpoint, output_dir(args, run_dir), resolve_device(args.device),
                  checkpoint_identity(checkpoint_path, checkpoint["step"]))
