"""A run's configuration as the evaluations read it: its config.json, the training settings it records over the
trainer's defaults, and the validation shards they name."""
from __future__ import annotations

import json
from pathlib import Path

import train_gpt
from config import config_from_dict
from data.lookup import resolve_data_files


def read_config(run_dir: Path) -> dict:
    """config.json of a run ({"model", "train", "optim", "layout"}); {} if absent; a one-line error naming the file
    when it is not a JSON object."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = f"not valid JSON ({exc.msg if isinstance(exc, json.JSONDecodeError) else exc.reason})"
    else:
        if isinstance(config, dict):
            return config
        problem = f"holds a JSON {type(config).__name__}, not a run's configuration"
    raise SystemExit(f"error: {path}: {problem}; it is damaged: restore it, or move it away (every checkpoint of the "
                     "run holds its configuration too)")


def validation_files(config: dict) -> str:
    """The run's validation shard glob (config "train" section; empty means the trainer's default data)."""
    hp = run_hyperparameters(config)
    return resolve_data_files(hp.train_files, hp.val_files)[1]


def run_hyperparameters(config: dict) -> train_gpt.TrainConfig:
    """The run's TrainConfig (config "train" section over the trainer's defaults)."""
    return config_from_dict(config.get("train", {}), train_gpt.TrainConfig)
