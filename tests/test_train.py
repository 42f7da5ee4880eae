"""The training loop end to end on a tiny model and a synthetic corpus made here (CPU, gloo): what a run writes,
exact resume, 2 ranks = 1 rank, the batch split, and how runs are protected (bad input, NaN, signals, full disk)."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import config
import train_gpt
from data import lookup
from eval import report, val_loss
from run.checkpoint import CHECKPOINT_FORMAT, load_checkpoint, run_dir_of
from run.log import RunLog, read_log
from run.process import batch_layout, setup_process
from tests.helpers import (ENV, ROOT, VOCAB, PipedLines, held_env, ranks, resume_in_new_directory, stop_held_trainer,
                           tiny_args, train_losses)

pytestmark = pytest.mark.slow  # ~10 s of tiny runs besides its serial tests


def test_loss_falls_and_run_directory_is_complete(corpus, tmp_path):
    summary = train_gpt.main(tiny_args(corpus, tmp_path, "falls", steps=40, **{"val-every": 20}))
    run = tmp_path / "falls"
    vals = [r["val_loss"] for r in read_log(run) if "train_loss" not in r and not r.get("summary")]
    assert vals[0] > math.log(VOCAB) - 0.3  # starts near uniform
    assert vals[-1] < vals[0] - 1.0, vals
    assert summary["val_loss"] == vals[-1] and summary["step"] == 40
    reported = report.training_summary(read_log(run))  # the evaluation report reads the same log
    assert reported["elapsed_s"] == summary["train_time_s"] > 0 and reported["final_val_loss"] == vals[-1]
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["n_embd"] == 32 and config["train"]["optimizer"] == "adamw"
    assert config["optim"] == {"lr": 3e-3, "weight_decay": 0.0, "decay_groups": "all", "fused": True,
                               "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}  # every value that ran, none left to a later default
    assert config["layout"] == {"world_size": 1, "micro_batch": 4, "grad_accum": 2, "device": "cpu", "dtype": "fp32"}
    assert config["train"]["dtype"] == "bf16" and config["preset"]["differs"][-2].startswith("precision: fp32")
    log_text = (run / "log.txt").read_text()
    assert log_text.startswith(Path(train_gpt.__file__).read_text()[:200])
    assert "| device cpu | fp32 | world 1" in log_text
    assert log_text.endswith(  # where the run is and what to run next
        f"the run is in {run} (log.txt, config.json, checkpoints/latest.pt); next:\n"
        f"  python -m eval.report --run {run}    # the evaluations and a page: {run}/report.md\n"
        f"  python -m sample --run {run} --prompt \"The meaning of\"\n"
        f"  python -m export to-hf --run {run} --out {run / 'hf'}    # a Hugging Face model\n")
    assert (run / "code" / "train_gpt.py").is_file() and (run / "code" / "data" / "loader.py").is_file()
    ckpt = load_checkpoint(run / "checkpoints" / "latest.pt")
    assert ckpt["step"] == 40 and set(ckpt) >= {"model", "optimizer", "loader", "rng", "config"}
    assert "sampler" not in ckpt  # the sampler holds no state: its draws follow from the seed and the step
    assert list(config["model"])[:3] == ["vocab_size", "block_size", "n_layer"]  # the architecture first
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
                             **{"keep-checkpoints": -1}))
    halves = tmp_path / "halves"
    straight = train_losses(tmp_path / "straight")
    first = train_losses(halves)
    assert first == straight  # same run, same numbers (deterministic on CPU)
    resumed = train_losses(resume_in_new_directory(halves / "checkpoints" / "step_000003.pt", tmp_path / "resumed"))
    assert sorted(resumed) == [4, 5, 6, 7, 8]
    for step, loss in resumed.items():
        assert loss == straight[step], (step, loss, straight[step])


@pytest.mark.serial
def test_two_gloo_processes_match_one_whatever_the_micro_batch_and_resume_bit_exactly_on_two_ranks(corpus, tmp_path,
                                                                                                   one_thread):
    """1 process with micro-batches of 2 (4 micro-steps) and 2 ranks deriving micro-batches of 4 from the default
    bound see the same rows and the same biases, so the same losses; the 2-rank run's checkpoint of step 2, resumed
    on 2 ranks in another directory, continues it bit for bit (losses, weights, optimizer moments)."""
    common = {"steps": 4, "val-every": 0, "checkpoint-every": 2, "keep-checkpoints": -1}
    train_gpt.main(tiny_args(corpus, tmp_path, "one", **common, **{"micro-batch": 2}))
    result = ranks(tiny_args(corpus, tmp_path, "two", **common, **{"micro-batch": 8}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 ranks x 1 micro-steps x 4 sequences" in (tmp_path / "two" / "log.txt").read_text()
    assert "1 ranks x 4 micro-steps x 2 sequences" in (tmp_path / "one" / "log.txt").read_text()
    single, double = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(single) == sorted(double) == [1, 2, 3, 4]
    for step in single:
        assert double[step] == pytest.approx(single[step], rel=1e-5, abs=1e-6)
    vals = [r["val_loss"] for r in read_log(tmp_path / "one") if "val_loss" in r]
    vals2 = [r["val_loss"] for r in read_log(tmp_path / "two") if "val_loss" in r]
    assert vals2[-1] == pytest.approx(vals[-1], rel=1e-5)

    resumed = tmp_path / "resumed" / "checkpoints"
    resumed.mkdir(parents=True)
    (resumed / "latest.pt").write_bytes((tmp_path / "two" / "checkpoints" / "step_000002.pt").read_bytes())
    assert (result := ranks(["--resume", str(resumed.parent)])).returncode == 0, result.stderr[-3000:]
    again = train_losses(resumed.parent)
    assert sorted(again) == [3, 4] and all(again[step] == double[step] for step in again)
    ends = [load_checkpoint(run / "checkpoints" / "latest.pt") for run in (tmp_path / "two", resumed.parent)]
    for name, tensor in ends[0]["model"].items():
        assert torch.equal(tensor, ends[1]["model"][name]), name
    moments = [[t for state in end["optimizer"]["state"].values() for t in state.values()] for end in ends]
    assert len(moments[0]) > 0 and all(torch.equal(a, b) for a, b in zip(*moments, strict=True))


@pytest.mark.serial
def test_a_one_process_run_resumes_on_two_ranks_with_another_micro_batch(corpus, tmp_path, one_thread):
    train_gpt.main(tiny_args(corpus, tmp_path, "single", steps=6, **{"val-every": 0, "micro-batch": 2}))
    train_gpt.main(tiny_args(corpus, tmp_path, "moved", steps=3, **{"val-every": 0, "micro-batch": 2}))
    result = ranks(["--resume", str(tmp_path / "moved"), "--steps", "6", "--micro-batch", "8"])
    assert result.returncode == 0, result.stderr[-3000:]
    single, moved = train_losses(tmp_path / "single"), train_losses(tmp_path / "moved")
    assert sorted(moved) == list(range(1, 7))
    for step in single:
        assert moved[step] == pytest.approx(single[step], rel=1e-5, abs=1e-6)


def test_default_batch_splits_over_eight_ranks_and_a_bad_split_names_the_fix(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    hp = train_gpt.parse_config(["--device", "cpu"]).train  # the paper's 8 x 512 batch: one sequence per rank
    assert batch_layout(hp, 8) == (1, 1)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--device", "cpu"])
    assert "do not split over 3 processes: set --batch-tokens to a multiple of 512 x 3" in capsys.readouterr().err


@pytest.mark.parametrize("flags, error", [
    ({"val-files": "/nonexistent/nothing_*.bin"}, "no shard files match"),
    ({"train-files": "/nonexistent/nothing_*.bin"}, "no shard files match '/nonexistent/nothing_*.bin'"),
    ({"val-tokens": 16}, "--val-tokens 16 is less than one sequence of --seq-len 32; raise --val-tokens"),
    ({"val-tokens": 10**6}, "the validation budget needs 31250 (1000000 tokens); lower --val-tokens"),
])
def test_unusable_validation_data_fails_before_the_first_step(corpus, tmp_path, flags, error, capsys):
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.main(tiny_args(corpus, tmp_path, "badval", **{"val-every": 0}, **flags))
    err = capsys.readouterr().err
    assert excinfo.value.code == 2 and error in err and "Traceback" not in err
    assert not (tmp_path / "badval").exists()  # nothing was trained, nothing written


def test_an_evaluation_error_at_the_end_loses_no_checkpoint(corpus, tmp_path, monkeypatch):
    def failing_evaluate(*args, **kwargs):
        raise RuntimeError("validation exploded")

    monkeypatch.setattr(train_gpt, "evaluate", failing_evaluate)
    with pytest.raises(RuntimeError, match="validation exploded"):
        train_gpt.main(tiny_args(corpus, tmp_path, "evalfail", steps=3, **{"val-every": 0}))
    assert load_checkpoint(tmp_path / "evalfail" / "checkpoints" / "latest.pt")["step"] == 3
    assert "RuntimeError: validation exploded" in (tmp_path / "evalfail" / "log.txt").read_text()


def test_target_val_loss_is_reported_and_can_stop_the_run(corpus, tmp_path):
    summary = train_gpt.main(tiny_args(corpus, tmp_path, "target", steps=40, **{
        "val-every": 4, "target-val-loss": 4.5, "stop-at-target": True}))
    reached = summary["reached_target"]
    assert reached is not None and reached["val_loss"] <= 4.5
    assert summary["step"] == reached["step"] < 40
    assert load_checkpoint(tmp_path / "target" / "checkpoints" / "latest.pt")["step"] == reached["step"]


def test_a_non_finite_step_stops_the_run_and_keeps_a_finite_checkpoint(corpus, tmp_path, monkeypatch):
    """NaN biases at step 6 poison the update; with a checkpoint every step and a log line every 5, the state after
    it must not be written, and the kept checkpoint resumes (with a new --lr) to a finite end."""
    sample = train_gpt.BiasSampler.sample

    def poisoned(self, step, device="cpu"):
        draws = sample(self, step, device)
        return draws * float("nan") if step == 6 else draws

    monkeypatch.setattr(train_gpt.BiasSampler, "sample", poisoned)
    args = tiny_args(corpus, tmp_path, "nan", steps=12, **{"checkpoint-every": 1, "log-every": 5, "val-every": 0})
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.main(args)
    assert excinfo.value.code == 2
    run = tmp_path / "nan"
    assert (f"is not finite; stopping: the finite checkpoint of step 6 is kept in {run / 'checkpoints'}; continue "
            f"with --resume {run} and a lower --lr (now 0.003)") in (run / "log.txt").read_text()
    ckpt = load_checkpoint(run / "checkpoints" / "latest.pt")
    assert ckpt["step"] == 6 and all(torch.isfinite(t).all() for t in ckpt["model"].values())
    monkeypatch.setattr(train_gpt.BiasSampler, "sample", sample)
    summary = train_gpt.main(["--resume", str(run), "--lr", "1e-3"])
    assert summary["step"] == 12 and math.isfinite(summary["val_loss"])
    assert all(math.isfinite(loss) for loss in train_losses(run).values())


def test_flags_given_on_resume_take_effect(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "first", steps=4, **{"weight-decay": 0.0}))
    run = tmp_path / "first"
    train_gpt.main(["--resume", str(run), "--steps", "6", "--lr", "5e-4", "--weight-decay", "0.05"])
    records = read_log(run)
    assert [r["lr"] for r in records if "lr" in r and r["step"] > 4] == [5e-4, 5e-4]
    assert [r["lr"] for r in records if "lr" in r and r["step"] <= 4] == [3e-3] * 4
    changed = next(r for r in records if "resumed_from" in r)["changed"]
    assert changed["optim.lr"] == [3e-3, 5e-4] and changed["optim.weight_decay"] == [0.0, 0.05]
    ckpt = load_checkpoint(run / "checkpoints" / "latest.pt")
    assert ckpt["optimizer"]["param_groups"][0]["weight_decay"] == 0.05
    config = json.loads((run / "config.json").read_text())
    assert config["optim"]["lr"] == 5e-4 and config["train"]["steps"] == 6
    log_text = (run / "log.txt").read_text()  # the code once, not once per resume; each part names its code
    assert log_text.count("def main(argv") == 1 and log_text.count("| code in code/ (train_gpt.py sha256") == 2


def test_an_earlier_run_is_never_overwritten(corpus, tmp_path, capsys, monkeypatch):
    train_gpt.main(tiny_args(corpus, tmp_path, "taken", steps=1, **{"val-every": 0}))
    before = (tmp_path / "taken" / "log.jsonl").read_text()
    with pytest.raises(SystemExit):
        train_gpt.main(tiny_args(corpus, tmp_path, "taken", steps=1, **{"val-every": 0}))
    assert "taken already holds a run; continue it with --resume" in capsys.readouterr().err
    assert (tmp_path / "taken" / "log.jsonl").read_text() == before
    monkeypatch.setattr("run.directory.time.strftime", lambda fmt: "20260101-000000")  # two runs in one second
    first = train_gpt.main(tiny_args(corpus, tmp_path, "", steps=1, **{"val-every": 0}))
    second = train_gpt.main(tiny_args(corpus, tmp_path, "", steps=1, **{"val-every": 0}))
    assert Path(first["run_dir"]).name == "20260101-000000-custom-adamw"
    assert Path(second["run_dir"]).name == "20260101-000000-custom-adamw-2"
    assert "using 20260101-000000-custom-adamw-2 instead" in (Path(second["run_dir"]) / "log.txt").read_text()


def test_resuming_a_loose_checkpoint_starts_a_new_run_directory(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path / "runs", "origin", steps=2, **{"val-every": 0}))
    loose = tmp_path / "elsewhere" / "deep" / "saved.pt"
    loose.parent.mkdir(parents=True)
    loose.write_bytes((tmp_path / "runs" / "origin" / "checkpoints" / "latest.pt").read_bytes())
    summary = train_gpt.main(["--resume", str(loose), "--steps", "3", "--run-dir", str(tmp_path / "new")])
    assert Path(summary["run_dir"]).parent == tmp_path / "new" and summary["step"] == 3
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["deep"]  # nothing written beside it
    assert run_dir_of(loose) is None
    origin = tmp_path / "runs" / "origin"
    assert run_dir_of(origin / "checkpoints" / "latest.pt") == origin


def test_sigterm_writes_a_checkpoint_that_resumes_exactly(corpus, tmp_path, one_thread):
    train_gpt.main(tiny_args(corpus, tmp_path, "straight", steps=8, **{"val-every": 0}))
    args = tiny_args(corpus, tmp_path, "stopped", steps=8, **{"val-every": 0, "checkpoint-every": 0})
    output = stop_held_trainer(args, 3, signal.SIGTERM)
    run = tmp_path / "stopped"
    assert load_checkpoint(run / "checkpoints" / "latest.pt")["step"] == 3  # the step in progress
    assert "SIGTERM at step 3: checkpoint written" in output
    train_gpt.main(["--resume", str(run)])  # one thread, as the stopped run: bit-exact on the CPU
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(run)
    assert sorted(resumed) == list(range(1, 9))
    assert all(resumed[step] == straight[step] for step in resumed)


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGINT)])
def test_a_second_signal_still_lets_the_step_finish_and_the_checkpoint_be_written(corpus, tmp_path, first, second):
    """A grid that dies sends its trainer SIGTERM, and the grid that adopts the run may pass on a Ctrl-C; a user may
    press Ctrl-C twice: the second signal, taken while the run is stopping, neither interrupts the step nor costs
    the checkpoint (with --checkpoint-every 0 there is no other)."""
    args = tiny_args(corpus, tmp_path, "twice", steps=100000, **{"val-every": 0, "checkpoint-every": 0})
    proc = subprocess.Popen([sys.executable, str(ROOT / "train_gpt.py"), *args],
                            env={**held_env(1), "SYMGPT_TEST_HOLD_SIGNALS": "2"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output = PipedLines(proc)
    output.wait_for("held after step 1")
    proc.send_signal(first)
    output.wait_for("signal 1 taken")  # the first is the run's stop request before the second comes
    proc.send_signal(second)
    assert proc.wait(timeout=300) == 128 + first, output.text()
    text = output.text()
    assert f"{second.name} again: the run still stops at the end of this step, with its checkpoint" in text, text
    assert f"{first.name} at step 1: checkpoint written" in text, text
    assert load_checkpoint(tmp_path / "twice" / "checkpoints" / "latest.pt", verify=True)["step"] == 1


def test_a_resumed_run_computes_with_the_threads_it_started_with(corpus, tmp_path, one_thread):
    """The thread count can change a CPU run's sums (a grid sets it from --workers): the checkpoint records it and
    --resume replays it, saying so, whatever the resuming process was given."""
    run = tmp_path / "threads"
    train_gpt.main(tiny_args(corpus, tmp_path, "threads", steps=2, **{"val-every": 0}))
    assert load_checkpoint(run / "checkpoints" / "latest.pt")["rng"]["threads"] == 1
    torch.set_num_threads(2)  # what a grid with fewer --workers gives the resumed run
    assert train_gpt.main(["--resume", str(run), "--steps", "3"])["step"] == 3
    assert torch.get_num_threads() == 1
    assert ("threads: 1, as the run computed with before (this process was given 2)" in
            (run / "log.txt").read_text())


def test_train_files_alone_validate_on_the_validation_shards_beside_them(corpus, tmp_path):
    """data.tokenize writes <prefix>_val_*.bin beside <prefix>_train_*.bin: a run given --train-files only validates
    on those, and says so; where there are none, on the training shards, saying that too."""
    train_gpt.main(tiny_args(corpus, tmp_path, "beside", steps=1, **{"val-every": 0, "val-files": ""}))
    record = json.loads((tmp_path / "beside" / "config.json").read_text())["data"]
    assert record["val"]["pattern"] == str(corpus / "syn_val_*.bin") and record["val"]["tokens"] == 8192
    assert f"no --val-files: validating on {corpus / 'syn_val_*.bin'}" in (tmp_path / "beside" / "log.txt").read_text()
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "syn_train_000001.bin").write_bytes((corpus / "syn_train_000001.bin").read_bytes())
    train_gpt.main(tiny_args(corpus, tmp_path, "alone_run", steps=1, **{"val-every": 0, "val-files": "",
                                                                        "train-files": str(alone / "syn_*.bin")}))
    assert "validating on the training shards themselves" in (tmp_path / "alone_run" / "log.txt").read_text()


def test_a_run_name_longer_than_a_file_name_is_one_line(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        train_gpt.parse_config(tiny_args(corpus, tmp_path, "n" * 300))
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1, err
    assert "--run-name nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn...: 300 bytes, and a file name holds at most 255" in err


def test_resume_of_a_missing_or_foreign_file_names_the_path(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--resume", str(tmp_path)])
    assert "no checkpoint at" in capsys.readouterr().err
    foreign = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, foreign)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    for path, reason in ((foreign, f"not a {CHECKPOINT_FORMAT} checkpoint"), (notes, "not a readable checkpoint")):
        with pytest.raises(SystemExit):
            train_gpt.parse_config(["--resume", str(path)])
        assert f"{path}: {reason}" in capsys.readouterr().err


def test_a_failed_checkpoint_write_names_the_file_and_leaves_nothing_behind(tmp_path):
    """A file-size limit makes the write fail as a full disk does (EFBIG instead of ENOSPC)."""
    script = (
        "import resource, signal, sys, torch\n"
        "from fileio import filesystem_error_line\n"
        "from run.checkpoint import save_checkpoint\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))\n"
        "try:\n"
        f"    save_checkpoint(r'{tmp_path}/checkpoints/latest.pt', {{'tied': {{}}, 'w': torch.zeros(1 << 16)}})\n"
        "except OSError as exc:\n"
        "    print(filesystem_error_line(exc, '--run-dir'))\n"
        "    sys.exit(3)\n")
    result = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr
    assert result.stdout.startswith(f"could not write the checkpoint {tmp_path}/checkpoints/latest.pt: File too "
                                    "large (EFBIG); the file exceeds the file-size limit (`ulimit -f`)")
    assert "enforce fail" not in result.stdout
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_errors_and_notes_reach_log_txt(corpus, tmp_path, monkeypatch):
    real = lookup.resolve_data_files

    def noted(train_files, val_files, is_master):
        return (*real(train_files, val_files, is_master)[:2], "a note about the data")

    monkeypatch.setattr(lookup, "resolve_data_files", noted)
    train_gpt.main(tiny_args(corpus, tmp_path, "noted", steps=1, **{"val-every": 0}))
    text = (tmp_path / "noted" / "log.txt").read_text()
    assert "a note about the data" in text.split("=" * 100)[-1]  # after the code, with the printed lines


def test_gradient_clipping_bounds_the_logged_norm_for_every_kind_of_optimizer(corpus, tmp_path):
    for optimizer in ("adamw", "ecd"):
        lr = {"adamw": 3e-3, "ecd": 0.5}[optimizer]
        train_gpt.main(tiny_args(corpus, tmp_path, optimizer, steps=3, optimizer=optimizer, lr=lr,
                                 **{"grad-clip": 0.1, "val-every": 0}))
        norms = [r["grad_norm"] for r in read_log(tmp_path / optimizer) if "grad_norm" in r]
        assert len(norms) == 3 and all(n > 0.1 for n in norms)  # the norm before clipping, which was active


def test_optimizers_get_the_clip_and_overlap_settings(corpus, tmp_path):
    cfg = train_gpt.parse_config(tiny_args(corpus, tmp_path, "settings", optimizer="soap",
                                           **{"grad-clip": 0.5, "overlap-reduce": False}))
    trainer = train_gpt.Trainer(cfg, setup_process(cfg.train), RunLog(True))
    trainer.close()
    assert (trainer.optimizer.grad_clip, trainer.optimizer.overlap_reduce) == (0.5, False)
    cfg = train_gpt.parse_config(tiny_args(corpus, tmp_path, "settings2", **{"grad-clip": 0.25}))
    trainer = train_gpt.Trainer(cfg, setup_process(cfg.train), RunLog(True))
    trainer.close()
    assert trainer.optimizer.grad_clip == 0.25  # torch's AdamW: clipped by device_step before its step()


def test_the_single_batch_estimate_takes_the_next_validation_batch_at_each_multiple_of_val_every():
    hp = train_gpt.TrainConfig(val_tokens=3 * 4096, batch_tokens=4096, seq_len=512, val_every=10)
    starts = [config.single_batch_start(step, hp) for step in (0, 5, 10, 20, 30, 40)]
    assert starts == [None, None, 0, 8, 16, 0]  # batches of 8 sequences, cycling within the three of the budget
    assert config.single_batch_start(10, dataclasses.replace(hp, val_batch_estimate=False)) is None


def test_lr_schedules():
    hp = train_gpt.TrainConfig(steps=100, warmup_steps=10, lr_schedule="cosine", min_lr_frac=0.1)
    assert train_gpt.lr_factor(0, hp) == pytest.approx(0.1)
    assert train_gpt.lr_factor(10, hp) == pytest.approx(1.0)
    assert train_gpt.lr_factor(55, hp) == pytest.approx(0.55)
    assert train_gpt.lr_factor(100, hp) == pytest.approx(0.1)
    linear = train_gpt.TrainConfig(steps=100, lr_schedule="linear", cooldown_frac=0.2)
    assert train_gpt.lr_factor(79, linear) == 1.0
    assert train_gpt.lr_factor(90, linear) == pytest.approx(0.5)
    assert train_gpt.lr_factor(50, train_gpt.TrainConfig()) == 1.0


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
    ckpt = load_checkpoint(tmp_path / "ecd" / "checkpoints" / "latest.pt")
    for name, tensor in ckpt["model"].items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
    assert "pi" in next(iter(ckpt["optimizer"]["state"].values()))


def test_corrupt_shard_names_the_file(corpus, tmp_path, capsys):
    bad = tmp_path / "bad_train_000001.bin"
    bad.write_bytes(np.full(256, 7, dtype="<i4").tobytes() + b"\0" * 64)
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.main(tiny_args(corpus, tmp_path, "corrupt", **{"train-files": str(bad)}))
    assert excinfo.value.code == 2
    assert re.search(r"^error: .*bad_train_000001\.bin: bad magic 7", capsys.readouterr().err, re.M)


def test_sigint_stops_a_single_process_promptly(corpus, tmp_path):
    args = tiny_args(corpus, tmp_path, "ctrlc", steps=100000, **{"val-every": 0, "log-every": 1000})
    output = stop_held_trainer(args, 2, signal.SIGINT)  # long before the next log step at 1000
    assert load_checkpoint(tmp_path / "ctrlc" / "checkpoints" / "latest.pt")["step"] == 2
    assert "SIGINT at step 2: checkpoint written" in output
