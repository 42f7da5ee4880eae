"""ECD, SOAP, Muon and SGDM (from its random initial velocity) inside train_gpt: resume reproduces the trajectory,
and ECD under torchrun (2 gloo ranks, no DDP: the optimizer reduces its own gradients) matches one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train_gpt
from data.shards import write_shard
from tests.helpers import resume_in_new_directory

ROOT = Path(__file__).resolve().parents[1]
FLAGS = {"ecd": {"lr": 0.5, "ecd-f0": 0.0}, "soap": {"lr": 3e-3}, "muon": {"lr": 3e-3, "muon-lr": 0.01},
         "sgdm": {"lr": 0.03, "initial-velocity-std": 0.1}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    write_shard(root / "syn_val_000000.bin", rng.integers(0, 64, 4096).astype(np.uint16))
    write_shard(root / "syn_train_000001.bin", rng.integers(0, 64, 40000).astype(np.uint16))
    return root


def args(corpus: Path, run_dir: Path, name: str, optimizer: str, **overrides) -> list[str]:
    values = {
        "train-files": str(corpus / "syn_train_*.bin"), "val-files": str(corpus / "syn_val_*.bin"),
        "vocab-size": 64, "block-size": 16, "n-layer": 2, "n-head": 2, "n-embd": 16, "seq-len": 16,
        "micro-batch": 4, "batch-tokens": 128, "steps": 6, "val-every": 0, "val-tokens": 512, "log-every": 1,
        "device": "cpu", "run-dir": str(run_dir), "run-name": name, "optimizer": optimizer, **FLAGS[optimizer],
    }
    values.update(overrides)
    return [(f"--{k}" if v else f"--no-{k}") if isinstance(v, bool) else f"--{k}={v}" for k, v in values.items()]


def train_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["train_loss"] for r in records if "train_loss" in r}


@pytest.mark.parametrize("optimizer", ["ecd", "soap", "muon", "sgdm"])
def test_resume_reproduces_the_trajectory(corpus, tmp_path, optimizer):
    train_gpt.main(args(corpus, tmp_path, "straight", optimizer, **{"lr-schedule": "cosine", "warmup-steps": 2}))
    train_gpt.main(args(corpus, tmp_path, "halves", optimizer, **{"lr-schedule": "cosine", "warmup-steps": 2,
                                                                   "checkpoint-every": 3, "keep-checkpoints": -1}))
    resumed = resume_in_new_directory(tmp_path / "halves/checkpoints/step_000003.pt", tmp_path / "resumed")
    straight, again = train_losses(tmp_path / "straight"), train_losses(resumed)
    assert sorted(again) == [4, 5, 6]
    assert len(set(straight.values())) == 6  # the run moves
    for step, loss in again.items():
        assert loss == straight[step], (step, loss, straight[step])


@pytest.mark.serial
def test_ecd_two_gloo_ranks_match_one_process(corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    one = args(corpus, tmp_path, "one", "ecd", steps=4, **{"ecd-nu": 0.1})
    two = args(corpus, tmp_path, "two", "ecd", steps=4, **{"ecd-nu": 0.1})
    subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), *one], check=True, env=env, capture_output=True)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(ROOT / "train_gpt.py"), *two], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    single, double = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(single) == sorted(double) == [1, 2, 3, 4]
    for step in single:
        assert double[step] == pytest.approx(single[step], rel=1e-5)
