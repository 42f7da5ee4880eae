"""ECD, SOAP, Muon and SGDM (from its random initial velocity) inside train_gpt: resume reproduces the trajectory,
and ECD on 2 gloo ranks (no DDP: the optimizer reduces its own gradients) matches one process."""
from __future__ import annotations

from pathlib import Path

import pytest

import train_gpt
from tests.helpers import ranks, resume_in_new_directory, tiny_args, train_losses

FLAGS = {"ecd": {"lr": 0.5, "ecd-f0": 0.0}, "soap": {"lr": 3e-3}, "muon": {"lr": 3e-3, "muon-lr": 0.01},
         "sgdm": {"lr": 0.03, "initial-velocity-std": 0.1}}


def args(corpus: Path, run_dir: Path, name: str, optimizer: str, **overrides) -> list[str]:
    """tests.helpers.tiny_args with a 16-wide model for 6 steps, trained by `optimizer` with its FLAGS."""
    return tiny_args(corpus, run_dir, name, **{"block-size": 16, "n-embd": 16, "seq-len": 16, "batch-tokens": 128,
                                               "steps": 6, "val-every": 0, "val-tokens": 512, "optimizer": optimizer,
                                               **FLAGS[optimizer], **overrides})


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
def test_ecd_two_gloo_ranks_match_one_process(corpus, tmp_path, one_thread):
    train_gpt.main(args(corpus, tmp_path, "one", "ecd", steps=4, **{"ecd-nu": 0.1}))
    result = ranks(args(corpus, tmp_path, "two", "ecd", steps=4, **{"ecd-nu": 0.1}))
    assert result.returncode == 0, result.stderr[-3000:]
    single, double = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(single) == sorted(double) == [1, 2, 3, 4]
    for step in single:
        assert double[step] == pytest.approx(single[step], rel=1e-5)
