"""The training loop end to end on a tiny model and a synthetic corpus made here (CPU, gloo)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt
from eval import report, val_loss
from data.shards import ShardError, write_shard

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128


def synthetic_tokens(num_tokens: int, seed: int) -> np.ndarray:
    """A learnable toy language: a Zipf-distributed stream of 40 fixed random 'words' of 2-5 tokens each."""
    vocabulary = np.random.default_rng(1234)  # the same words in every shard
    words = [vocabulary.integers(1, VOCAB, size=vocabulary.integers(2, 6)) for _ in range(40)]
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, 41)
    picks = rng.choice(40, size=num_tokens // 2, p=weights / weights.sum())
    return np.concatenate([words[i] for i in picks])[:num_tokens].astype(np.uint16)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_shard(root / "syn_val_000000.bin", synthetic_tokens(8192, seed=0))
    write_shard(root / "syn_train_000001.bin", synthetic_tokens(60000, seed=1))
    write_shard(root / "syn_train_000002.bin", synthetic_tokens(60000, seed=2))
    return root


def tiny_args(corpus: Path, run_dir: Path, name: str, **overrides) -> list[str]:
    args = {
        "train-files": str(corpus / "syn_train_*.bin"), "val-files": str(corpus / "syn_val_*.bin"),
        "vocab-size": VOCAB, "block-size": 32, "n-layer": 2, "n-head": 2, "n-embd": 32,
        "seq-len": 32, "micro-batch": 4, "batch-tokens": 256, "steps": 8, "lr": 3e-3,
        "val-every": 4, "val-tokens": 1024, "log-every": 1, "device": "cpu",
        "run-dir": str(run_dir), "run-name": name,
    }
    args.update(overrides)
    return [(f"--{k}" if v else f"--no-{k}") if isinstance(v, bool) else f"--{k}={v}" for k, v in args.items()]


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_log(run_dir) if "train_loss" in r}


def test_loss_falls_and_run_directory_is_complete(corpus, tmp_path):
    summary = train_gpt.main(tiny_args(corpus, tmp_path, "falls", steps=40, **{"val-every": 20}))
    run = tmp_path / "falls"
    vals = [r["val_loss"] for r in read_log(run) if "val_loss" in r and not r.get("summary")]
    assert vals[0] > math.log(VOCAB) - 0.3  # starts near uniform
    assert vals[-1] < vals[0] - 1.0, vals
    assert summary["val_loss"] == vals[-1] and summary["step"] == 40
    reported = report.training_summary(read_log(run))  # the evaluation report reads the same log
    assert reported["elapsed_s"] == summary["train_time_s"] > 0 and reported["final_val_loss"] == vals[-1]
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["n_embd"] == 32 and config["optim"]["optimizer"] == "adamw"
    assert (run / "log.txt").read_text().startswith(Path(train_gpt.__file__).read_text()[:200])
    assert (run / "code" / "train_gpt.py").is_file() and (run / "code" / "data" / "loader.py").is_file()
    ckpt = train_gpt.load_checkpoint(run / "checkpoints" / "latest.pt")
    assert ckpt["step"] == 40 and set(ckpt) >= {"model", "optimizers", "loader", "sampler", "rng", "config"}
    model = train_gpt.model_from_checkpoint(ckpt)
    assert not model.training and model.config.n_embd == 32
    hp = ckpt["config"]["train"]  # eval.val_loss on the final checkpoint gives the trainer's final validation loss
    again = val_loss.validation_loss(model, hp["val_files"], hp["val_tokens"], hp["seq_len"], hp["micro_batch"],
                                     torch.device("cpu"))
    assert again["val_loss"] == vals[-1] and again["tokens"] == hp["val_tokens"] and not model.training


def test_resume_reproduces_the_trajectory(corpus, tmp_path):
    common = {"lr-schedule": "cosine", "warmup-steps": 2}
    train_gpt.main(tiny_args(corpus, tmp_path, "straight", **common))
    train_gpt.main(tiny_args(corpus, tmp_path, "halves", **common, **{"checkpoint-every": 3, "steps": 8},
                             **{"keep-checkpoints": True}))
    halves = tmp_path / "halves"
    straight = train_losses(tmp_path / "straight")
    first = train_losses(halves)
    assert first == straight  # same run, same numbers (deterministic on CPU)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    (resumed_dir / "checkpoints").mkdir()
    (resumed_dir / "checkpoints" / "latest.pt").write_bytes((halves / "checkpoints" / "step_000003.pt").read_bytes())
    train_gpt.main(["--resume", str(resumed_dir)])
    resumed = train_losses(resumed_dir)
    assert sorted(resumed) == [4, 5, 6, 7, 8]
    for step, loss in resumed.items():
        assert loss == straight[step], (step, loss, straight[step])


def test_two_gloo_processes_match_one(corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    common = {"steps": 5, "val-every": 0}
    one = tiny_args(corpus, tmp_path, "one", **common)
    two = tiny_args(corpus, tmp_path, "two", **common)
    subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), *one], check=True, env=env, capture_output=True)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "train_gpt.py"), *two], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grad accumulation 1" in (tmp_path / "two" / "log.txt").read_text()
    assert "grad accumulation 2" in (tmp_path / "one" / "log.txt").read_text()
    single, double = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(single) == sorted(double) == [1, 2, 3, 4, 5]
    for step in single:
        assert double[step] == pytest.approx(single[step], rel=1e-5, abs=1e-6)
    vals = [r["val_loss"] for r in read_log(tmp_path / "one") if "val_loss" in r]
    vals2 = [r["val_loss"] for r in read_log(tmp_path / "two") if "val_loss" in r]
    assert vals2[-1] == pytest.approx(vals[-1], rel=1e-5)


def test_target_val_loss_is_reported_and_can_stop_the_run(corpus, tmp_path):
    summary = train_gpt.main(tiny_args(corpus, tmp_path, "target", steps=40, **{
        "val-every": 4, "target-val-loss": 4.5, "stop-at-target": True}))
    reached = summary["reached_target"]
    assert reached is not None and reached["val_loss"] <= 4.5
    assert summary["step"] == reached["step"] < 40


def test_nan_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path):
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.main(tiny_args(corpus, tmp_path, "nan", lr=1e20, **{"checkpoint-every": 1, "val-every": 0}))
    assert excinfo.value.code == 2
    ckpt = train_gpt.load_checkpoint(tmp_path / "nan" / "checkpoints" / "latest.pt")
    assert ckpt["step"] >= 1
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert "training loss is" in (tmp_path / "nan" / "log.txt").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--n-embd", "30", "--n-head", "4"], "--n-embd 30 must be divisible by --n-head 4"),
    (["--optimizer", "adam"], "invalid choice: 'adam'"),
    (["--steps", "ten"], "--steps expects int, got 'ten'"),
    (["--batch-tokens", "1000"], "--batch-tokens 1000 must be a multiple of --micro-batch x --seq-len = 4096"),
    (["--seq-len", "1024"], "--seq-len 1024 exceeds --block-size 512"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--bias-mode", "bk"], "invalid choice: 'bk'"),
    (["--optimizer", "muon", "--dynamics-every", "10"], "muon has none (set --dynamics-every 0)"),
])
def test_bad_cli_values_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.parse_config(argv)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_of_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*latest.pt"):
        train_gpt.parse_config(["--resume", str(tmp_path)])


def test_corrupt_shard_names_the_file(corpus, tmp_path):
    bad = tmp_path / "bad_train_000001.bin"
    bad.write_bytes(np.full(256, 7, dtype="<i4").tobytes() + b"\0" * 64)
    with pytest.raises(ShardError, match=r"bad_train_000001\.bin: bad magic 7"):
        train_gpt.main(tiny_args(corpus, tmp_path, "corrupt", **{"train-files": str(bad)}))


def test_presets_compose_with_flags():
    model, hp, opt, preset = train_gpt.parse_config(["--preset", "smoke", "--n-layer", "3", "--optimizer", "sgdm"])
    assert preset == "smoke" and model.n_layer == 3 and model.n_embd == 128 and opt.optimizer == "sgdm"
    assert hp.steps == train_gpt.PRESETS["smoke"]["steps"]


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--help"])
    text = capsys.readouterr().out
    for cls in train_gpt.CONFIG_CLASSES.values():
        helps = train_gpt._field_help(cls)
        for f in cls.__dataclass_fields__:
            assert "--" + f.replace("_", "-") in text
            assert f in helps, f"{cls.__name__}.{f} has no help comment"
    for name, spec in train_gpt.OPTIMIZERS.items():
        assert f"[{name}] {spec.description}." in " ".join(text.split())


def test_val_files_flag_names_the_validation_shards_whatever_the_training_data(monkeypatch):
    from data import fineweb_edu

    monkeypatch.setattr(fineweb_edu, "fineweb_shards_present", lambda: True)
    hp = train_gpt.Hyperparameters
    assert train_gpt.resolve_data_files(hp(val_files="v_*.bin"), True) == (fineweb_edu.DEFAULT_TRAIN_PATTERN,
                                                                           "v_*.bin")
    assert train_gpt.resolve_data_files(hp(), True) == (fineweb_edu.DEFAULT_TRAIN_PATTERN,
                                                        fineweb_edu.DEFAULT_VAL_PATTERN)
    assert train_gpt.resolve_data_files(hp(train_files="t_*.bin"), True) == ("t_*.bin", "t_*.bin")
    assert train_gpt.resolve_data_files(hp(train_files="t_*.bin", val_files="v_*.bin"), True) == ("t_*.bin",
                                                                                                   "v_*.bin")


def test_lr_schedules():
    hp = train_gpt.Hyperparameters(steps=100, warmup_steps=10, lr_schedule="cosine", min_lr_frac=0.1)
    assert train_gpt.lr_factor(0, hp) == pytest.approx(0.1)
    assert train_gpt.lr_factor(10, hp) == pytest.approx(1.0)
    assert train_gpt.lr_factor(55, hp) == pytest.approx(0.55)
    assert train_gpt.lr_factor(100, hp) == pytest.approx(0.1)
    linear = train_gpt.Hyperparameters(steps=100, lr_schedule="linear", cooldown_frac=0.2)
    assert train_gpt.lr_factor(79, linear) == 1.0
    assert train_gpt.lr_factor(90, linear) == pytest.approx(0.5)
    assert train_gpt.lr_factor(50, train_gpt.Hyperparameters()) == 1.0


@pytest.mark.parametrize("optimizer", ["adamw", "sgdm"])
def test_online_dynamics_are_logged(corpus, tmp_path, optimizer):
    train_gpt.main(tiny_args(corpus, tmp_path, optimizer, steps=4, optimizer=optimizer,
                             **{"dynamics-every": 2, "val-every": 0}))
    records = [r for r in read_log(tmp_path / optimizer) if "train_loss" in r]
    with_dynamics = [r["step"] for r in records if "J_QK" in r]
    assert with_dynamics == [2, 4]
    for r in records:
        if "J_QK" in r:
            assert r["J_QK"] > 0 and 0 <= r["f_rot_QK"] <= 1 + 1e-6 and math.isfinite(r["J_VO"])


def test_checkpoint_of_a_sharded_optimizer_stores_each_tensor_once(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "ecd", steps=2, optimizer="ecd", lr=0.5, **{"val-every": 0}))
    ckpt = train_gpt.load_checkpoint(tmp_path / "ecd" / "checkpoints" / "latest.pt")
    for name, tensor in ckpt["model"].items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
    assert "pi" in next(iter(ckpt["optimizers"][0]["state"].values()))


def test_batch_that_does_not_split_over_ranks_names_the_fix(corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = tiny_args(corpus, tmp_path, "split", **{"batch-tokens": 128})  # one micro-batch, two ranks
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "train_gpt.py"), *args], env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "--micro-batch 2 keeps the global batch" in result.stderr + result.stdout
