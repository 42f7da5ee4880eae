"""What an evaluation writes and the record of it (docs/evaluation.md#outputs-and-reports): outputs go to
`<run>/eval/` (EVAL_DIRNAME), JSON strict (NaN and infinities written as null), tables as Markdown. Every evaluation
records what it wrote and from which checkpoint (path, step, sha256 of the file) in `<out>/manifest.json` with
`record_outputs`; `eval.report` reruns an evaluation whose record is missing or names another checkpoint
(`stale_reason`).
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from fileio import atomic_write, sha256_file

EVAL_DIRNAME = "eval"
MANIFEST = "manifest.json"


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


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|").replace("\n", "\\n")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
