"""Nothing lost, nothing misleading (docs/runs.md): run-directory ownership, stale temporaries, reused names, torn
logs, damaged checkpoints, non-finite stops, and validation that does not depend on the GPU count."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import train_gpt
from eval import compare, report
from run.checkpoint import CheckpointError, load_checkpoint, resolve_resume, save_checkpoint
from run.directory import RunDirectory, run_holds_checkpoint
from run.log import read_log
from tests.filesystems import bound_by_mode_bits
from tests.helpers import (ENV, ROOT, VOCAB, PipedLines, held_env, ranks, tiny_args, tiny_gpt,
                           torchrun_in_background)


def run_in_background(args: list[str], env: dict[str, str] = ENV) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "train_gpt.py"), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


# ----- 1. one owner per run directory -----

@pytest.mark.serial
def test_two_trainers_started_together_on_one_run_name_one_is_refused(corpus, tmp_path):
    """Whichever claims the directory first runs; the other is refused, as in use (the owner is running) or as
    holding a run (the owner has finished): never two writers."""
    args = tiny_args(corpus, tmp_path, "twin", steps=10, **{"val-every": 0, "log-every": 5})
    first, second = run_in_background(args), run_in_background(args)
    outputs = [p.communicate(timeout=300)[0] for p in (first, second)]
    codes = sorted(p.returncode for p in (first, second))
    assert codes == [0, 2], outputs
    refused = outputs[[first.returncode, second.returncode].index(2)]
    assert "is in use by pid" in refused or "already holds a run" in refused, refused
    assert "choose another --run-name" in refused, refused
    records = [json.loads(line) for line in (tmp_path / "twin" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [5, 10]  # one writer


def test_a_second_trainer_on_a_running_run_is_refused_naming_the_owner(corpus, tmp_path, capsys):
    args = tiny_args(corpus, tmp_path, "busy", steps=100000, **{"val-every": 0, "log-every": 10})
    owner = run_in_background(args, held_env(1))
    output = PipedLines(owner)
    output.wait_for("held after step 1")  # the owner holds the directory and has stepped
    with pytest.raises(SystemExit) as second:  # the second trainer, in this process
        train_gpt.main(args)
    refused = capsys.readouterr().err
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=300) == 128 + signal.SIGTERM, output.text()
    assert second.value.code == 2
    assert f"is in use by pid {owner.pid} on host" in refused and "choose another --run-name" in refused, refused
    steps = [r["step"] for r in read_log(tmp_path / "busy") if "train_loss" in r]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # one writer


def test_a_run_in_use_refuses_a_resume_naming_its_owner_and_a_dead_owner_leaves_no_lock(corpus, tmp_path, capsys):
    train_gpt.main(tiny_args(corpus, tmp_path, "owned", steps=2, **{"val-every": 0}))
    owner = RunDirectory(tmp_path / "owned")
    owner.claim(new_run=False)
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.main(["--resume", str(tmp_path / "owned"), "--steps", "3"])
    assert excinfo.value.code == 2
    assert f"is in use by pid {os.getpid()} on host" in capsys.readouterr().err
    owner.release()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; from run.directory import RunDirectory; "
                               f"RunDirectory(Path({str(tmp_path / 'owned')!r})).claim(new_run=False); "
                               "print('held', flush=True); time.sleep(600)"], env=ENV, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()  # SIGKILL: no clean-up code runs
    holder.wait()
    assert train_gpt.main(["--resume", str(tmp_path / "owned"), "--steps", "3"])["step"] == 3


# ----- 2. a signal under torchrun is acted on at the next step, whatever the log interval -----

@pytest.mark.serial
def test_sigterm_under_torchrun_checkpoints_at_the_next_step_with_a_long_log_interval(corpus, tmp_path):
    """SIGTERM to the whole job (a scheduler's preemption; torchrun passes it on too) while both ranks hold after
    step 2: every rank stops at step 3, the next one, though the next log step is 1000 away. A rank that stopped
    elsewhere would leave the others waiting in a collective until torchrun killed them: no checkpoint, no line."""
    args = tiny_args(corpus, tmp_path, "ranks", steps=100000, **{"val-every": 0, "log-every": 1000})
    proc = torchrun_in_background(args, env=held_env(2))
    output = PipedLines(proc)
    output.wait_for("held after step 2", count=2)  # once per rank
    os.killpg(proc.pid, signal.SIGTERM)
    text = output.text()
    assert load_checkpoint(tmp_path / "ranks" / "checkpoints" / "latest.pt")["step"] == 3, text[-3000:]
    assert "SIGTERM at step 3: checkpoint written" in text, text[-3000:]


# ----- 3. the validation tokens and loss do not depend on the number of processes -----

BUDGETS = ((4096, 4), (1000, 3), (96, 8))  # (validation tokens, micro-batch): three budgets, three splits


def validation_losses(val_files: str, rank: int = 0, world: int = 1) -> dict[str, list[float]]:
    """Each objective's validation loss of a seeded tiny model on each of BUDGETS, on this rank of `world`."""
    losses = {}
    for objective in ("clm", "mlm"):
        model = tiny_gpt(0, vocab_size=VOCAB, objective=objective, mask_token=VOCAB - 1)
        losses[objective] = [train_gpt.evaluate(model, val_files, tokens, 32, micro, rank=rank, world=world)
                             for tokens, micro in BUDGETS]
    return losses


VALIDATE = textwrap.dedent("""
    import json, sys, torch.distributed as dist
    from tests.test_faults import validation_losses
    dist.init_process_group("gloo")
    losses = validation_losses(sys.argv[1], dist.get_rank(), dist.get_world_size())
    if dist.get_rank() == 0:
        print(json.dumps(losses))
    dist.destroy_process_group()
""")


@pytest.mark.serial
def test_validation_loss_is_the_same_on_1_2_and_3_ranks(corpus, tmp_path):
    """Both objectives (the masked LM draws its masks from the sequence, not the rank) on each budget."""
    script = tmp_path / "validate.py"
    script.write_text(VALIDATE)
    one = validation_losses(str(corpus / "syn_val_*.bin"))
    for world in (2, 3):
        proc = ranks([str(corpus / "syn_val_*.bin")], world, script)
        assert proc.returncode == 0, proc.stderr[-3000:]
        spread = json.loads(proc.stdout.strip().splitlines()[-1])
        for objective, losses in one.items():
            assert spread[objective] == pytest.approx(losses, rel=1e-6, abs=0), (world, objective)
    for losses in one.values():
        assert len({round(x, 4) for x in losses}) == 3  # three different budgets, three different numbers


def test_a_validation_budget_is_accepted_on_any_number_of_ranks(corpus, tmp_path, monkeypatch):
    """--val-tokens 4096 on 3 ranks, once refused because it was not a whole number of 3-rank batches."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = train_gpt.parse_config(tiny_args(corpus, tmp_path, "three", **{"val-tokens": 4096, "batch-tokens": 96,
                                                                        "micro-batch": 1}))
    assert cfg.train.val_tokens == 4096


# ----- 5. the non-finite stop says what exists and what to do -----

def test_a_run_that_diverges_before_its_first_checkpoint_says_none_exists(corpus, tmp_path):
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.main(tiny_args(corpus, tmp_path, "blowup", steps=4, lr=1e6, **{"val-every": 0,
                                                                                   "checkpoint-every": 1}))
    assert excinfo.value.code == 2
    stop = (tmp_path / "blowup" / "log.txt").read_text().splitlines()[-1]
    assert "no checkpoint was written (the run diverged before its first); start a new run with a lower --lr " \
           "(now 1e+06)" in stop
    assert "resume" not in stop.lower() and "kept" not in stop


def test_a_resumed_run_that_diverges_names_the_changed_flags(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "calm", steps=2, **{"val-every": 0}))
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.main(["--resume", str(tmp_path / "calm"), "--steps", "6", "--lr", "1e6", "--checkpoint-every", "1"])
    assert excinfo.value.code == 2
    text = (tmp_path / "calm" / "log.txt").read_text()
    assert "the checkpoint this run resumed from (step 2" in text and "is unchanged and finite" in text
    assert "the flags changed on --resume (train.steps 2 -> 6" in text
    assert "optim.lr 0.003 -> 1000000.0) are the first suspects" in text


# ----- 6, 7. leftovers of a killed writer, and a name whose run wrote no checkpoint -----

def test_stale_temporaries_of_dead_writers_are_removed_on_resume(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "killed", steps=2, **{"val-every": 0}))
    stale = tmp_path / "killed" / "checkpoints" / "latest.pt.999999.tmp"
    stale.write_bytes(b"x" * 4096)  # what SIGKILL during a checkpoint write leaves
    train_gpt.main(["--resume", str(tmp_path / "killed"), "--steps", "3"])
    assert not stale.exists()
    assert f"removed {stale}" in (tmp_path / "killed" / "log.txt").read_text()


def test_a_name_whose_earlier_run_wrote_no_checkpoint_is_reused_and_its_files_kept(corpus, tmp_path):
    args = tiny_args(corpus, tmp_path, "retry", steps=2, **{"val-every": 0})
    with pytest.raises(SystemExit):
        train_gpt.main([*args, "--lr", "1e6"])  # diverges before any checkpoint
    assert not run_holds_checkpoint(tmp_path / "retry")
    summary = train_gpt.main(args)
    assert summary["step"] == 2
    aside = [p for p in (tmp_path / "retry").iterdir() if p.name.startswith("failed-")]
    assert len(aside) == 1 and (aside[0] / "log.txt").is_file()
    assert "held an earlier run that wrote no checkpoint" in (tmp_path / "retry" / "log.txt").read_text()


def test_failed_attempts_are_kept_side_by_side_and_a_directory_of_other_files_is_refused(corpus, tmp_path, capsys,
                                                                                         monkeypatch):
    args = tiny_args(corpus, tmp_path, "again", steps=2, **{"val-every": 0})
    monkeypatch.setattr("run.directory.time.strftime", lambda fmt: "20260101-000000")  # both set aside in one second
    for _ in range(2):
        with pytest.raises(SystemExit):
            train_gpt.main([*args, "--lr", "1e6"])  # the second sets the first's files aside
    train_gpt.main(args)  # sets the second's aside
    aside = sorted(p.name for p in (tmp_path / "again").iterdir() if p.name.startswith("failed-"))
    assert aside == ["failed-20260101-000000", "failed-20260101-000000-2"]  # side by side, not nested
    assert all((tmp_path / "again" / name / "log.txt").is_file() for name in aside)
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "chapter1.tex").write_text("not a run")
    with pytest.raises(SystemExit):
        train_gpt.main(tiny_args(corpus, tmp_path, "thesis", steps=1))
    assert (f"--run-name thesis: {tmp_path / 'thesis'} exists and holds files that are not a run's; choose another "
            "--run-name or --run-dir") in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "thesis").iterdir()] == ["chapter1.tex"]


# ----- 8. a torn last line in log.jsonl -----

def test_a_torn_log_line_is_skipped_by_readers_and_removed_by_the_next_writer(corpus, tmp_path):
    train_gpt.main(tiny_args(corpus, tmp_path, "torn", steps=2, **{"val-every": 0, "log-every": 1}))
    path = tmp_path / "torn" / "log.jsonl"
    whole = len(path.read_text().splitlines())
    with open(path, "a") as f:
        f.write('{"step": 3, "train_lo')  # a crash in the middle of a write
    with pytest.warns(UserWarning, match=f"{path}: skipping its last line {whole + 1}"):
        assert len(read_log(tmp_path / "torn")) == whole
    with pytest.warns(UserWarning):
        report.main(["--run", str(tmp_path / "torn"), "--skip-missing"])
    with pytest.warns(UserWarning):
        compare.main([str(tmp_path / "torn"), "--out", str(tmp_path / "cmp")])
    train_gpt.main(["--resume", str(tmp_path / "torn"), "--steps", "3"])
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[whole:whole + 2]] == [2, 3]  # the resume record, step 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the log reads whole again: the torn line is gone, not left inside
        assert [r["step"] for r in read_log(tmp_path / "torn") if "train_loss" in r] == [1, 2, 3]
    assert f'{path}: removed its incomplete last line, a record the previous run was cut off while writing: ' \
           '{"step": 3, "train_lo' in (tmp_path / "torn" / "log.txt").read_text()
    path.write_text("\n".join(lines[:whole] + ['{"step": 3, '] + lines[whole:]) + "\n")
    with pytest.raises(ValueError, match=f"{path}: line {whole + 1} is not a JSON record"):
        read_log(tmp_path / "torn")  # a damaged line inside the log is an error, not skipped


@pytest.mark.parametrize("line, problem", [("[1, 2]", "a JSON list, not a record"),
                                           ('{"step": 2, "train_loss": "abc"}',
                                            "a record whose train_loss is 'abc', not a number")])
def test_a_damaged_log_line_is_one_line_in_compare(corpus, tmp_path, capsys, line, problem):
    train_gpt.main(tiny_args(corpus, tmp_path, "run", steps=2, **{"val-every": 0}))
    path = tmp_path / "run" / "log.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], line, *lines[1:]]) + "\n")
    with pytest.raises(SystemExit) as refused:
        compare.main([str(tmp_path / "run"), "--out", str(tmp_path / "cmp")])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: {path}: line 2 is {problem}; the log is damaged: "
                                                        "restore it, or remove the line")


# ----- checksummed checkpoints -----

def damage_a_tensor(path: Path) -> None:
    """Change one weight of a checkpoint (finite, so nothing but the checksum can tell)."""
    raw = torch.load(path, weights_only=False)
    raw["model"]["transformer.h.0.attn.c_attn.weight"][0, 0] += 1.0
    torch.save(raw, path)


def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_step(corpus, tmp_path, capsys):
    train_gpt.main(tiny_args(corpus, tmp_path, "rot", steps=4, **{"val-every": 0, "checkpoint-every": 2,
                                                                  "keep-checkpoints": -1}))
    checkpoints = tmp_path / "rot" / "checkpoints"
    damage_a_tensor(checkpoints / "latest.pt")
    damage_a_tensor(checkpoints / "step_000004.pt")
    with pytest.raises(CheckpointError, match="its model entry does not match its checksum"):
        load_checkpoint(checkpoints / "latest.pt", verify=True)
    summary = train_gpt.main(["--resume", str(tmp_path / "rot"), "--steps", "5"])
    assert summary["step"] == 5
    text = (tmp_path / "rot" / "log.txt").read_text()
    assert f"resuming from {checkpoints / 'step_000002.pt'} instead, the newest intact checkpoint" in text
    assert "resumed from step 2 of" in text
    damage_a_tensor(checkpoints / "step_000002.pt")
    with pytest.raises(SystemExit):
        train_gpt.main(["--resume", str(checkpoints / "step_000002.pt")])  # a file named explicitly: no fallback
    assert "its model entry does not match its checksum" in capsys.readouterr().err


def test_a_cut_or_missing_latest_checkpoint_falls_back_and_nothing_intact_is_an_error(corpus, tmp_path, capsys):
    train_gpt.main(tiny_args(corpus, tmp_path, "cut", steps=4, **{"val-every": 0, "checkpoint-every": 2,
                                                                  "keep-checkpoints": -1}))
    run = tmp_path / "cut"
    latest, newest, oldest = (run / "checkpoints" / name for name in ("latest.pt", "step_000004.pt", "step_000002.pt"))
    latest.write_bytes(latest.read_bytes()[:latest.stat().st_size // 2])  # what a copy or a full disk cut short
    resumed_note = f"resuming from {newest} instead, the newest intact checkpoint of {run}"
    assert resolve_resume(run) == (newest, [
        f"passed over {latest} (unreadable: not a complete torch.save archive: empty, truncated or another kind of "
        "file)", resumed_note])
    latest.unlink()
    assert resolve_resume(run) == (newest, [f"passed over {latest} (missing)", resumed_note])
    newest.write_bytes(b"")
    damage_a_tensor(oldest)
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--resume", str(run)])
    assert (f"--resume {run}: no intact checkpoint: {latest} (missing); {newest} (unreadable: not a complete "
            f"torch.save archive: empty, truncated or another kind of file); {oldest} (its model entry does not match "
            "its checksum); start a new run") in capsys.readouterr().err


def test_a_damaged_checkpoint_with_nothing_to_fall_back_on_is_refused_by_resume_and_init_from(corpus, tmp_path,
                                                                                              capsys):
    train_gpt.main(tiny_args(corpus, tmp_path, "lone", steps=2, **{"val-every": 0}))
    run, latest = tmp_path / "lone", tmp_path / "lone" / "checkpoints" / "latest.pt"
    damage_a_tensor(latest)
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--resume", str(run)])
    assert (f"--resume {run}: {latest} is damaged (its model entry does not match its checksum) and the run kept no "
            "step_XXXXXX.pt to fall back on (--keep-checkpoints K); start a new run") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--init-from", str(run), "--device", "cpu"])
    assert f"--init-from {latest}: its model entry does not match its checksum" in capsys.readouterr().err


def test_a_checkpoint_it_may_not_read_is_said_so_and_never_passed_over(corpus, tmp_path, capsys):
    """No permission to read latest.pt is not damage: --resume says to make it readable, neither that the file is
    truncated nor to start a new run, and does not fall back to an older step file it would then overwrite."""
    train_gpt.main(tiny_args(corpus, tmp_path, "locked", steps=2, **{"val-every": 0, "checkpoint-every": 1,
                                                                     "keep-checkpoints": -1}))
    latest = tmp_path / "locked" / "checkpoints" / "latest.pt"
    latest.chmod(0)
    try:
        with bound_by_mode_bits(), pytest.raises(SystemExit):
            train_gpt.parse_config(["--resume", str(tmp_path / "locked")])
    finally:
        latest.chmod(0o644)
    err = capsys.readouterr().err
    assert f"{latest}: cannot read it (Permission denied): make the file readable" in err, err
    assert "truncated" not in err and "start a new run" not in err and "step_000001.pt" not in err


# ----- a non-finite checkpoint is refused -----

def test_a_checkpoint_with_non_finite_weights_is_refused_by_resume_with_a_clear_error(corpus, tmp_path, capsys):
    train_gpt.main(tiny_args(corpus, tmp_path, "nan", steps=2, **{"val-every": 0}))
    path = tmp_path / "nan" / "checkpoints" / "latest.pt"
    raw = torch.load(path, weights_only=False)
    raw["model"]["transformer.h.0.attn.c_attn.weight"][0, 0] = float("nan")
    save_checkpoint(path, raw)  # a consistent checksum: only the finiteness check can tell
    capsys.readouterr()
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.main(["--resume", str(tmp_path / "nan"), "--steps", "3"])
    error = capsys.readouterr().err
    assert excinfo.value.code == 2 and "Traceback" not in error
    assert f"--resume: {path} holds non-finite weights or optimizer state; resume from an earlier checkpoint" in error
