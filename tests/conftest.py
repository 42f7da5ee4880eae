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
