"""pyproject.toml builds a real package: a wheel with every module and data file, and an editable install, both
importable from outside the repository (docs/export.md#pip-install). Builds run offline on a copy of the tree."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, repository_modules

pytest.importorskip("setuptools", reason="building the package needs setuptools in this environment")
pytestmark = pytest.mark.slow  # two offline pip builds and two fresh interpreters importing torch: ~20 s on 2 cores
MODULES = repository_modules()  # every one must travel in the wheel and import from it
DATA_FILES = ["kernels/attention_table.json", "eval/suites/logic_fixed.json", "eval/published/arxiv-2601.22257.toml"]
IMPORT_CHECK = (
    "import importlib, sys\n"
    f"mods = [importlib.import_module(m) for m in {MODULES!r}]\n"
    "import eval.logic_puzzles as lp\n"
    "assert lp.FIXED_SUITE.is_file(), lp.FIXED_SUITE\n"
    "importlib.import_module('kernels.attention_paths').read_table()  # the attention table travels with it\n"
    "assert '--top-k' in importlib.import_module('sample').build_parser().format_help()\n"
    "print(sys.modules['train_gpt'].__file__)\n"
)


def pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", "-q"], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the repository without caches, runs, build outputs or virtualenvs (builds write into it)."""
    dest = tmp_path_factory.mktemp("pkg") / "symgpt"
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "__pycache__", "*.egg-info", "build", "cache", "fineweb_edu", ".pytest_cache"))
    return dest


def run_outside(code: str, cwd: Path, sitedir: Path) -> str:
    """Run `code` in a fresh interpreter whose only way to the package is `sitedir` (its .pth files processed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", f"import site; site.addsitedir({str(sitedir)!r})\n{code}"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_wheel_holds_every_module_and_imports_outside_the_repository(source, tmp_path):
    pip("wheel", "-w", str(tmp_path / "dist"), str(source), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("symgpt-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    files = [str((ROOT / module.replace(".", "/")).relative_to(ROOT)) for module in MODULES]
    files = [f"{f}/__init__.py" if (ROOT / f).is_dir() else f"{f}.py" for f in files]
    missing = [f for f in files + DATA_FILES if f not in names]
    assert len(files) > 50 and not missing, missing
    assert not any(n.startswith("tests/") for n in names)
    requirements = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist")]
    assert requirements and not any(r.split(";")[0].strip().startswith("torch") for r in requirements), requirements
    pip("install", "--target", str(tmp_path / "site"), str(wheel), cwd=tmp_path)
    first = run_outside(IMPORT_CHECK, cwd=tmp_path, sitedir=tmp_path / "site")
    assert first.strip() == str(tmp_path / "site" / "train_gpt.py")


def test_editable_install_imports_the_source_from_outside(source, tmp_path):
    pip("install", "-e", str(source), "--target", str(tmp_path / "site"), cwd=tmp_path)
    first = run_outside(IMPORT_CHECK, cwd=tmp_path, sitedir=tmp_path / "site")
    assert first.strip() == str(source / "train_gpt.py")
