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
              val_tokens: int = 32768, flags: tuple = (), finished: bool = True) -> Path:
    """A finished run directory of 10 steps whose config.json records `data` (its fingerprint and shards) and whose
    log.jsonl's least validation loss is `best` (the log stops at step 5 when not `finished`)."""
    config = train_gpt.parse_config(["--optimizer", "adamw", "--bias-mode", bias, "--seed", str(seed), "--steps", "10",
                                     "--val-tokens", str(val_tokens), "--train-files", f"/{data}/x_train_*.bin",
                                     *flags])
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
    log = log if finished else [log[0], {"step": 5, "tokens": 5, "train_loss": 10.0}]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return run


def pivot_rows(out: Path) -> dict[str, list[str]]:
    """The least-validation-loss table of out/compare.md: {row name: its other cells}."""
    lines = (out / "compare.md").read_text().split("## Least validation loss", 1)[1].splitlines()
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
    assert all(cell["n"] == 1 for row in result["pivots"]["least_val_loss"]["rows"] for cell in row["cells"].values())
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
    cell = result["pivots"]["least_val_loss"]["rows"][0]["cells"]["none"]
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
    delta = result["pivots"]["least_val_loss"]["rows"][0]["cells"]["bqbv"]["delta"]
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


def test_unfinished_and_diverged_runs_are_left_out_of_every_table_and_named(tmp_path, capsys):
    """A run interrupted at step 5 (its least validation loss the untrained step-0 one) and a run whose loss went NaN
    are no seeds: the cell holds the two finished runs, the page names the others with the reason."""
    runs = [write_run(tmp_path, "s1", "none", 1, 10.0), write_run(tmp_path, "s2", "none", 2, 10.4),
            write_run(tmp_path, "cut", "none", 3, 9.0, finished=False), write_run(tmp_path, "nan", "none", 4, math.nan)]
    result = compare.main([*map(str, runs), "--out", str(tmp_path / "cmp")])
    cell = result["pivots"]["least_val_loss"]["rows"][0]["cells"]["none"]
    assert cell["n"] == 2 and cell["mean"] == pytest.approx(10.2)
    assert {r["run"]: r["outcome"] for r in result["left_out"]} == {"cut": "unfinished", "nan": "diverged"}
    page = (tmp_path / "cmp" / "compare.md").read_text()
    assert "- cut: did not finish (step 5 of 10" in page and "- nan: diverged at step 10 (val_loss)" in page
    assert "compare: left out cut: did not finish" in capsys.readouterr().out


def test_a_symmetric_run_is_the_baseline_of_every_bias_setting_of_its_condition(tmp_path):
    """One notion of a cell (eval.samples.cell_settings, the scorecard's too): a symmetric run computes the same
    whatever its --mean-v, so it is one row with the b_Q + b_V runs at μ_V 0 and at 0.5, and the baseline of both."""
    runs = [write_run(tmp_path, "sym", "none", 1, 10.0, flags=("--mean-v", "0.5")),
            write_run(tmp_path, "v00", "bqbv", 1, 9.5, flags=("--mean-v", "0")),
            write_run(tmp_path, "v05", "bqbv", 1, 9.0, flags=("--mean-v", "0.5"))]
    result = compare.main([*map(str, runs), "--out", str(tmp_path / "cmp")])
    assert {r["run"]: r["baseline"] for r in result["runs"]} == {"sym": None, "v00": "sym", "v05": "sym"}
    table = result["pivots"]["least_val_loss"]
    assert table["columns"] == ["none", "bqbv, mean-v 0.0", "bqbv, mean-v 0.5"] and len(table["rows"]) == 1
    cells = table["rows"][0]["cells"]
    assert [cells[c]["delta"]["delta"] for c in table["columns"][1:]] == pytest.approx([-0.5, -1.0])
    header = (tmp_path / "cmp" / "compare.md").read_text().split("## Least validation loss", 1)[1].split("\n")[2]
    assert "| b_Q + b_V (bqbv), mean-v 0.0 | Δ b_Q + b_V, mean-v 0.0 |" in header and "Δ b_Q + b_V, mean-v 0.5" in header


def test_one_name_per_statistic_on_every_page(tmp_path):
    """The best validation loss is the least single-batch estimate and the least validation loss the least
    fixed-budget loss, under those names in compare.md, report.md and the scorecard."""
    from eval import paper_run, report
    from run.log import read_log

    run = write_run(tmp_path, "run", "none", 1, 9.3195)
    with open(run / "log.jsonl", "a") as log:  # the single-batch estimates a run logs beside the fixed budget
        log.write(json.dumps({"step": 10, "val_loss_batch": 9.3656, "best_val_loss_batch": 9.3656}) + "\n")
        log.write(json.dumps({"summary": True, "step": 10, "tokens": 10, "best_val_loss_batch": 9.3656}) + "\n")
    result = compare.main([str(run), "--out", str(tmp_path / "cmp")])
    row = result["runs"][0]
    assert (row["best_val_loss"], row["least_val_loss"]) == (9.3656, 9.3195)
    page = (tmp_path / "cmp" / "compare.md").read_text()
    best = page.split("## Best validation loss", 1)[1].split("##", 1)[0]
    least = page.split("## Least validation loss", 1)[1].split("##", 1)[0]
    assert "| 9.3656 |" in best and "| 9.3195 |" in least
    summary = report.training_summary(read_log(run))
    assert (summary["best_val_loss"], summary["least_val_loss"]) == (9.3656, 9.3195)
    assert paper_run.METRICS["best_val_loss"].label == "best validation loss"
    assert paper_run.METRICS["best_val_loss"].read(paper_run.ScoredRun.read(run)) == 9.3656


def test_the_grids_report_leaves_out_its_unfinished_runs_and_says_why(tmp_path, monkeypatch):
    from grid import report

    runs = [write_run(tmp_path / "g", "a", "none", 1, 10.0), write_run(tmp_path / "g", "b", "none", 2, 10.4)]
    write_run(tmp_path / "g", "cut", "none", 3, 9.0, finished=False)
    monkeypatch.setattr(report, "report_runs", lambda *args: ([], False))  # the runs' own reports: not needed here
    assert report.report_grid(tmp_path / "g", runs, [], ["cut", "refused"], []) == 0
    page = (tmp_path / "g" / "compare.md").read_text()
    assert pivot_rows(tmp_path / "g")["adamw"][0] == "10.2000 ± 0.2828 (n = 2)"
    assert "- cut: did not finish (step 5 of 10" in page
    assert "Runs of the grid that never started (no config.json): `refused`" in page
