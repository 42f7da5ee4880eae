"""Optional experiment tracking (--wandb-project, --tensorboard): off by default and never imported then, a clear
error when the package is missing, and the same records as log.jsonl, sent through fake `wandb` and
`torch.utils.tensorboard` modules (no network, no tensorboard package needed), and through the real TensorBoard
writer where the package is installed."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt
from data.shards import write_shard
from run.checkpoint import Progress
from run.log import RunLog, read_log

VOCAB = 64


class FakeRun:
    def __init__(self, calls: list, kwargs: dict) -> None:
        self.calls, self.kwargs = calls, kwargs
        self.summary = types.SimpleNamespace(update=lambda values: calls.append(("summary", values)))

    def log(self, values: dict, step: int) -> None:
        self.calls.append(("log", step, values))

    def finish(self, exit_code: int = 0) -> None:
        self.calls.append(("finish", exit_code))


def fake_wandb(calls: list) -> types.ModuleType:
    module = types.ModuleType("wandb")

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls, kwargs)

    module.init = init
    return module


class FakeSummaryWriter:
    calls: list = []

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        self.calls.append(("init", log_dir, purge_step))

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.calls.append(("text", tag, text, step))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls.append(("scalar", tag, value, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.calls.append(("close",))


def fake_tensorboard(calls: list, monkeypatch) -> None:
    """torch.utils.tensorboard with FakeSummaryWriter, and a `tensorboard` module for the installation check."""
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = type("SummaryWriter", (FakeSummaryWriter,), {"calls": calls})
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))


def numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


@pytest.fixture
def args(tmp_path, monkeypatch) -> list[str]:
    monkeypatch.setenv("SYMGPT_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "t_train_000001.bin", rng.integers(0, VOCAB, 4000))
    write_shard(tmp_path / "t_val_000000.bin", rng.integers(0, VOCAB, 1000))
    flags = {"train-files": tmp_path / "t_train_*.bin", "val-files": tmp_path / "t_val_*.bin", "vocab-size": VOCAB,
             "block-size": 16, "n-layer": 1, "n-head": 2, "n-embd": 16, "seq-len": 16, "micro-batch": 4,
             "batch-tokens": 64, "steps": 4, "val-every": 2, "val-tokens": 128, "log-every": 1, "device": "cpu",
             "run-dir": tmp_path / "runs", "run-name": "tracked"}
    return [f"--{k}={v}" for k, v in flags.items()]


def test_records_go_to_wandb_as_to_log_jsonl(args, tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    train_gpt.main([*args, "--wandb-project", "symgpt-tests", "--checkpoint-every", "2", "--steps", "2"])
    run = tmp_path / "runs" / "tracked"
    (kind, init), *rest = calls
    assert kind == "init" and [c[0] for c in calls].count("init") == 1 and rest[-1] == ("finish", 0)
    assert init["project"] == "symgpt-tests" and init["name"] == "tracked" and init["dir"] == str(run)
    assert init["config"] == json.loads((run / "config.json").read_text())  # the config, data record included
    assert init["config"]["data"]["train"]["tokens"] == 4000
    records = read_log(run)
    numbers = lambda r: {k: v for k, v in r.items()  # noqa: E731
                         if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
    assert [c for c in rest if c[0] == "log"] == [("log", r["step"], numbers(r)) for r in records
                                                  if not r.get("summary")]
    assert ("summary", numbers(records[-1])) in rest and records[-1]["summary"]
    run_id = (run / "wandb_run_id.txt").read_text().strip()
    assert init["id"] == run_id and init["resume"] == "allow"
    calls.clear()
    train_gpt.main(["--resume", str(run), "--steps", "4"])  # the resumed run goes on in the same W&B run
    assert calls[0][1]["id"] == run_id and calls[0][1]["project"] == "symgpt-tests"
    assert [c[1] for c in calls if c[0] == "log"][0] == 2  # logging continues at the resumed step


def test_a_failed_run_ends_its_wandb_run_as_failed(args, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    monkeypatch.setattr(train_gpt.Trainer, "finish", lambda trainer, final=True: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train_gpt.main([*args, "--wandb-project", "p", "--steps", "1", "--val-every", "0"])
    assert calls[-1] == ("finish", 1) and [c[0] for c in calls].count("finish") == 1


def test_a_default_run_never_imports_wandb(args, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` now raises ImportError
    summary = train_gpt.main([*args, "--steps", "1", "--val-every", "0"])
    assert summary["step"] == 1


def test_a_missing_wandb_names_the_flag_and_the_install_command(args, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit):
        train_gpt.main([*args, "--wandb-project", "p"])
    error = capsys.readouterr().err
    assert "--wandb-project p: the wandb package is not installed; `pip install wandb`" in error
    assert not Path(tmp_path / "runs" / "tracked").exists()  # refused before any work


def test_only_the_master_rank_tracks(args, tmp_path, monkeypatch):
    """open_run on another rank than 0 (as under torchrun) neither starts a W&B run nor writes a record."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    cfg = train_gpt.parse_config([*args, "--wandb-project", "p"])
    log = RunLog(is_master=False)
    rt = types.SimpleNamespace(is_master=False, world=2, grad_accum=1, micro_batch=2, device=torch.device("cpu"),
                               dtype_name="fp32", layout=dict)
    trainer = types.SimpleNamespace(run_config=cfg, rt=rt, log=log, data_record=None, run_directory=None,
                                    model=types.SimpleNamespace(get_num_params=lambda: 1), resumed=None,
                                    progress=Progress(), attention=None)
    train_gpt.Trainer.open_run(trainer)
    log.record({"step": 1, "train_loss": 1.0})
    log.close()
    assert calls == [] and log.trackers == [] and not (tmp_path / "runs").exists()


def test_records_go_to_tensorboard_as_to_log_jsonl(args, tmp_path, monkeypatch):
    calls: list = []
    fake_tensorboard(calls, monkeypatch)
    train_gpt.main([*args, "--tensorboard", str(tmp_path / "tb"), "--checkpoint-every", "2", "--steps", "2"])
    run = tmp_path / "runs" / "tracked"
    assert calls[0] == ("init", str(tmp_path / "tb" / "tracked"), None) and calls[-1] == ("close",)
    kind, tag, text, step = calls[1]
    assert (kind, tag, step) == ("text", "config", 0)
    assert json.loads(text.strip("`\n")) == json.loads((run / "config.json").read_text())
    records = read_log(run)
    expected = [("scalar", k, v, r["step"]) for r in records if not r.get("summary") for k, v in numbers(r).items()]
    expected += [("scalar", f"summary/{k}", v, 2) for k, v in numbers(records[-1]).items()]
    assert [c for c in calls if c[0] == "scalar"] == expected and records[-1]["summary"]
    assert len(expected) > 10 and ("scalar", "val_loss", records[-1]["val_loss"], 2) in expected
    calls.clear()
    train_gpt.main(["--resume", str(run), "--steps", "4"])  # the same folder; TensorBoard drops events from step 2 on
    assert calls[0] == ("init", str(tmp_path / "tb" / "tracked"), 2)
    assert min(c[3] for c in calls if c[0] == "scalar") == 2 and calls[-1] == ("close",)


def test_wandb_and_tensorboard_together(args, tmp_path, monkeypatch):
    wandb_calls, tb_calls = [], []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(wandb_calls))
    fake_tensorboard(tb_calls, monkeypatch)
    train_gpt.main([*args, "--wandb-project", "p", "--tensorboard", str(tmp_path / "tb"), "--steps", "1"])
    logged = [c[2] for c in wandb_calls if c[0] == "log"]
    assert logged and {c[1] for c in tb_calls if c[0] == "scalar" and "/" not in c[1]} == set().union(*logged)


def test_a_missing_tensorboard_names_the_flag_and_the_install_command(args, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(SystemExit):
        train_gpt.main([*args, "--tensorboard", str(tmp_path / "tb")])
    error = capsys.readouterr().err
    assert f"--tensorboard {tmp_path / 'tb'}: the tensorboard package is not installed" in error
    assert "`pip install tensorboard`, or leave --tensorboard empty" in error
    assert not (tmp_path / "runs" / "tracked").exists() and not (tmp_path / "tb").exists()


def test_tensorboard_event_files_hold_the_logged_scalars(args, tmp_path):
    """With the tensorboard package installed: the real writer's event files read back as log.jsonl's numbers."""
    pytest.importorskip("tensorboard", reason="the optional tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_gpt.main([*args, "--tensorboard", str(tmp_path / "tb"), "--steps", "2"])
    events = EventAccumulator(str(tmp_path / "tb" / "tracked")).Reload()
    records = [r for r in read_log(tmp_path / "runs" / "tracked") if "train_loss" in r]
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == pytest.approx(
        [(r["step"], r["train_loss"]) for r in records])
    assert "summary/val_loss" in events.Tags()["scalars"]
