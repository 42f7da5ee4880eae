"""Shared test setup: the repository root on sys.path and the `cuda` marker's skip rule."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def patch_triton_interpreter() -> None:
    """For a TRITON_INTERPRET=1 process: Triton <= 3.6's interpreter converts (1,)-shaped scalars with int(), an
    error since NumPy 2.4 (triton-lang/triton#9171, fixed upstream by #9172); apply the upstream fix."""
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def run_in_interpreter(test_file: str, out_dir: Path, timeout: int) -> dict:
    """Run `python test_file RESULT.json` with TRITON_INTERPRET=1 (kernels on the CPU; the variable must not leak
    into other tests, so it gets its own process) and return the JSON it writes."""
    path = out_dir / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, test_file, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0 and path.exists(), f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(path.read_text())


def interpreter_results(test_file: str, tmp_path_factory: pytest.TempPathFactory, timeout: int = 900) -> dict:
    """`run_in_interpreter` for a test module's fixture: its JSON, failing with the subprocess's traceback if any."""
    data = run_in_interpreter(test_file, tmp_path_factory.mktemp(Path(test_file).stem), timeout=timeout)
    assert "traceback" not in data, data["traceback"]
    return data


def write_interpreter_results(path: str, **checks) -> None:
    """The TRITON_INTERPRET=1 subprocess's side: run each check (a function returning a JSON-able dict) and write
    {name: result}, or {"traceback": ...} if one raises. One torch thread: the checks' products are tiny, and with
    several threads each waits for cores the interpreter keeps busy."""
    import traceback

    patch_triton_interpreter()
    torch.set_num_threads(1)
    try:
        results = {name: check() for name, check in checks.items()}
    except Exception:
        results = {"traceback": traceback.format_exc()}
    Path(path).write_text(json.dumps(results))


def train_tiny_run(root: Path, *flags: str) -> Path:
    """Train a tiny model (2 layers, width 32, vocabulary 64) for 4 CPU steps on a random shard written under `root`
    and return its run directory `root/tiny`; `flags` add to or override the trainer's flags."""
    import numpy as np

    import train_gpt
    from data.shards import write_shard

    shard = root / "tiny_val_000000.bin"
    write_shard(shard, np.random.default_rng(0).integers(0, 64, 2048))
    train_gpt.main(["--train-files", str(shard), "--val-files", str(shard), "--vocab-size", "64",
                    "--block-size", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32",
                    "--batch-tokens", "64", "--micro-batch", "2", "--steps", "4", "--val-every", "0",
                    "--val-tokens", "64", "--run-dir", str(root), "--run-name", "tiny", "--device", "cpu",
                    "--no-compile", "--lr", "1e-2", *flags])
    return root / "tiny"
