"""eval.report and the outputs' checkpoint records (docs/evaluation.md#outputs-and-reports): stale outputs rerun,
every failure printed with a non-zero exit, only written files linked, the step in every table (report, compare)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt
from config import RunConfig
from data.shards import sha256_file, write_shard
from eval import compare, logic_puzzles, outputs, report, val_loss
from optim import OPTIMIZERS
from optim.torch_optimizers import AdamWConfig
from run.checkpoint import load_checkpoint, save_checkpoint, training_checkpoint, weights_checkpoint
from tests.helpers import ROOT, tiny_gpt
from variants import ResearchConfig

pytestmark = pytest.mark.slow  # reports on tiny runs, one in a fresh interpreter: ~12 s

# Flags that keep every evaluation a second or two on the tiny model.
FAST_FLAGS = {"logic_puzzles": ["--per-category", "1"], "alignment": ["--modes", "raw"]}


def tiny_run(root: Path, name: str, val_file: Path, steps: tuple[int, ...] = (1, 2),
             optimizer_state: bool = True) -> Path:
    """A run directory (config.json, log.jsonl, step_XXXXXX.pt per step and latest.pt) of a 1-layer, 32-wide model
    trained a step with AdamW between checkpoints."""
    model = tiny_gpt(0, vocab_size=50304, block_size=64, n_layer=1, bias_mode="bqbv")
    hp = train_gpt.TrainConfig(train_files=str(val_file), val_files=str(val_file), seq_len=32, micro_batch=2,
                               val_tokens=128, seed=7, steps=max(steps))
    cfg = RunConfig(model.config, hp, ResearchConfig(), AdamWConfig(lr=1e-3))
    opt = OPTIMIZERS["adamw"].build(model, cfg.optim)
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    tokens = torch.from_numpy(np.fromfile(val_file, dtype="<u2", offset=1024)[:66].astype(np.int64)).view(2, 33)
    log = []
    for step in steps:
        loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        log.append({"step": step, "train_loss": loss.item(), "tokens": 64 * step})
        save_step(run, model, opt if optimizer_state else None, cfg.to_dict(), step)
    log.append({"summary": True, "step": max(steps), "tokens": 64 * max(steps)})  # finished: eval.compare counts it
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return run


def save_step(run: Path, model: train_gpt.GPT, opt: torch.optim.Optimizer | None, config: dict, step: int) -> None:
    """checkpoints/step_<step>.pt and latest.pt of `model` at `step`."""
    config, metrics = {**config, "data": None, "preset": None, "attention": None}, {"step": step, "tokens": 64 * step}
    ckpt = training_checkpoint(config, {"model": model.state_dict(keep_vars=True), "optimizer": opt.state_dict(),
                                        "loader": {}, "rng": {}, "hooks": {}, "metrics": metrics}) if opt else (
        weights_checkpoint(model, config, metrics))
    save_checkpoint(run / "checkpoints" / f"step_{step:06d}.pt", ckpt)
    save_checkpoint(run / "checkpoints" / "latest.pt", ckpt)


@pytest.fixture
def val_file(tmp_path) -> Path:
    path = tmp_path / "tiny_val_000000.bin"
    write_shard(path, np.random.default_rng(0).integers(0, 50257, 4096))
    return path


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """Make report's evaluations fast (FAST_FLAGS) and record which ran, in order."""
    ran: list[str] = []

    def wrap(name, evaluate):
        def run(argv):
            ran.append(name)
            return evaluate(argv + FAST_FLAGS.get(name, []))
        return run
    monkeypatch.setattr(report, "EVALUATIONS", {name: wrap(name, f) for name, f in report.EVALUATIONS.items()})
    return ran


def table(markdown: str, heading: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first Markdown table after `heading`."""
    lines = markdown.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start + 2:end]]


def linked_files(run: Path) -> list[Path]:
    return [run / link for link in re.findall(r"\]\(([^)]+)\)", (run / "report.md").read_text())]


def test_outputs_record_the_checkpoint_and_report_reruns_when_it_changes(tmp_path, val_file, calls, monkeypatch):
    run = tiny_run(tmp_path, "run", val_file)
    step1 = run / "checkpoints" / "step_000001.pt"
    val_loss.main(["--checkpoint", str(step1)])  # step-1 result in the run's eval/ (what misled the old report)
    recorded = json.loads((run / "eval" / "val_loss.json").read_text())["checkpoint"]
    assert recorded == {"path": str(step1), "step": 1, "sha256": sha256_file(step1)}

    hashed = []
    monkeypatch.setattr(outputs, "sha256_file", lambda path: hashed.append(path) or sha256_file(path))
    outputs._sha256_of_version.cache_clear()
    report.main(["--run", str(run)])
    assert calls == ["val_loss", "logic_puzzles", "alignment", "dynamics"]  # val_loss: stale, the rest: missing
    assert len(hashed) == 1  # latest.pt, once for the report and its four evaluations
    assert json.loads((run / "eval" / "val_loss.json").read_text())["step"] == 2
    text = (run / "report.md").read_text()
    assert [row[:2] for row in table(text, "## Evaluations")] == [
        ["val_loss", "2"], ["logic_puzzles", "2"], ["alignment", "2"], ["dynamics", "2"]]
    assert all(row[3] == "current" for row in table(text, "## Evaluations"))
    assert all(path.is_file() for path in linked_files(run)) and len(linked_files(run)) >= 10

    calls.clear()
    report.main(["--run", str(run)])
    assert calls == []  # everything is current

    ckpt = load_checkpoint(run / "checkpoints" / "latest.pt")
    model = train_gpt.model_from_checkpoint(ckpt)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(1.5)
    save_step(run, model, None, ckpt["config"], 3)  # no optimizer state: dynamics must fail on it
    with pytest.raises(SystemExit) as failed:
        report.main(["--run", str(run)])
    assert failed.value.code not in (0, None)
    assert calls == ["val_loss", "logic_puzzles", "alignment", "dynamics"]
    text = (run / "report.md").read_text()
    rows = table(text, "## Evaluations")
    assert [row[:2] for row in rows[:3]] == [["val_loss", "3"], ["logic_puzzles", "3"], ["alignment", "3"]]
    assert rows[3][1] == "-" and "holds no optimizer state" in rows[3][3]
    assert "dynamics.md" not in text and "dynamics.png" not in text  # step-2 outputs are not shown as step 3
    assert table(text, "## Logic puzzles")[0][1] == "3"
    assert all(path.is_file() for path in linked_files(run))

    out = tmp_path / "compare"
    result = compare.main([str(run), "--out", str(out)])
    assert result["runs"][0]["steps"] == {"val_loss": 3, "logic_puzzles": 3, "alignment": 3}
    assert table((out / "compare.md").read_text(), "## Runs")[0][:2] == ["run", "3"]

    val_loss.main(["--checkpoint", str(step1)])
    compare.main([str(run), "--out", str(out)])
    assert table((out / "compare.md").read_text(), "## Runs")[0][1] == (
        "val_loss 1, logic_puzzles 3, alignment 3")


def test_report_prints_every_failure_writes_the_rest_and_exits_non_zero(tmp_path, val_file, monkeypatch, capsys):
    run = tiny_run(tmp_path, "run", val_file, steps=(1,))

    def broken_logic(argv):
        raise ValueError("'yerr' must not contain negative values")

    def broken_alignment(argv):
        raise SystemExit("error: --val-files: no such shards")
    monkeypatch.setattr(report, "EVALUATIONS", {"val_loss": val_loss.main, "logic_puzzles": broken_logic,
                                                "alignment": broken_alignment,
                                                "dynamics": report.EVALUATIONS["dynamics"],
                                                "silent": lambda argv: None})  # records nothing
    (run / "eval").mkdir()
    (run / "eval" / "logic_puzzles.md").write_text("# from an older version, unrecorded\n")
    with pytest.raises(SystemExit) as failed:
        report.main(["--run", str(run)])
    assert "3 of 5 evaluations failed (logic_puzzles, alignment, silent)" in str(failed.value.code)
    err = capsys.readouterr().err
    assert "eval.silent failed: it ran but left no outputs recorded for this checkpoint (not computed" in err
    assert "eval.logic_puzzles failed: ValueError: 'yerr' must not contain negative values" in err
    assert "eval.alignment failed: SystemExit: error: --val-files: no such shards" in err
    text = (run / "report.md").read_text()
    assert "logic_puzzles.md" not in text and "alignment" not in "".join(re.findall(r"\]\(([^)]+)\)", text))
    assert "failed: ValueError: 'yerr' must not contain negative values" in text
    assert (run / "eval" / "val_loss.md").is_file() and "eval/val_loss.md" in text and "eval/dynamics.png" in text
    index = json.loads((run / "eval" / "report.json").read_text())
    assert set(index["failures"]) == {"logic_puzzles", "alignment", "silent"}
    assert index["evaluations"]["val_loss"] == {"status": "current", "step": 1}


def test_report_command_exits_1_naming_the_failed_module(tmp_path, val_file):
    run = tiny_run(tmp_path, "run", val_file, steps=(1,), optimizer_state=False)
    for name in ("val_loss", "logic_puzzles", "alignment"):  # current outputs: the command runs only dynamics
        report.EVALUATIONS[name](["--run", str(run)] + FAST_FLAGS.get(name, []))
    result = subprocess.run([sys.executable, "-m", "eval.report", "--run", str(run)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "eval.dynamics failed: SystemExit: error: " in result.stderr
    assert ".pt: a checkpoint of kind weights holds no optimizer state" in result.stderr
    assert "1 of 4 evaluations failed (dynamics)" in result.stderr
    assert (run / "report.md").is_file()


def test_wilson_failure_mode_is_gone_for_logic_scoring_zero(tmp_path, val_file):
    """A score of 0 out of 11 (the old interval's lower bound was a hair above 0 there) plots and reports."""
    run = tiny_run(tmp_path, "run", val_file, steps=(1,))
    items = [{"id": f"z{i}", "category": "copy", "prompt": f"Say: {i} {i}.", "expected": " photograph"}
             for i in range(11)]
    suite = tmp_path / "zero.json"
    suite.write_text(json.dumps({"name": "zero", "items": items}))
    result = logic_puzzles.main(["--run", str(run), "--suite", str(suite), "--no-generated"])
    overall = result["suites"][0]["overall"]
    assert overall["n"] == 11 and overall["top5"] == 0.0 and overall["top5_ci"][0] == 0.0
    assert outputs.stale_reason(run / "eval", "logic_puzzles", result["checkpoint"]) is None


def test_report_budget_follows_the_run_with_progress_and_a_full_report_reruns_quick_outputs(tmp_path, val_file,
                                                                                          monkeypatch, capsys):
    run = tiny_run(tmp_path, "run", val_file, steps=(1,))
    argvs: dict[str, list[list[str]]] = {}

    def wrap(name, evaluate):
        def recorded(argv):
            argvs.setdefault(name, []).append(argv)
            return evaluate(argv + FAST_FLAGS.get(name, []))
        return recorded
    monkeypatch.setattr(report, "EVALUATIONS", {name: wrap(name, f) for name, f in report.EVALUATIONS.items()})
    assert report.main(["--run", str(run)])["budget"] == "quick"  # 64 tokens trained
    assert argvs["logic_puzzles"][0][-2:] == ["--per-category", "25"]
    assert argvs["alignment"][0][-2:] == ["--residual-tokens", "32768"]
    out = capsys.readouterr().out
    assert "run, step 1: 4 of 4 evaluations to run, quick budget (the run trained 64 tokens" in out
    assert "report: [1/4] eval.val_loss (not computed) ..." in out
    assert re.search(r"report: \[4/4\] eval\.dynamics done in \d+\.\ds", out)
    assert "Evaluation budget: **quick**" in (run / "report.md").read_text()
    argvs.clear()
    report.main(["--run", str(run), "--full"])
    assert sorted(argvs) == ["alignment", "logic_puzzles"]  # the quick outputs, nothing else
    assert "--per-category" not in argvs["logic_puzzles"][0]
    assert "report: [1/2] eval.logic_puzzles (computed with the quick budget) ..." in capsys.readouterr().out
    argvs.clear()
    report.main(["--run", str(run)])
    assert argvs == {}  # full outputs stand for a quick report
    assert report.choose_budget(False, False, 20_000_000)[0] == "full"
    assert report.choose_budget(False, False, None)[0] == "full"  # an exported model: its training is unknown


def test_an_interrupted_report_leaves_a_page_with_what_was_done(tmp_path, val_file, monkeypatch, capsys):
    run = tiny_run(tmp_path, "run", val_file, steps=(1,))

    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setattr(report, "EVALUATIONS", {**report.EVALUATIONS, "logic_puzzles": interrupted})
    with pytest.raises(SystemExit) as stopped:
        report.main(["--run", str(run)])
    assert stopped.value.code == 130
    assert f"interrupted during eval.logic_puzzles; {run / 'report.md'} shows what was done" in capsys.readouterr().err
    text = (run / "report.md").read_text()
    rows = {row[0]: row for row in table(text, "## Evaluations")}
    assert rows["val_loss"][3] == "current" and "**Validation loss" in text
    assert rows["logic_puzzles"][3] == rows["dynamics"][3] == "interrupted: run the report again"
    assert json.loads((run / "eval" / "report.json").read_text())["evaluations"]["alignment"]["status"].startswith(
        "interrupted")


def fake_run(root: Path, name: str, optimizer: str, bias: str, seed: int, best: float,
             activation: str = "prelu") -> Path:
    """A run directory with config.json and an old-format log.jsonl (training records repeat the last validation
    loss) whose least measured validation loss is `best`; no checkpoint, no evaluation."""
    from config import RunConfig
    from variants import ResearchConfig

    cfg = RunConfig(train_gpt.GPTConfig(bias_mode=bias, activation=activation),
                    train_gpt.TrainConfig(optimizer=optimizer, seed=seed, steps=20), ResearchConfig(),
                    OPTIMIZERS[optimizer].config())
    run = root / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    log = [{"step": 0, "tokens": 0, "val_loss": 11.0, "val_step": 0},
           {"step": 5, "tokens": 500, "train_loss": 9.0, "val_loss": 11.0, "val_step": 0},
           {"step": 10, "tokens": 1000, "val_loss": best, "val_step": 10},
           {"step": 15, "tokens": 1500, "train_loss": best - 1, "val_loss": best, "val_step": 10},
           {"step": 20, "tokens": 2000, "val_loss": best + 0.5, "val_step": 20},
           {"summary": True, "step": 20, "tokens": 2000, "val_loss": best + 0.5, "val_step": 20}]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return run


def test_compare_pivots_optimizers_by_bias_mode_with_seed_statistics_and_names_missing_evaluations(tmp_path, capsys):
    best = {("adamw", "none"): (3.0, 3.2), ("adamw", "bqbv"): (2.5, 2.7), ("sgdm", "none"): (4.0, 4.0),
            ("sgdm", "bqbv"): (4.5, 4.1)}
    made = [fake_run(tmp_path, f"{o}-{b}-{seed}", o, b, seed, values[i])
            for (o, b), values in best.items() for i, seed in enumerate((1, 2))]
    gelu = fake_run(tmp_path, "adamw-none-gelu", "adamw", "none", 1, 2.0, activation="gelu")
    (made[0] / "checkpoints").mkdir()
    (made[0] / "checkpoints" / "latest.pt").write_bytes(b"")  # --checkpoint FILE names its run
    out = tmp_path / "cmp"
    (out).mkdir()
    (out / "compare_enrichment.png").write_bytes(b"from an earlier comparison")
    compare.main(["--checkpoint", str(made[0] / "checkpoints" / "latest.pt"), *(a for r in made[1:4] for a in
                  ("--run", str(r))), *map(str, made[4:]), str(gelu), "--out", str(out)])
    printed = capsys.readouterr().out
    text = (out / "compare.md").read_text()
    pivot = table(text, "## Least validation loss")
    assert [row[0] for row in pivot] == ["adamw, activation prelu", "sgdm, activation prelu", "adamw, activation gelu"]
    assert pivot[0][1:] == ["3.1000 ± 0.1414 (n = 2)", "2.6000 ± 0.1414 (n = 2)", "-0.5000 ± 0.0000 (paired, n = 2)"]
    assert pivot[1][1:] == ["4.0000 ± 0.0000 (n = 2)", "4.3000 ± 0.2828 (n = 2)", "+0.3000 ± 0.2000 (paired, n = 2)"]
    assert pivot[2][1:] == ["2.0000", "no run", "-"]
    assert "## Least validation loss" in printed and f"compare: wrote {out / 'compare.json'}" in printed
    rows = {row[0]: row for row in table(text, "## Runs")}
    assert rows["adamw-none-1"][4:8] == ["not in log.jsonl", "3.0000", "run eval.val_loss", "run eval.logic_puzzles"]
    assert rows["adamw-none-1"][11] == "run eval.alignment"
    assert not (out / "compare_enrichment.png").exists() and "compare_enrichment" not in text
    assert "## Logic puzzles" not in text
    with pytest.raises(SystemExit):
        compare.main(["--out", str(out)])
    assert "name the runs to compare" in capsys.readouterr().err
