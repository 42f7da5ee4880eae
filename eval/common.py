"""What every evaluation CLI shares: `--run DIR | --checkpoint FILE`, model loading, output files, plots, intervals.

Outputs go to `<run>/eval/` (override with `--out`); a checkpoint outside a run directory writes next to itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch

import train_gpt
from data.shards import atomic_write

EVAL_DIRNAME = "eval"


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """The flags naming what to evaluate and where to write."""
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--run", type=Path, help="run directory (uses checkpoints/latest.pt)")
    target.add_argument("--checkpoint", type=Path, help="checkpoint file (its run directory gets the outputs)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: <run>/eval)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")


def resolve_target(run: Path | None, checkpoint: Path | None) -> tuple[Path, Path]:
    """(run directory, checkpoint file) from `--run` or `--checkpoint` (train_gpt's rules: a run's checkpoint is
    checkpoints/latest.pt; a checkpoint's run is the directory above checkpoints/, else its own folder)."""
    try:
        if run is not None:
            return Path(run), train_gpt.resolve_checkpoint_path(Path(run) / "checkpoints" / "latest.pt", flag="--run")
        checkpoint = train_gpt.resolve_checkpoint_path(checkpoint, flag="--checkpoint")
    except train_gpt.CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from None
    return train_gpt.run_dir_of(checkpoint) or checkpoint.parent, checkpoint


def output_dir(args: argparse.Namespace, run_dir: Path) -> Path:
    out = args.out if args.out is not None else run_dir / EVAL_DIRNAME
    out.mkdir(parents=True, exist_ok=True)
    return out


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclasses.dataclass
class Target:
    """What an evaluation CLI works on: the run, its checkpoint (loaded), where to write, the device."""

    run_dir: Path
    checkpoint_path: Path
    checkpoint: dict
    out: Path
    device: torch.device


def open_target(args: argparse.Namespace) -> Target:
    """Resolve `--run/--checkpoint`, `--out` and `--device` (see add_target_args) and map the checkpoint (mmap: the
    optimizer state, which these evaluations never touch, is not read)."""
    run_dir, checkpoint_path = resolve_target(args.run, args.checkpoint)
    try:
        checkpoint = train_gpt.load_checkpoint(checkpoint_path, mmap=True)
    except train_gpt.CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from None
    return Target(run_dir, checkpoint_path, checkpoint, output_dir(args, run_dir), resolve_device(args.device))


def load_model(checkpoint: dict, device: torch.device) -> train_gpt.GPT:
    """The checkpoint's model in eval mode on `device` (mean biases at inference, SPEC §1)."""
    return train_gpt.model_from_checkpoint(checkpoint).to(device)


def write_json(path: Path, obj: object) -> None:
    """Write JSON atomically (strict: NaN/inf become null)."""
    atomic_write(path, (json.dumps(_finite(obj), indent=1) + "\n").encode())


def _finite(obj: object) -> object:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def read_config(run_dir: Path) -> dict:
    """config.json of a run ({"model", "train", "optim", "layout"}); {} if absent."""
    path = Path(run_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (selected here, not at import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sensible at 0% and 100%, unlike the normal one)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def mean_interval(values: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """(mean, low, high) with a normal 95% interval of the mean."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan"), float("nan")
    sem = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean, mean - z * sem, mean + z * sem


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|").replace("\n", "\\n")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
