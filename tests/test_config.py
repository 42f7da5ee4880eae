"""A run's configuration (config.py, cli.py; docs/runs.md#the-configuration): presets composed with flags, values
checked from each flag's metadata (range, choices, finite floats), the flags fixed on --resume, the parity report
that ignores what does not change the computation, and saved configs read section by section."""
from __future__ import annotations

import dataclasses
import re
import typing

import pytest

import config
import train_gpt
from cli import option
from config import preset_report, section_classes
from data.lookup import resolve_data_files
from optim import OPTIMIZERS
from tests.helpers import ROOT, tiny_args


def test_presets_compose_with_flags():
    cfg = train_gpt.parse_config(["--preset", "smoke", "--n-layer", "3", "--optimizer", "sgdm"])
    assert cfg.preset == "smoke" and cfg.model.n_layer == 3 and cfg.model.n_embd == 128
    assert cfg.train.optimizer == "sgdm" and cfg.train.steps == config.PRESETS["smoke"]["steps"]
    assert cfg.optim.lr == 0.03  # the preset's lr belongs to its own optimizer (adamw)
    assert train_gpt.parse_config(["--preset", "smoke"]).optim.lr == 2e-3
    assert train_gpt.parse_config(["--preset", "gpt2-124m"]).train.checkpoint_every > 0  # long runs checkpoint


@pytest.mark.parametrize("argv, message", [
    (["--n-embd", "30", "--n-head", "4"], "--n-embd 30 must be divisible by --n-head 4"),
    (["--optimizer", "adam"], "invalid choice: 'adam'"),
    (["--steps", "ten"], "--steps expects int, got 'ten'"),
    (["--batch-tokens", "1000"], "--batch-tokens 1000 must be a multiple of --seq-len 512"),
    (["--seq-len", "1024"], "--seq-len 1024 exceeds --block-size 512"),
    (["--lr", "-1"], "--lr must be > 0, got -1"),
    (["--seed", "-1"], "--seed must be [0, 4294967295], got -1"),
    (["--seed", "99999999999999999999999"], "--seed must be [0, 4294967295], got 99999999999999999999999"),
    (["--optimizer", "sgdm", "--optim-seed", str(2**32)], "--optim-seed must be [-1, 4294967295], got 4294967296"),
    (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
    (["--bias-mode", "bk"], "invalid choice: 'bk'"),
    (["--run-name", "../escape"], "--run-name '../escape': one directory name, without '/' and not '.' or '..'"),
    (["--run-name", ".."], "--run-name '..': one directory name"),
    (["--optimizer", "muon", "--dynamics-every", "10"], "muon has none (set --dynamics-every 0)"),
    (["--ecd-eta", "5"], "--ecd-eta is a flag of --optimizer ecd; this run uses adamw"),
])
def test_bad_cli_values_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.parse_config(["--device", "cpu", *argv])
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_help_shows_real_defaults_and_every_optimizer(capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--optimizer", "ecd", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "None" not in text
    assert "--lr FLOAT ℓ; the position step is lr/sqrt(ecd_eta) (allowed: > 0) (default: 1.0)" in text
    for cls in config.section_classes(train_gpt.GPTConfig, train_gpt.TrainConfig, "ecd").values():
        for field in dataclasses.fields(cls):
            assert option(field.name) in text and field.metadata["help"], field.name
    for name, spec in OPTIMIZERS.items():
        assert f"{name} {spec.description}" in text


def test_val_files_flag_names_the_validation_shards_whatever_the_training_data(monkeypatch):
    from data import fineweb_edu

    monkeypatch.setattr(fineweb_edu, "fineweb_shards_present", lambda: True)
    hp = train_gpt.TrainConfig
    files = lambda h: resolve_data_files(h.train_files, h.val_files)[:2]  # noqa: E731
    assert files(hp(val_files="v_*.bin")) == (fineweb_edu.DEFAULT_TRAIN_PATTERN, "v_*.bin")
    assert files(hp()) == (fineweb_edu.DEFAULT_TRAIN_PATTERN, fineweb_edu.DEFAULT_VAL_PATTERN)
    assert files(hp(train_files="t_*.bin")) == ("t_*.bin", "t_*.bin")
    assert files(hp(train_files="t_*.bin", val_files="v_*.bin")) == ("t_*.bin", "v_*.bin")


@pytest.mark.parametrize("flags, error", [
    (["--n-layer", "3"], "--n-layer cannot change when resuming"),
    (["--seq-len", "16"], "--seq-len cannot change when resuming"),
    (["--optimizer", "sgdm"], "--optimizer cannot change when resuming"),
])
def test_flags_that_cannot_change_on_resume_are_refused(corpus, tmp_path, capsys, flags, error):
    train_gpt.main(tiny_args(corpus, tmp_path, "fixed", steps=1, **{"val-every": 0}))
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--resume", str(tmp_path / "fixed"), *flags])
    assert error in capsys.readouterr().err


def float_flags() -> list[tuple[str, str]]:
    """(optimizer, flag) for every float flag of every section, each optimizer's own flags under that optimizer."""
    found = {}
    for optimizer in sorted(OPTIMIZERS):
        for cls in section_classes(train_gpt.GPTConfig, train_gpt.TrainConfig, optimizer).values():
            hints = typing.get_type_hints(cls)
            for field in dataclasses.fields(cls):
                if hints[field.name] is float:
                    found.setdefault(option(field.name), optimizer)
    return sorted((optimizer, name) for name, optimizer in found.items())


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("optimizer, name", float_flags())
def test_every_float_flag_refuses_non_finite_values(optimizer, name, value, capsys):
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.parse_config(["--device", "cpu", "--optimizer", optimizer, f"{name}={value}"])
    assert excinfo.value.code == 2
    assert f"{name} must be a finite number" in capsys.readouterr().err


def test_the_float_flags_walked_include_those_that_slipped_through():
    walked = {name for _, name in float_flags()}
    assert {"--grad-clip", "--lr", "--mean-q", "--std-q-min", "--hyperball-lr", "--gauge-damping"} <= walked


def test_the_flags_fixed_on_resume_are_marked_in_help_and_listed_in_the_docs(capsys):
    classes = section_classes(train_gpt.GPTConfig, train_gpt.TrainConfig, "adamw")
    fixed = {section: [option(f.name) for f in dataclasses.fields(cls) if f.metadata.get("fixed_on_resume")]
             for section, cls in classes.items()}
    assert len(fixed["model"]) == len(dataclasses.fields(train_gpt.GPTConfig))  # the model, variants included
    paragraph = next(p for p in (ROOT / "docs" / "runs.md").read_text().split("\n\n")
                     if p.startswith("Fixed on resume:"))
    assert "every flag of the model and model-variant groups" in paragraph
    listed = set(re.findall(r"`(--[a-z0-9-]+)`", paragraph))
    every_optimizer = {option(f.name) for spec in OPTIMIZERS.values() for f in dataclasses.fields(spec.config)
                       if f.metadata.get("fixed_on_resume")}
    outside_the_model = {name for section, names in fixed.items() if section != "model" for name in names}
    assert listed == outside_the_model | every_optimizer
    with pytest.raises(SystemExit):
        train_gpt.parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("(fixed on --resume)") == sum(map(len, fixed.values()))
    assert ("--seed INT seed for initialisation and the bias sampler (allowed: [0, 4294967295]) (fixed on --resume)"
            in text)


def test_logging_flags_do_not_count_as_differences_from_the_paper():
    cfg = train_gpt.parse_config(["--preset", "gpt2-124m", "--device", "cpu", "--gauge-diagnostic-every", "5",
                                  "--log-every", "7", "--run-name", "x", "--val-tokens", "4096"])
    cfg.train.wandb_project, cfg.train.wandb_run_name = "project", "name"  # (wandb need not be installed here)
    differs = " ".join(preset_report(cfg)["differs"])
    for name in ("--gauge-diagnostic-every 5", "--log-every 7", "--run-name x", "--val-tokens 4096", "--wandb"):
        assert name not in differs
    moved = train_gpt.parse_config(["--preset", "gpt2-124m", "--device", "cpu", "--mean-q", "0.25"])
    assert "--mean-q 0.25 (gpt2-124m: 0.5)" in preset_report(moved)["differs"]

def test_a_saved_config_is_read_section_by_section():
    """Each section of a checkpoint's config (today's, or v1 upgraded by run.checkpoint.upgrade) holds its own fields:
    a field is read from its section only, never found in another one."""
    saved = {"train": {"seed": 7, "steps": 3}, "research": {"gauge": "correct"}, "optim": {"lr": 0.5}}
    assert config.config_from_dict(saved["train"], train_gpt.TrainConfig).seed == 7
    assert config.config_from_dict(saved, train_gpt.TrainConfig).seed == train_gpt.TrainConfig.seed
    cfg = train_gpt.parse_config(["--device", "cpu", "--seed", "7", "--steps", "5"])
    whole = {name: dataclasses.asdict(section) for name, section in cfg.sections().items()}
    whole["research"]["seed"] = 99  # not a research field: ignored, not compared with train.seed
    assert config.changed_settings(cfg, {**whole, "train": {**whole["train"], "steps": 3}}) == {
        "train.steps": [3, 5]}
