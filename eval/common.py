"""What every evaluation CLI shares: `--checkpoint PATH` (alias `--run`: a run directory, a checkpoint file or an
exported directory), model loading, output files keyed by checkpoint, intervals (figures: eval.figures).

Outputs go to `<run>/eval/` (override with `--out`); a checkpoint outside a run directory writes next to itself, an
exported directory (`python -m export to-hf`, read as a step-0 checkpoint of its model) into its own eval/.
Every evaluation records what it wrote and from which checkpoint (path, step, sha256 of the file) in
`<out>/manifest.json` with `record_outputs`; `eval.report` reruns an evaluation whose record is missing or names
another checkpoint (`stale_reason`). See docs/evaluation.md#outputs-and-reports.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from pathlib import Path

import torch

import export
import train_gpt
from cli import MODEL_HELP, add_model_flag
from config import config_from_dict
from data.lookup import resolve_data_files
from fileio import atomic_write, make_directory, sha256_file
from run.checkpoint import CheckpointError, non_finite_weights, run_dir_of
from run.process import resolve_device

EVAL_DIRNAME = "eval"
MANIFEST = "manifest.json"


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


def checkpoint_identity(path: Path, step: int | None) -> dict:
    """{"path", "step", "sha256"} of a checkpoint file: what an evaluation output was computed from.

    The sha256 covers the whole file and is computed once per process for a given file version (path, size,
    modification time, inode), so `eval.report` hashes a 1.5 GB checkpoint once however many evaluations it runs.
    """
    stat = path.stat()
    return {"path": str(path), "step": step,
            "sha256": _sha256_of_version(str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)}


@functools.lru_cache(maxsize=64)
def _sha256_of_version(path: str, size: int, mtime_ns: int, inode: int) -> str:
    return sha256_file(path)


def read_manifest(out: Path) -> dict:
    """`<out>/manifest.json`: {"outputs": {evaluation: {"checkpoint": identity, "files": [names]}}}."""
    path = Path(out) / MANIFEST
    if not path.is_file():
        return {"outputs": {}}
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); delete it and the evaluations rerun") from exc
    manifest.setdefault("outputs", {})
    return manifest


def record_outputs(out: Path, name: str, identity: dict, files: list[str]) -> None:
    """Record that evaluation `name` wrote `files` (names inside `out`) from the checkpoint `identity`. Call it
    last, after every file is written: an evaluation that fails midway leaves no record of the new checkpoint."""
    missing = [f for f in files if not (Path(out) / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{name}: declared outputs not written in {out}: {', '.join(missing)}")
    manifest = read_manifest(out)
    manifest["outputs"][name] = {"checkpoint": identity, "files": list(files)}
    write_json(Path(out) / MANIFEST, manifest)


def annotate_output(out: Path, name: str, **fields: object) -> None:
    """Add `fields` to evaluation `name`'s record in `<out>/manifest.json` (e.g. the budget eval.report used)."""
    manifest = read_manifest(out)
    manifest["outputs"][name].update(fields)
    write_json(Path(out) / MANIFEST, manifest)


def stale_reason(out: Path, name: str, identity: dict) -> str | None:
    """Why evaluation `name`'s outputs in `out` cannot stand for the checkpoint `identity` (None if they can)."""
    entry = read_manifest(out)["outputs"].get(name)
    if entry is None:
        return "not computed"
    recorded = entry["checkpoint"]
    if recorded.get("sha256") != identity["sha256"]:
        return (f"computed from step {recorded.get('step')} ({recorded.get('path')}, sha256 "
                f"{str(recorded.get('sha256'))[:12]}), not step {identity['step']} (sha256 {identity['sha256'][:12]})")
    missing = [f for f in entry["files"] if not (Path(out) / f).is_file()]
    return f"missing {', '.join(missing)}" if missing else None


def validation_files(config: dict) -> str:
    """The run's validation shard glob (config "train" section; empty means the trainer's default data)."""
    hp = run_hyperparameters(config)
    return resolve_data_files(hp.train_files, hp.val_files)[1]


def run_hyperparameters(config: dict) -> train_gpt.TrainConfig:
    """The run's TrainConfig (config "train" section over the trainer's defaults)."""
    return config_from_dict(config.get("train", {}), train_gpt.TrainConfig)


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
    """config.json of a run ({"model", "train", "optim", "layout"}); {} if absent; a one-line error naming the file
    when it is not a JSON object."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = f"not valid JSON ({exc.msg if isinstance(exc, json.JSONDecodeError) else exc.reason})"
    else:
        if isinstance(config, dict):
            return config
        problem = f"holds a JSON {type(config).__name__}, not a run's configuration"
    raise SystemExit(f"error: {path}: {problem}; it is damaged: restore it, or move it away (every checkpoint of the "
                     "run holds its configuration too)")


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sensible at 0% and 100%, unlike the normal one).

    (2k + z² ∓ z·√(z² + 4k(n−k)/n)) / (2(n + z²)) for k successes in n trials. The bounds are exact at the
    edges (0 at k = 0, 1 at k = n) and always bracket k/n (rounding could otherwise put the lower bound a hair
    above 0 at k = 0); (nan, nan) for n = 0.
    """
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = 2 * successes + z * z
    spread = z * math.sqrt(z * z + 4 * successes * (n - successes) / n)
    denominator = 2 * (n + z * z)
    low = 0.0 if successes == 0 else min((centre - spread) / denominator, p)
    high = 1.0 if successes == n else max((centre + spread) / denominator, p)
    return (low, high)


def error_bars(values: list[float], intervals: list[tuple[float, float]]) -> list[list[float]]:
    """matplotlib's `yerr` ([below], [above]) for `values` with (low, high) intervals: never negative (a bound on
    the wrong side of its value, or nan, gives a zero-length bar)."""
    def length(a: float, b: float) -> float:
        return b - a if b - a > 0 else 0.0
    return [[length(lo, v) for v, (lo, _) in zip(values, intervals)],
            [length(v, hi) for v, (_, hi) in zip(values, intervals)]]


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
