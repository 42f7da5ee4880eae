"""Nothing lost, nothing misleading (docs/runs.md), continued: resuming an older checkpoint of a run starts a new run
directory instead of replacing the newer ones, --keep-checkpoints K, the lock leaves live writers' and other files
alone, every reader verifies the checksum, log records say what was measured and a resumed run keeps its preset,
the advice of a non-finite stop after a resume, and a refusal reaches every rank as one line."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import export
import sample
import train_gpt
from eval import dynamics, val_loss
from run.directory import RunDirectory
from run.log import read_log
from run.stop import non_finite_stop_message
from tests.helpers import ranks, tiny_args, train_losses, write_v1_checkpoint


def checkpoint_names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


# ----- an older checkpoint of a run branches; the newer ones stay -----

def test_resuming_an_older_checkpoint_of_a_run_starts_a_new_directory_and_keeps_the_newer_ones(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "trunk", steps=4, **{"val-every": 0, "checkpoint-every": 1,
                                                                    "keep-checkpoints": -1}))
    run = tmp_path / "trunk"
    files = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    log = (run / "log.jsonl").read_text()
    older = run / "checkpoints" / "step_000001.pt"
    summary = train_gpt.main(["--resume", str(older), "--steps", "3"])
    branch = Path(summary["run_dir"])
    assert branch.parent == tmp_path and branch != run and summary["step"] == 3
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == files  # latest.pt, step 2..4
    assert (run / "log.jsonl").read_text() == log
    assert checkpoint_names(branch) == ["latest.pt", "step_000002.pt", "step_000003.pt"]
    assert train_losses(branch) == {step: loss for step, loss in train_losses(run).items() if step in (2, 3)}
    assert (f"--resume {older}: {run} holds later checkpoints ({run / 'checkpoints' / 'step_000002.pt'} (step 2), "
            ) in (branch / "log.txt").read_text()
    newest = train_gpt.main(["--resume", str(run / "checkpoints" / "step_000004.pt"), "--steps", "5"])
    assert Path(newest["run_dir"]) == run  # the run's newest checkpoint, named as a file, goes on in the run


# ----- --keep-checkpoints K -----

def test_keep_checkpoints_keeps_the_last_k_step_files(corpus, tmp_path):
    run = tmp_path / "keep"
    train_gpt.main(tiny_args(corpus, tmp_path, "keep", steps=5, **{"val-every": 0, "checkpoint-every": 1,
                                                                   "keep-checkpoints": 2}))
    assert checkpoint_names(run) == ["latest.pt", "step_000004.pt", "step_000005.pt"]
    train_gpt.main(["--resume", str(run), "--steps", "7", "--keep-checkpoints", "-1"])
    assert checkpoint_names(run) == ["latest.pt"] + [f"step_00000{i}.pt" for i in (4, 5, 6, 7)]
    train_gpt.main(["--resume", str(run), "--steps", "8", "--keep-checkpoints", "1"])
    assert checkpoint_names(run) == ["latest.pt", "step_000008.pt"]
    train_gpt.main(["--resume", str(run), "--steps", "9", "--keep-checkpoints", "0"])
    assert checkpoint_names(run) == ["latest.pt"]
    latest = run / "checkpoints" / "latest.pt"
    write_v1_checkpoint(latest, latest)
    ckpt = torch.load(latest, weights_only=False)
    ckpt["config"]["train"]["keep_checkpoints"] = True  # a v1 file from when the flag was a switch: on kept every file
    del ckpt["checksum"]
    torch.save(ckpt, latest)
    assert train_gpt.parse_config(["--resume", str(run)]).train.keep_checkpoints == -1


# ----- the lock removes the temporary files of dead writers only -----

def test_taking_the_lock_leaves_live_writers_and_other_files_alone(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "held", steps=2, **{"val-every": 0}))
    run = tmp_path / "held"
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(ended.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        kept = [run / "notes.tmp", run / f"report.md.{live.pid}.tmp", run / "eval" / f"val_loss.json.{live.pid}.tmp",
                run / "checkpoints" / f"latest.pt.{live.pid}.tmp"]
        removed = [run / f"config.json.{dead}.tmp", run / "checkpoints" / f"latest.pt.{dead}.tmp"]
        for path in kept + removed:
            path.parent.mkdir(exist_ok=True)
            path.write_text("being written")
        train_gpt.main(["--resume", str(run), "--steps", "3"])
    finally:
        live.kill()
        live.wait()
    assert all(path.read_text() == "being written" for path in kept)
    assert not any(path.exists() for path in removed)
    text = (run / "log.txt").read_text()
    assert all(f"removed {path}" in text for path in removed) and "notes.tmp" not in text


# ----- every reader verifies the checksum -----

def test_eval_export_and_sample_refuse_a_damaged_checkpoint(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "flipped", steps=2, **{"val-every": 0}))
    run = tmp_path / "flipped"
    latest = run / "checkpoints" / "latest.pt"
    raw = torch.load(latest, weights_only=False)
    raw["model"]["transformer.h.0.attn.c_attn.weight"].view(torch.int32)[0, 0] ^= 1 << 30  # an exponent bit
    torch.save(raw, latest)
    damaged = f"{latest}: its model entry does not match its checksum"
    for command in (lambda: val_loss.main(["--run", str(run)]), lambda: dynamics.main(["--run", str(run)]),
                    lambda: export.main(["to-hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]),
                    lambda: sample.main(["--checkpoint", str(run), "--max-new-tokens", "2"])):
        with pytest.raises(SystemExit, match=re.escape(damaged)):
            command()
    assert not (tmp_path / "hf").exists() and not (run / "eval" / "val_loss.json").exists()


# ----- what log.jsonl and config.json say -----

def test_records_say_what_was_measured_and_a_resumed_run_keeps_its_preset(corpus, tmp_path, capsys):
    run = tmp_path / "rec"
    train_gpt.main(["--preset", "smoke", *tiny_args(corpus, tmp_path, "rec", steps=4, **{"val-every": 2})])
    train_gpt.main(["--resume", str(run), "--steps", "6"])
    records = read_log(run)
    training = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in training] == [1, 2, 3, 4, 5, 6]
    assert not [k for r in training for k in r if k.startswith("val") or k in ("best_val_loss_batch", "reached_target")]
    # the final checkpoint precedes the final validation, so the resumed run validates step 4 again
    assert [r["step"] for r in records if "val_loss" in r and not r.get("summary")] == [0, 2, 4, 4, 6]
    resumed = next(r for r in records if "resumed_from" in r)
    assert (resumed["step"], resumed["tokens"]) == (4, 4 * 256)  # the x axis stays in tokens
    assert json.loads((run / "config.json").read_text())["preset"] == {
        "name": "smoke", "reproduces": "no published run (a few minutes on a CPU to check the trainer)", "differs": []}
    assert (run / "log.txt").read_text().rsplit("\npreset ", 1)[1].startswith("smoke: reproduces no published run")
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--resume", str(run), "--preset", "gpt2-124m"])
    assert ("--preset gpt2-124m: the resumed run was started with --preset smoke, which it keeps"
            in capsys.readouterr().err)
    latest = run / "checkpoints" / "latest.pt"
    write_v1_checkpoint(latest, latest)
    ckpt = torch.load(latest, weights_only=False)
    del ckpt["config"]["preset"], ckpt["checksum"]  # a v1 file from before checkpoints recorded it: config.json says
    torch.save(ckpt, latest)
    assert train_gpt.parse_config(["--resume", str(run)]).preset == "smoke"


# ----- the non-finite stop after a resume that followed its advice -----

def test_a_resumed_run_that_diverges_despite_a_lower_lr_points_to_an_earlier_checkpoint(corpus, tmp_path,
                                                                                       monkeypatch):
    draw = train_gpt.BiasSampler.sample

    def poisoned(self, step, device="cpu"):  # a state from which every step diverges, whatever the lr
        return draw(self, step, device) * (float("nan") if step >= 3 else 1.0)

    monkeypatch.setattr(train_gpt.BiasSampler, "sample", poisoned)
    with pytest.raises(SystemExit):
        train_gpt.main(tiny_args(corpus, tmp_path, "edge", steps=8, **{"val-every": 0, "checkpoint-every": 1,
                                                                       "keep-checkpoints": -1}))
    run = tmp_path / "edge"
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.main(["--resume", str(run), "--lr", "1e-3"])
    assert excinfo.value.code == 2
    stop = (run / "log.txt").read_text().splitlines()[-1]
    assert ("is unchanged and finite, but the run diverged again with the safer settings given on --resume "
            "(optim.lr 0.003 -> 0.001): that state was probably already diverging; resume from an earlier "
            f"checkpoint, the newest being --resume {run / 'checkpoints' / 'step_000002.pt'}.") in stop, stop
    assert "suspect" not in stop


def test_the_non_finite_stop_without_an_earlier_checkpoint_says_so(tmp_path):
    resumed = {"resumed_from": str(tmp_path / "run" / "checkpoints" / "latest.pt"), "step": 5,
               "changed": {"train.warmup_steps": [0, 100], "train.steps": [10, 20]}}
    where = {"checkpoint_step": 5, "resumed": resumed, "run_dir": tmp_path / "run"}
    text = non_finite_stop_message("the training loss (nan)", 6, lr=0.01, **where)
    assert ("diverged again with the safer settings given on --resume (train.warmup_steps 0 -> 100; also changed: "
            "train.steps 10 -> 20)") in text
    assert "resume from an earlier checkpoint, but the run kept none (--keep-checkpoints K" in text
    resumed["changed"] = {"optim.lr": [0.01, 0.1]}  # a higher lr is still the first suspect
    assert "the flags changed on --resume (optim.lr 0.01 -> 0.1) are the first suspects" in non_finite_stop_message(
        "the training loss (nan)", 6, lr=0.1, **where)


# ----- a refusal by rank 0 on 2 ranks -----

@pytest.mark.serial
def test_a_refusal_by_rank_0_ends_every_rank_with_its_one_line_message(corpus, tmp_path):
    result = ranks(tiny_args(corpus, tmp_path, "bogus", steps=1, **{"attention-impl": "triton"}))
    refusal = ("error: --attention-impl triton: the Triton kernel runs on CUDA devices (this one is cpu); use auto or "
               "one of sdpa")
    # each rank prints it and no rank prints a traceback
    assert result.returncode == 2 and result.stderr.count(refusal) == 2, result.stderr[-3000:]
    assert 'train_gpt.py", line' not in result.stderr and "rank 0 could not" not in result.stderr

    train_gpt.main(tiny_args(corpus, tmp_path, "owned", steps=1, **{"val-every": 0}))
    owner = RunDirectory(tmp_path / "owned")  # this process holds the run, as its trainer would
    owner.claim(new_run=False)
    try:
        result = ranks(["--resume", str(tmp_path / "owned"), "--steps", "2"])
    finally:
        owner.release()
    refusal = f"error: {tmp_path / 'owned'} is in use by pid {os.getpid()} on host"
    assert result.returncode == 2 and result.stderr.count(refusal) == 2, result.stderr[-3000:]
    assert 'train_gpt.py", line' not in result.stderr and "Connection closed by peer" not in result.stderr
