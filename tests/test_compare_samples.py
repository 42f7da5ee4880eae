"""eval.compare's runs as samples (docs/evaluation.md#comparing-runs): runs trained or validated on other data are
rows of their own with the reason, never averaged; two runs of one seed are one sample; Δ carries its standard
error, paired by seed where the seeds match; the grid calls the comparison as a function."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

import train_gpt
from eval import compare
from eval.samples import difference

FINGERPRINTS = {"one": "1111111111111111", "other": "2222222222222222"}


def write_run(root: Path, name: str, bias: str, seed: int, best: float, data: str = "one",
              val_tokens: int = 32768) -> Path:
    """A run directory whose config.json records `data` (its fingerprint and shards) and whose log.jsonl's least
    validation loss is `best`."""
    config = train_gpt.parse_config(["--optimizer", "adamw", "--bias-mode", bias, "--seed", str(seed),
                                     "--val-tokens", str(val_tokens), "--train-files", f"/{data}/x_train_*.bin"])
    files = {split: {"given": "", "pattern": f"/{data}/x_{split}_*.bin", "tokens": 1000,
                     "files": [{"path": f"/{data}/x_{split}_000000.bin", "tokens": 1000, "sha256": data * 8}]}
             for split in ("train", "val")}
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({**config.to_dict(), "data": {**files,
                                                                               "fingerprint": FINGERPRINTS[data]}}))
    log = [{"step": 0, "tokens": 0, "val_loss": 11.0, "val_step": 0},
           {"step": 10, "tokens": 10, "val_loss": best, "val_step": 10},
           {"summary": True, "step": 10, "tokens": 10, "val_loss": best, "val_step": 10}]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return run


def pivot_rows(out: Path) -> dict[str, list[str]]:
    """The best-validation-loss table of out/compare.md: {row name: its other cells}."""
    lines = (out / "compare.md").read_text().split("## Best validation loss", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start + 2:end]]
    return {row[0]: row[1:] for row in rows}


def test_runs_on_other_data_are_rows_of_their_own_with_the_reason_never_averaged(tmp_path, capsys):
    same = write_run(tmp_path, "one", "none", 1, 10.0)
    other = write_run(tmp_path, "otherdata", "none", 2, 11.0, data="other")
    result = compare.main([str(same), str(other), "--out", str(tmp_path / "cmp")])
    rows = pivot_rows(tmp_path / "cmp")
    assert set(rows) == {f"adamw, data {FINGERPRINTS['one']}", f"adamw, data {FINGERPRINTS['other']}"}
    assert [rows[f"adamw, data {FINGERPRINTS[d]}"][0] for d in ("one", "other")] == ["10.0000", "11.0000"]
    assert all(cell["n"] == 1 for row in result["pivots"]["best_val_loss"]["rows"] for cell in row["cells"].values())
    page = (tmp_path / "cmp" / "compare.md").read_text()
    assert "differ in their data" in page and f"{FINGERPRINTS['other']}: train /other/x_train_*.bin" in page


def test_a_different_validation_budget_is_a_row_of_its_own(tmp_path):
    runs = [write_run(tmp_path, "a", "none", 1, 10.0), write_run(tmp_path, "b", "none", 2, 10.5, val_tokens=4096)]
    compare.main([*map(str, runs), "--out", str(tmp_path / "cmp")])
    assert set(pivot_rows(tmp_path / "cmp")) == {"adamw, val-tokens 32768", "adamw, val-tokens 4096"}


def test_the_same_seed_twice_is_one_sample(tmp_path):
    runs = [write_run(tmp_path, "s1", "none", 1, 10.0), write_run(tmp_path, "s1-again", "none", 1, 10.2),
            write_run(tmp_path, "s2", "none", 2, 11.0)]
    result = compare.main([*map(str, runs), "--out", str(tmp_path / "cmp")])
    cell = result["pivots"]["best_val_loss"]["rows"][0]["cells"]["none"]
    seed_values = [statistics.fmean([10.0, 10.2]), 11.0]  # seed 1's two runs are one value
    assert cell["n"] == 2 and cell["runs"] == 3 and cell["repeated_seeds"] == [1]
    assert cell["mean"] == pytest.approx(statistics.fmean(seed_values))
    assert cell["std"] == pytest.approx(statistics.stdev(seed_values))
    assert "seed 1 more than once: one sample" in pivot_rows(tmp_path / "cmp")["adamw"][0]


def test_delta_is_paired_by_seed_with_its_standard_error(tmp_path):
    base = {1: 10.0, 2: 11.0, 3: 10.4}
    broken = {1: 9.5, 2: 10.8, 3: 9.7}
    runs = [write_run(tmp_path, f"{b}-{s}", b, s, v) for b, values in (("none", base), ("bqbv", broken))
            for s, v in values.items()]
    result = compare.main([*map(str, runs), "--out", str(tmp_path / "cmp")])
    diffs = [broken[s] - base[s] for s in base]
    delta = result["pivots"]["best_val_loss"]["rows"][0]["cells"]["bqbv"]["delta"]
    assert delta["paired"] and delta["delta"] == pytest.approx(statistics.fmean(diffs))
    assert delta["se"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(3))
    assert pivot_rows(tmp_path / "cmp")["adamw"][2] == f"{statistics.fmean(diffs):+.4f} ± " \
        f"{statistics.stdev(diffs) / math.sqrt(3):.4f} (paired, n = 3)"


def test_delta_over_different_seeds_is_unpaired():
    treatment, baseline = {1: 2.0, 2: 4.0}, {3: 1.0, 4: 1.5, 5: 2.5}
    d = difference(treatment, baseline)
    se = math.sqrt(statistics.variance([2.0, 4.0]) / 2 + statistics.variance([1.0, 1.5, 2.5]) / 3)
    assert not d.paired and d.counts == (2, 3)
    assert d.delta == pytest.approx(3.0 - statistics.fmean([1.0, 1.5, 2.5])) and d.se == pytest.approx(se)
    assert difference({1: 2.0}, {1: 1.0}).se is None  # one seed: no spread to give


def test_a_directory_of_runs_stands_for_its_runs(tmp_path):
    grid = tmp_path / "grid"
    runs = [write_run(grid, "a", "none", 1, 10.0), write_run(grid, "b", "none", 2, 10.4)]
    (grid / "logs").mkdir()
    result = compare.main([str(grid), "--out", str(tmp_path / "cmp")])
    assert [r["path"] for r in result["runs"]] == [str(r) for r in runs]


def test_the_grid_calls_the_comparison_and_the_scorecard_as_functions(tmp_path, monkeypatch):
    from grid import report

    runs = [write_run(tmp_path / "g", "a", "none", 1, 10.0), write_run(tmp_path / "g", "b", "bqbv", 1, 9.0)]
    monkeypatch.setattr(report, "report_runs", lambda *args: ([], False))  # the runs' own reports: not needed here
    monkeypatch.setattr(compare, "main", lambda argv=None: pytest.fail(f"eval.compare.main({argv}) called"))
    assert report.report_grid(tmp_path / "g", runs, [], [], []) == 0
    assert pivot_rows(tmp_path / "g")["adamw"][:2] == ["10.0000", "9.0000"]
    assert not (tmp_path / "g" / "scorecard.md").exists()  # seed 1 is no seed of the paper's tables
