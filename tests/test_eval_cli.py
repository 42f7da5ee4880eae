"""Every eval CLI end to end on tiny checkpoints made here: valid JSON, PNG and Markdown outputs."""
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
from data.shards import write_shard
from eval import alignment, compare, dynamics, logic_puzzles, report, val_loss
from eval.alignment import residual_keys
from optim import OPTIMIZERS
from optim.torch_optimizers import AdamWConfig
from run.checkpoint import save_checkpoint, training_checkpoint
from tests.helpers import ROOT, tiny_gpt
from variants import ResearchConfig

pytestmark = pytest.mark.slow  # every evaluation on two 50304-token models: ~12 s

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(root, name: str, bias_mode: str, val_file) -> Path:
    """A run directory with config.json, log.jsonl and two checkpoints (AdamW state) of a tiny 50304-vocab model."""
    model = tiny_gpt(0, vocab_size=50304, block_size=64, n_embd=64, bias_mode=bias_mode)
    hp = train_gpt.TrainConfig(train_files=str(val_file), val_files=str(val_file), seq_len=32, micro_batch=2,
                               val_tokens=256, seed=7, steps=2)
    cfg = RunConfig(model.config, hp, ResearchConfig(), AdamWConfig(lr=1e-3))
    saved = cfg.to_dict()
    opt = OPTIMIZERS["adamw"].build(model, cfg.optim)
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(saved))
    tokens = torch.from_numpy(np.fromfile(val_file, dtype="<u2", offset=1024)[:33 * 4].astype(np.int64)).view(4, 33)
    log = []
    for step in (1, 2):
        opt.zero_grad()
        loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())[1]
        loss.backward()
        opt.step()
        log.append({"step": step, "train_loss": loss.item(), "val_loss": loss.item() + 0.1, "tokens": 128 * step,
                    "lr": 1e-3, "J_QK": 0.01 * step, "J_VO": 0.02 * step, "f_rot_QK": 0.1, "f_rot_VO": 0.2})
        state = {"model": model.state_dict(keep_vars=True), "optimizer": opt.state_dict(), "loader": {}, "rng": {},
                 "hooks": {}, "metrics": {"step": step, "tokens": 128 * step}}
        ckpt = training_checkpoint({**saved, "data": None, "preset": None, "attention": None}, state)
        save_checkpoint(run / "checkpoints" / f"step_{step:06d}.pt", ckpt)
    save_checkpoint(run / "checkpoints" / "latest.pt", ckpt)
    log.append({"summary": True, "step": 2, "tokens": 256})  # finished: eval.compare counts it
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return run


def check_outputs(folder, names: list[str]) -> None:
    for name in names:
        path = folder / name
        assert path.is_file(), f"missing {path}"
        if name.endswith(".json"):
            json.loads(path.read_text())
        elif name.endswith(".png"):
            assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 2000
        else:
            assert path.read_text().startswith("# ")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    val_file = root / "tiny_val_000000.bin"
    write_shard(val_file, np.random.default_rng(0).integers(0, 50257, 4096))
    broken, symmetric = make_run(root, "bqbv", "bqbv", val_file), make_run(root, "sym", "none", val_file)
    logic = ["--per-category", "12", "--batch-size", "8"]
    for run in (broken, symmetric):
        logic_puzzles.main(["--run", str(run)] + logic)
        alignment.main(["--run", str(run), "--residual-tokens", "256"])
    val_loss.main(["--run", str(broken)])
    dynamics.main(["--run", str(broken)])
    report.main(["--run", str(broken)])
    report.main(["--run", str(symmetric)])  # computes the missing val_loss and dynamics itself
    compare.main([str(broken), str(symmetric), "--out", str(root / "compare")])
    return root, broken, symmetric


def test_every_cli_writes_json_png_and_markdown(runs):
    root, broken, symmetric = runs
    for run in (broken, symmetric):
        check_outputs(run / "eval", [
            "val_loss.json", "val_loss.png", "val_loss.md", "logic_puzzles.json", "logic_puzzles.png",
            "logic_puzzles.md", "logic_generated_suite.json", "alignment.json", "alignment_raw.png", "alignment_ln.png",
            "alignment_residual.png", "alignment.md", "dynamics.json", "dynamics.png", "dynamics_training.png",
            "dynamics.md", "report.json", "report_loss.png"])
        check_outputs(run, ["report.md"])
        text = (run / "report.md").read_text()
        for png in ("val_loss.png", "logic_puzzles.png", "alignment_raw.png", "dynamics.png", "report_loss.png"):
            assert f"eval/{png}" in text
        statuses = json.loads((run / "eval" / "report.json").read_text())["evaluations"]
        assert statuses == {name: {"status": "current", "step": 2} for name in report.EVALUATIONS}
    check_outputs(root / "compare", ["compare.json", "compare.md", "compare_loss.png", "compare_enrichment.png"])


def test_results_are_consistent(runs):
    _, broken, symmetric = runs
    val = json.loads((broken / "eval" / "val_loss.json").read_text())
    assert val["tokens"] == 256 and 9 < val["val_loss"] < 12  # near ln(50304) for an untrained model
    logic = json.loads((broken / "eval" / "logic_puzzles.json").read_text())
    assert [s["name"] for s in logic["suites"]] == ["fixed", "generated-seed0"]
    assert logic["suites"][1]["overall"]["n"] == 72
    align = json.loads((broken / "eval" / "alignment.json").read_text())["modes"]
    assert set(align) == {"raw", "ln", "residual"}
    assert align["raw"]["vocab"] == 50257 and align["residual"]["vocab"] < 4096
    dyn = json.loads((broken / "eval" / "dynamics.json").read_text())
    assert [c["step"] for c in dyn["checkpoints"]] == [1, 2]  # latest.pt duplicates step 2
    assert len(dyn["weight_drift"]) == 1 and len(dyn["online"]) == 2
    assert all(0 <= c["summary"]["f_rot_QK"] <= 1 for c in dyn["checkpoints"])
    cmp = json.loads((runs[0] / "compare" / "compare.json").read_text())
    rows = {r["run"]: r for r in cmp["runs"]}
    assert rows["bqbv"]["baseline"] == "sym" and rows["sym"]["baseline"] is None
    expected = 100 * (rows["bqbv"]["top5"] - rows["sym"]["top5"])
    assert rows["bqbv"]["delta_top5"] == pytest.approx(expected)


def test_residual_keys_are_per_token_means_of_layer_keys(runs):
    root, broken, _ = runs
    model = train_gpt.model_from_checkpoint(broken / "checkpoints" / "latest.pt")
    files = str(root / "tiny_val_000000.bin")
    means, counts = residual_keys(model, files, 128, 32, 2, torch.device("cpu"))
    tokens = torch.from_numpy(np.fromfile(files, dtype="<u2", offset=1024)[:129].astype(np.int64))
    x = tokens[:128].view(4, 32)  # validation rows: starts 0, 32, ... reading T + 1 tokens
    assert int(counts.sum()) == 128
    with torch.no_grad():
        h0 = model.transformer.wte(x) + model.transformer.wpe(torch.arange(32))
        k0 = model.transformer.h[0].attn.c_attn(model.transformer.h[0].ln_1(h0))[..., 64:128].reshape(-1, 64)
    token = int(x[0, 5])
    assert torch.allclose(means[0, token], k0[x.reshape(-1) == token].mean(0), atol=1e-5)


def test_pearson_and_fisher_interval_reproduce_the_paper():
    g = np.random.default_rng(0)
    x, y = g.normal(size=11).tolist(), g.normal(size=11).tolist()
    assert compare.pearson(x, y)["r"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    # arXiv 2601.22257: r = 0.72 with n = 11 -> 95% CI [+0.21, +0.92]; r = 0.76, n = 8 -> [+0.12, +0.95]
    for r, n, lo, hi in ((0.72, 11, 0.21, 0.92), (0.76, 8, 0.12, 0.95)):
        t = np.linspace(-1, 1, n)
        noise = np.resize([1.0, -1.0], n) * 0.3
        noise -= noise.mean() + (noise @ t) / (t @ t) * t  # orthogonal to t and to constants
        y = r * t / t.std() + np.sqrt(1 - r * r) * noise / noise.std()
        out = compare.pearson(t.tolist(), y.tolist())
        assert out["r"] == pytest.approx(r, abs=1e-9)
        assert out["ci"][0] == pytest.approx(lo, abs=0.01) and out["ci"][1] == pytest.approx(hi, abs=0.01)


def test_module_entry_point_and_clear_errors(runs, tmp_path):
    _, broken, _ = runs
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "eval.val_loss", "--checkpoint",
                             str(broken / "checkpoints" / "step_000001.pt"), "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "val_loss.json").read_text())["step"] == 1
    with pytest.raises(SystemExit, match="no checkpoint"):
        val_loss.main(["--run", str(tmp_path)])
    not_a_checkpoint = tmp_path / "notes.pt"
    not_a_checkpoint.write_text("not a checkpoint")
    with pytest.raises(SystemExit, match=r"notes\.pt: not a readable checkpoint"):
        val_loss.main(["--checkpoint", str(not_a_checkpoint)])


def test_an_exported_directory_is_evaluated_like_a_checkpoint(runs, tmp_path, capsys):
    """--checkpoint (or --run) takes a directory written by `python -m export to-hf`: it is read as a step-0
    checkpoint of its model and gets its own eval/; eval.dynamics, which needs optimizer state, says so."""
    import export
    from eval import structure

    root, broken, _ = runs
    exported = tmp_path / "exported"
    export.export_model(train_gpt.model_from_checkpoint(broken / "checkpoints" / "latest.pt"), exported)
    flags = ["--val-files", str(root / "tiny_val_000000.bin"), "--seq-len", "32", "--micro-batch", "2",
             "--val-tokens", "256"]
    result = val_loss.main(["--run", str(exported), *flags])
    check_outputs(exported / "eval", ["val_loss.json", "val_loss.png", "val_loss.md"])
    original = json.loads((broken / "eval" / "val_loss.json").read_text())
    assert result["step"] == 0 and result["checkpoint"]["path"] == str(exported / "model.safetensors")
    assert abs(result["val_loss"] - original["val_loss"]) < 0.05  # the 47 padded logits are gone from the softmax
    summary = structure.main(["--checkpoint", str(exported), "--out", str(tmp_path / "structure")])
    assert [c["step"] for c in summary["checkpoints"]] == [0]
    with pytest.raises(SystemExit, match="is an exported model, which keeps no optimizer state"):
        dynamics.main(["--checkpoint", str(exported)])
    index = report.main(["--checkpoint", str(exported), "--skip-missing"])
    assert index["evaluations"]["val_loss"] == {"status": "current", "step": 0}
    assert index["budget"] == "full"  # an exported model does not say how long it trained
    assert index["evaluations"]["dynamics"]["status"].startswith("not applicable: an exported model")
    with pytest.raises(SystemExit):
        val_loss.main(["--run", str(broken), "--checkpoint", str(exported)])
    assert "--checkpoint / --run given twice" in capsys.readouterr().err


def test_an_exported_model_is_validated_within_its_block_size(runs, tmp_path, capsys):
    """An exported directory records no run: its sequence length defaults to its block size (64 here) rather than
    the trainer's default 512; a --seq-len beyond the block size, or shards too small for the budget, are one line."""
    import export

    root, broken, _ = runs
    exported = tmp_path / "exported"
    export.export_model(train_gpt.model_from_checkpoint(broken / "checkpoints" / "latest.pt"), exported)
    data = ["--val-files", str(root / "tiny_val_000000.bin"), "--micro-batch", "2"]
    result = val_loss.main(["--run", str(exported), *data, "--val-tokens", "256"])
    assert result["tokens"] == 256 and result["seq_len"] == 64
    with pytest.raises(SystemExit) as excinfo:
        val_loss.main(["--run", str(exported), *data, "--val-tokens", "256", "--seq-len", "512"])
    assert excinfo.value.code == 2
    assert "--seq-len 512: the model reads 1 to 64 positions (its block size); give --seq-len 64 or less" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit, match=r"error: val shards .* hold 63 sequences .* lower --val-tokens"):
        val_loss.main(["--run", str(exported), *data, "--val-tokens", str(64 * 100)])


@pytest.mark.parametrize("damage, problem", [("{", "not valid JSON (Expecting property name enclosed in double "
                                                   "quotes)"), ("[1]", "holds a JSON list, not a run's configuration")])
def test_a_damaged_run_config_is_one_line_naming_the_file_before_any_evaluation(runs, tmp_path, damage, problem):
    _, broken, _ = runs
    run = tmp_path / "damaged"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.json", "log.jsonl", "checkpoints/latest.pt"):
        (run / name).write_bytes((broken / name).read_bytes())
    (run / "config.json").write_text(damage)
    message = f"error: {run / 'config.json'}: {problem}; it is damaged: restore it, or move it away"
    with pytest.raises(SystemExit, match=re.escape(message)):
        compare.main([str(run), "--out", str(tmp_path / "cmp")])
    with pytest.raises(SystemExit, match=re.escape(message)):
        report.main(["--run", str(run)])
    assert not (run / "eval" / "manifest.json").exists()  # no evaluation ran first
