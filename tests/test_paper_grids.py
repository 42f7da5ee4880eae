"""The paper's tables as grid files (grids/*.toml, docs/reproduce.md): every file parses and the trainer's parser
takes every run, at the paper's scale and the CPU's; each grid's runs carry its table's configuration; the published
numbers cover every run the grids train and every cell names a grid that trains it; the dry run prints every run
and the expected wall time. A grid file run end to end at the CPU scale, into a scorecard that is not comparable
everywhere: tests/test_grid.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import config
from eval import paper_run, scorecard
from grid import plan
from grid.__main__ import main as grid_main
from run.log import format_duration
from tests.helpers import ROOT

GRIDS = sorted((ROOT / "grids").glob("*.toml"))
PAPER_TOKENS = 122070 * 4096  # 500M tokens in steps of 8 x 512 (App. D.1)
# Table 9 of the paper: each optimizer's hyperparameters (config.json's optim section).
TABLE9 = {"ecd": {"lr": 1.0, "ecd_eta": 100.0, "ecd_f0": 2.0, "ecd_nu": 0.0, "weight_decay": 0.0},
          "sgdm": {"lr": 0.03, "momentum": 0.95, "nesterov": True, "weight_decay": 0.0},
          "adamw": {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
          "soap": {"lr": 3e-4, "beta1": 0.95, "beta2": 0.95, "soap_precondition_frequency": 10,
                   "soap_max_precond_dim": 10000, "weight_decay": 0.01}}
# Per grid: (optimizer, bias mode, seed, E[b_V] where the bias mode samples b_V or learns it, activation).
TABLES = {
    "table1": {(o, b, s, 0.0 if b == "bqbv" else None, "prelu") for o in ("ecd", "sgdm", "adamw", "soap")
               for b in ("none", "bqbv") for s in (42, 123)},
    "table1-sgdm-at-rest": {("sgdm", "none", s, None, "prelu") for s in (42, 123)},
    "table2": {("ecd", b, s, 0.5 if b == "bqbv" else None, "prelu") for b in ("none", "bqbv")
               for s in (42, 83, 123, 789)},
    "table14": {(o, "bq", 42, None, "prelu") for o in ("ecd", "sgdm", "adamw", "soap")},
    "table16": {(o, b, 789, 0.5 if b == "bqbv" else None, "prelu") for o in ("sgdm", "adamw", "soap")
                for b in ("none", "bqbv")},
    "table21": {(o, b, 42, 0.5, "prelu") for o in ("ecd", "sgdm", "adamw", "soap") for b in ("bqbv", "learned")},
    "table23": {("ecd", b, s, 0.0 if b == "bqbv" else None, "gelu") for b in ("none", "bq", "bqbv")
                for s in (42, 83, 789)},
    "table23-v05": {("ecd", "bqbv", s, 0.5, "gelu") for s in (83, 789)},
    "table26": {(o, b, 42, 0.0 if b == "bqbv" else None, "gelu") for o in ("adamw", "sgdm", "soap")
                for b in ("none", "bqbv")},
}


def planned(grid: Path, scale: str = "paper", run_dir: Path = Path("runs")) -> dict[str, dict]:
    """{run name: the configuration config.json would record} of a grid file's dry run, each run's flags
    parsed by train_gpt.py's own parser (a refusal fails the test with the trainer's message)."""
    spec = plan.scaled(plan.build_spec(None, str(run_dir), [], [], grid), scale, 0)
    known = plan.train_flags()
    plan.check_flags(spec, known)
    configs = {}
    for run in plan.plan_runs(spec, known, 1, False):
        problem, cfg = plan.parser_problem(run.flags, 1)
        assert problem is None, f"{grid.name}: {run.name}: {problem}"
        configs[run.name] = cfg.to_dict()
    return configs


def test_every_table_has_a_grid_file_and_no_other_file_is_there():
    assert {g.stem for g in GRIDS} == set(TABLES)


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.stem)
@pytest.mark.parametrize("scale", ["paper", "cpu"])
def test_every_grid_parses_and_the_trainer_takes_every_run(grid, scale):
    configs = planned(grid, scale)
    assert len(configs) == len(TABLES[grid.stem])
    if scale == "cpu":
        assert all(c["train"]["device"] == "cpu" and c["train"]["steps"] * c["train"]["batch_tokens"] < 1e5
                   for c in configs.values())


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.stem)
def test_the_cpu_scale_changes_only_what_the_trainers_cpu_preset_sets(grid):
    """--scale cpu is the entries of config.PRESETS["cpu"] given as flags: every run takes each of them, and nothing
    else of its grid changes (its preset's values, optimizer, biases and schedule stay)."""
    entries, paper, cpu = config.PRESETS["cpu"], planned(grid), planned(grid, "cpu")
    assert list(cpu) == list(paper)
    for name, at_paper in paper.items():
        for section, values in cpu[name].items():
            for key, value in values.items():
                assert value == entries.get(key, at_paper[section][key]), f"{name}: {section}.{key}"


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.stem)
def test_each_grids_runs_carry_its_tables_configuration(grid):
    configs = planned(grid).values()
    found = {(c["train"]["optimizer"], c["model"]["bias_mode"], c["train"]["seed"],
              c["model"]["mean_v"] if c["model"]["bias_mode"] in ("bqbv", "learned") else None,
              c["model"]["activation"]) for c in configs}
    assert found == TABLES[grid.stem]
    for c in configs:
        model, train, optim = c["model"], c["train"], c["optim"]
        assert (model["n_layer"], model["n_head"], model["n_embd"], model["block_size"], model["vocab_size"]) == \
            (12, 12, 768, 512, 50304)
        assert (train["steps"] * train["batch_tokens"], train["batch_tokens"], train["seq_len"]) == \
            (PAPER_TOKENS, 4096, 512)
        assert (train["lr_schedule"], train["warmup_steps"], train["grad_clip"]) == ("constant", 0, 0.0)
        assert (model["mean_q"], model["std_q_min"], model["std_q_max"]) == (0.5, 0.05, 0.15)
        assert (model["std_v_min"], model["std_v_max"]) == (0.05, 0.05)  # the published code's σ_V
        assert train["val_biases"] == "last-sample" and train["val_every"] == 1000  # the published validation
        assert {k: optim[k] for k in TABLE9[train["optimizer"]]} == TABLE9[train["optimizer"]]
        if train["optimizer"] == "sgdm":  # Table 1: a random initial velocity, drawn per seed; its control: at rest
            assert optim["initial_velocity_std"] == (0.0 if grid.stem == "table1-sgdm-at-rest" else 0.1)
            assert optim["optim_seed"] == train["seed"]
        assert paper_run.paper_differences({**c, "data": FINEWEB}, [{"summary": True, "step": train["steps"]}]) == []
        assert paper_run.metric_problem("best_val_loss", paper_run.ScoredRun(Path("run"), c, [])) is None


FINEWEB = {split: {"pattern": f"/data/finewebedu_{split}_*.bin",
                   "files": [{"path": f"/data/finewebedu_{split}_000001.bin", "tokens": 1, "sha256": "0" * 64}]}
           for split in ("train", "val")} | {"fingerprint": "0" * 16}


def test_the_published_numbers_cover_every_run_of_the_grids_and_every_cell_names_a_grid_that_trains_it():
    published = scorecard.load_published()
    runs = {grid.stem: [paper_run.ScoredRun(Path(name), config, []) for name, config in planned(grid).items()]
            for grid in GRIDS}
    used = set()
    for cell in published.cells:
        if cell.pool:
            continue
        trained = [run for grid in cell.grids for run in runs[grid]]
        for seed in cell.seeds:
            for side in [cell.runs] + ([[cell.baseline]] if cell.baseline else []):
                matched = [r for selector in side for r in trained if paper_run.matches(r, selector, [seed])]
                assert matched, f"{cell.name}: no run of {', '.join(cell.grids)} for seed {seed} and {side}"
                used |= {id(r) for r in matched}
    unused = [(grid, r.path.name) for grid, rs in runs.items() for r in rs if id(r) not in used]
    assert not unused, f"runs no published cell reads: {unused}"


def test_the_dry_run_prints_every_run_and_the_expected_wall_time(tmp_path, capsys):
    args = ["--grid", str(ROOT / "grids" / "table2.toml"), "--run-dir", str(tmp_path), "--dry-run", "--gpus",
            "0,1,2,3,4,5,6"]
    assert grid_main(args) == 0
    out = capsys.readouterr().out
    names = [f"bias-mode={b},seed={s}" for b in ("none", "bqbv") for s in (42, 83, 123, 789)]
    assert all(f"[new] {name} ->" in out for name in names)
    assert f"expected wall time: {2 * PAPER_TOKENS:,} tokens / R (8 runs on 7 GPU slots" in out
    measured = tmp_path / "table2" / names[0]  # a run that has started and measured its throughput
    measured.mkdir(parents=True)
    records = [{"step": s, "tokens": 4096 * s, "train_loss": 5.0, "tokens_per_s": 40960.0} for s in (10, 20)]
    (measured / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert grid_main(args) == 0
    seconds = (PAPER_TOKENS - 4096 * 20 + PAPER_TOKENS) / 40960.0  # its slot: the rest of it, then the 8th run
    assert f"expected wall time: {format_duration(seconds)} (8 runs on 7 GPU slots" in capsys.readouterr().out


def test_the_dry_run_prints_what_each_claim_of_the_grid_can_decide(tmp_path, capsys):
    """Per claim the grid's runs feed: the seeds it gives, the power at the paper's spread, the seeds for 80%."""
    from eval import verdicts

    args = ["--grid", str(ROOT / "grids" / "table2.toml"), "--run-dir", str(tmp_path), "--dry-run"]
    assert grid_main(args) == 0
    out = capsys.readouterr().out
    power = verdicts.power_of(-0.49, 0.09 / 2, 3)  # Table 2's Δ: four seeds at its Std 0.09
    assert (f"  Table 2, Mean, Δ: -0.49 at spread 0.09 (the paper's Std over 4 seeds): 4 seeds here, power "
            f"{100 * power:.0f}%; {verdicts.seeds_to_decide(-0.49, 0.09)} seeds give 80%") in out
    per_seed = verdicts.power_of(-0.41, 0.09, 3)  # one seed's Δ at the same spread
    assert f"  Table 10, 789, Δ Val Loss: -0.41 at spread 0.09 (the paper's Std over 4 seeds): 1 seed here, power " \
           f"{100 * per_seed:.0f}%" in out
    assert "GELU" not in out  # grids/table23.toml's claims: not these runs'
    assert grid_main(["--grid", str(ROOT / "grids" / "table23.toml"), "--run-dir", str(tmp_path), "--dry-run"]) == 0
    gelu = verdicts.power_of(-0.03, 0.018 / 3 ** 0.5, 2)  # the GELU Δ, three seeds at its Std 0.018
    assert (f"  Table 23, Mean, GELU Δ: -0.03 at spread 0.018 (the paper's Std over 3 seeds): 3 seeds here, power "
            f"{100 * gelu:.0f}%; {verdicts.seeds_to_decide(-0.03, 0.018)} seeds give 80%") in capsys.readouterr().out


def test_before_any_run_measured_the_wall_time_comes_from_the_gpu_table_for_this_gpu(tmp_path, capsys, monkeypatch):
    gpu, speed = "NVIDIA H100 80GB HBM3", 300_000.0  # the GPU's tokens/s with two ECD runs sharing it
    row = {"gpu": gpu, "preset": "gpt2-124m", "optimizer": "ecd", "batch_tokens": 4096, "compile_mode": "default",
           "runs_per_gpu": 2, "tokens_per_s": speed, "step_ms": 27.3, "source": "a test row"}
    monkeypatch.setattr("grid.estimate.read_rows", lambda: [row])
    args = ["--grid", str(ROOT / "grids" / "table2.toml"), "--run-dir", str(tmp_path), "--dry-run", "--gpus",
            "0,1,2", "--runs-per-gpu", "2", "--gpu-memory", "80"]
    for name, expected in ((gpu, "from bench/throughput.json's tokens/s on " + gpu), ("another GPU", "tokens / R")):
        monkeypatch.setattr("grid.__main__.gpu_name", lambda name=name: name)
        assert grid_main(args) == 0
        assert expected in capsys.readouterr().out
    monkeypatch.setattr("grid.__main__.gpu_name", lambda: gpu)
    assert grid_main(args) == 0
    seconds = 2 * PAPER_TOKENS / (speed / 2)  # 8 runs on 6 slots: the busiest slot trains two, at half the GPU each
    assert f"expected wall time: {format_duration(seconds)} (8 runs on 6 GPU slots" in capsys.readouterr().out
