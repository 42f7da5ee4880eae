"""Optional experiment tracking (--wandb-project): off by default and never imported then, a clear error when the
package is missing, and the same records as log.jsonl, sent through a fake `wandb` module (no network)."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import runs
import train_gpt
from data.shards import write_shard

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
    records = runs.read_log(run)
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
    monkeypatch.setattr(train_gpt.Trainer, "finish", lambda trainer: 1 / 0)
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
    log = runs.RunLog(is_master=False)
    rt = types.SimpleNamespace(is_master=False, world=2, grad_accum=1, micro_batch=2)
    trainer = types.SimpleNamespace(cfg=cfg, rt=rt, log=log, model=types.SimpleNamespace(get_num_params=lambda: 1),
                                    data_record=None, run_dir=None, resumed=None)
    train_gpt.Trainer.open_run(trainer)
    log.record({"step": 1, "train_loss": 1.0})
    log.close()
    assert calls == [] and log.tracker is None and not (tmp_path / "runs").exists()
