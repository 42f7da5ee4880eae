"""The scorecard (docs/reproduce.md): fabricated run records against the published numbers give reproduced,
inconclusive, differs (reversed), diverged and not comparable by the documented rule; a claim needs its published
sign and an interval that excludes zero; per-seed cells take the per-seed spread; an unpaired Δ its own error; the
least of fewer seeds is noted; unfinished runs are left out and named, disagreeing runs of one seed named; not
comparable for each cause and for mixed runs (never averaged). The calibration of the rule: tests/test_calibration.py;
the published-data file's checks: tests/test_published_data.py."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from eval import compare, paper_data, paper_run, scorecard, verdicts
from tests.helpers import PROTOCOL, finished_run

TABLE2 = {"none": {42: 3.93, 83: 3.82, 123: 3.94, 789: 3.81}, "bqbv": {42: 3.37, 83: 3.40, 123: 3.37, 789: 3.40}}
def table2_runs(root: Path, **changes: float) -> list[Path]:
    """Table 2's eight runs with the published values, `changes` ({"none_789": value}) replacing some."""
    return [finished_run(root, f"{bias}-{seed}", "ecd", bias, seed, changes.get(f"{bias}_{seed}", value), mean_v=0.5)
            for bias, values in TABLE2.items() for seed, value in values.items()]


def gelu_runs(root: Path, sym: dict, broken: dict) -> list[Path]:
    """Table 23's GELU runs: symmetric and b_Q + b_V (μ_V = 0) at the seeds given ({seed: best validation loss}),
    b_Q only a nat worse (never the best of the three)."""
    return ([finished_run(root, f"g-none-{s}", "ecd", "none", s, v, gelu=True) for s, v in sym.items()]
            + [finished_run(root, f"g-v00-{s}", "ecd", "bqbv", s, v, gelu=True, mean_v=0.0) for s, v in broken.items()]
            + [finished_run(root, f"g-bq-{s}", "ecd", "bq", s, v + 1, gelu=True) for s, v in broken.items()])


def results(run_dirs: list[Path]) -> dict[tuple[str, str, str], scorecard.Result]:
    found = scorecard.score(paper_data.load_published(), [paper_run.ScoredRun.read(d) for d in run_dirs])
    return {(r.cell.table, r.cell.row, r.cell.column): r for r in found}


def page(found: dict) -> str:
    return scorecard.scorecard_markdown(paper_data.load_published(), list(found.values()), [], "test")


def test_a_faithful_table_2_is_reproduced_and_a_column_off_by_a_third_of_a_nat_differs(tmp_path):
    found = results(table2_runs(tmp_path / "paper"))
    assert {found["2", row, column].verdict for row in ("42", "83", "123", "789", "Mean")
            for column in ("Symmetric", "b_Q + b_V", "Δ")} == {"reproduced"}
    # Table 2's seeds 42 and 123 are Table 1's too; their spread is that of the four (one configuration)
    assert found["1", "ECD", "Symmetric"].verdict == "reproduced" and found["1", "ECD", "Symmetric"].n == 2
    assert found["1", "SGDM", "Symmetric"].verdict == "no run"
    assert found["1", "SGDM", "Symmetric"].reasons == ["grids/table1.toml trains it"]
    off = results(table2_runs(tmp_path / "off", **{f"none_{s}": v + 0.3 for s, v in TABLE2["none"].items()}))
    assert off["2", "42", "Symmetric"].verdict == "differs" and off["2", "Mean", "Symmetric"].verdict == "differs"
    assert off["2", "42", "Symmetric"].difference == pytest.approx(0.3)


def test_per_seed_cells_take_the_per_seed_spread_and_a_lone_seed_the_papers_std(tmp_path):
    """The four per-seed rows of Table 2 are judged with the spread of the column (the paper's Std row, ours over
    our seeds), not with the Mean's standard error; with one seed of ours, the paper's Std of the column alone."""
    found = results(table2_runs(tmp_path / "all"))
    ours = statistics.stdev(TABLE2["none"].values())
    cell = found["2", "83", "Symmetric"]
    assert cell.sd == pytest.approx(ours) and cell.spread == "ours over 4 seeds"
    df = verdicts.welch_df([(ours ** 2, 3), (0.07 ** 2, 3)])
    assert cell.half_width == pytest.approx(verdicts.quantile(df) * math.hypot(ours, 0.07))
    lone = results([finished_run(tmp_path / "one", "none-42", "ecd", "none", 42, 3.93, mean_v=0.5)])
    cell = lone["2", "42", "Symmetric"]
    assert cell.spread == "the paper's Std over 4 seeds" and cell.sd == 0.07
    assert cell.half_width == pytest.approx(verdicts.quantile(3) * 0.07 * math.sqrt(2))  # one spread: its df
    assert cell.verdict == "reproduced" and cell.resolution == 0.41  # the smallest effect Table 2 reports for it


def test_a_claim_needs_the_published_sign_and_an_interval_that_excludes_zero(tmp_path):
    """Table 2's Mean Δ (−0.49 ± 0.09) against per-seed Δs of +0.5, −0.5, +0.5, −0.5 (ours 0.00): inconclusive,
    with the seeds that would decide it; the GELU Mean Δ (−0.03 ± 0.018) against 0.00 ± 0.02: inconclusive."""
    flipped = {f"bqbv_{s}": TABLE2["none"][s] + (0.5 if i % 2 == 0 else -0.5) for i, s in enumerate(TABLE2["none"])}
    found = results(table2_runs(tmp_path / "t2", **flipped))
    claim = found["2", "Mean", "Δ"]
    assert claim.ours == pytest.approx(0) and claim.verdict == "inconclusive"
    assert any(note.endswith(f"seeds would decide it at our spread ({claim.sd:.3g})") for note in claim.notes)
    gelu = results(gelu_runs(tmp_path / "gelu", {42: 3.185, 83: 3.141, 789: 3.176},
                             {42: 3.185 + 0.02, 83: 3.141 - 0.02, 789: 3.176}))
    claim = gelu["23", "Mean", "GELU Δ"]
    assert claim.ours == pytest.approx(0) and claim.verdict == "inconclusive"
    assert claim.se == pytest.approx(math.sqrt(0.02 ** 2 / 3 + claim.se ** 2 - 0.02 ** 2 / 3))  # its own spread
    assert claim.sd == pytest.approx(0.02) and "selection alone gives" in " ".join(claim.notes)


def test_a_significant_delta_of_the_other_sign_is_reversed(tmp_path):
    """Ours +0.49 where the paper claims −0.49, at the published spreads: differs (reversed), never reproduced; the
    page says so and counts it."""
    reversed_ = {f"bqbv_{s}": TABLE2["none"][s] + 0.49 + (0.01 if s in (42, 123) else -0.01) for s in TABLE2["none"]}
    found = results(table2_runs(tmp_path, **reversed_))
    claim = found["2", "Mean", "Δ"]
    assert claim.verdict == "differs" and claim.reversed and claim.ours == pytest.approx(0.49)
    text = page(found)
    assert "**differs (reversed)**" in text and " reversed" in text.split("**The rule**")[0]


def test_table_1s_delta_is_not_reproduced_by_the_opposite_sign(tmp_path):
    """Table 1's ECD Δ (−0.58, the least of two seeds less the least of two) against ours +0.35 with a wide per-seed
    spread: not reproduced."""
    sides = {"none": {42: 3.60, 123: 4.60}, "bqbv": {42: 4.60, 123: 3.95}}
    runs = [finished_run(tmp_path, f"{b}-{s}", "ecd", b, s, v, mean_v=0.0) for b, values in sides.items()
            for s, v in values.items()]
    claim = results(runs)["1", "ECD", "Δ"]
    assert claim.ours == pytest.approx(0.35) and claim.verdict in ("inconclusive", "differs")


def test_the_least_of_each_side_without_a_published_spread_takes_each_sides_own(tmp_path):
    """Table 1's SGDM Δ (the least of two seeds less the least of two; no Std anywhere in the paper for SGDM): ours
    with each side's spread over our seeds and Welch's degrees of freedom, the paper's side the same."""
    sides = {"none": {42: 3.84, 123: 3.90}, "bqbv": {42: 3.67, 123: 3.70}}
    runs = [finished_run(tmp_path, f"{b}-{s}", "sgdm", b, s, v, mean_v=0.0) for b, values in sides.items()
            for s, v in values.items()]
    claim = results(runs)["1", "SGDM", "Δ"]
    variance = verdicts.least_of(2)[1]
    terms = [(variance * statistics.variance(values.values()), 1) for values in sides.values()]
    assert claim.ours == pytest.approx(3.67 - 3.84) and claim.se == pytest.approx(math.sqrt(sum(v for v, _ in terms)))
    assert claim.df == pytest.approx(verdicts.welch_df(terms))
    assert claim.half_width == pytest.approx(verdicts.quantile(verdicts.welch_df(terms)) * math.sqrt(2) * claim.se)


def test_an_unpaired_delta_uses_its_own_standard_error(tmp_path):
    """Table 2's Mean Δ with seed 42's b_Q + b_V run missing: the sides hold other seeds, so ours is unpaired, its
    error from each side's own spread; a Δ of −0.30 known to ±0.01 differs from −0.49 ± 0.09 (the paper's error
    alone is 0.045), where a band from the paper's spread alone (0.20) would have called it reproduced."""
    sym = {s: 3.875 + d for s, d in zip(TABLE2["none"], (0.01, -0.01, 0.01, -0.01))}
    runs = [finished_run(tmp_path, f"none-{s}", "ecd", "none", s, v, mean_v=0.5) for s, v in sym.items()]
    runs += [finished_run(tmp_path, f"bqbv-{s}", "ecd", "bqbv", s, v, mean_v=0.5)
             for s, v in ((83, 3.565), (123, 3.585), (789, 3.575))]
    claim = results(runs)["2", "Mean", "Δ"]
    own = math.sqrt(statistics.variance(sym.values()) / 4 + statistics.variance([3.565, 3.585, 3.575]) / 3)
    assert not claim.paired and claim.se == pytest.approx(own)
    assert claim.ours == pytest.approx(3.575 - 3.875) and claim.verdict == "differs"


def test_the_least_of_fewer_seeds_than_the_papers_is_noted_and_corrected(tmp_path):
    runs = [finished_run(tmp_path, "ecd-none-42", "ecd", "none", 42, 3.99, mean_v=0.0),
            finished_run(tmp_path, "ecd-none-123", "ecd", "none", 123, 3.93, mean_v=0.0)]
    both = results(runs)["1", "ECD", "Symmetric"]
    assert both.ours == 3.93 and both.n == 2 and both.difference == pytest.approx(0)  # the better of 3.99, 3.93
    one = results(runs[:1])["1", "ECD", "Symmetric"]
    offset = (verdicts.least_of(1)[0] - verdicts.least_of(2)[0]) * one.sd  # the least of 2 is lower by 0.56 sd
    assert one.n == 1 and one.difference == pytest.approx(3.99 - 3.93 - offset)
    assert any(note.startswith("the least of 1 seed against the paper's least of 2") for note in one.notes)


def test_the_best_configuration_per_seed(tmp_path):
    found = results(gelu_runs(tmp_path, {42: 3.185}, {42: 3.137}))
    assert found["23", "42", "GELU Best SB"].ours == 3.137  # b_Q + b_V (μ_V = 0) beats b_Q only
    assert found["23", "42", "GELU Δ"].ours == pytest.approx(3.137 - 3.185)


def test_diverged_runs_are_a_verdict_of_their_own_never_a_crash(tmp_path, capsys):
    """Two runs whose single-batch estimates are NaN: `eval.compare --against-paper` writes both pages; their cells
    say diverged, compare.md leaves the runs out of its tables and says why."""
    nan = [{"step": 1000, "val_loss_batch": math.nan, "best_val_loss_batch": math.nan}]
    runs = [finished_run(tmp_path, f"none-{s}", "ecd", "none", s, None, mean_v=0.5, log=nan) for s in (42, 83)]
    compare.main([*map(str, runs), "--out", str(tmp_path / "cmp"), "--against-paper"])
    cells = {(c["table"], c["row"], c["column"]): c for c in
             json.loads((tmp_path / "cmp" / "scorecard.json").read_text())["cells"]}
    assert cells["2", "42", "Symmetric"]["verdict"] == "diverged"
    assert "diverged at step 1000" in cells["2", "42", "Symmetric"]["reasons"][0]
    text = (tmp_path / "cmp" / "compare.md").read_text()
    assert "none-42: diverged at step 1000" in text and "none-83: diverged at step 1000" in text


def test_runs_of_one_seed_that_disagree_are_named(tmp_path):
    runs = [finished_run(tmp_path, "a", "ecd", "none", 42, 3.90, mean_v=0.5),
            finished_run(tmp_path, "b", "ecd", "none", 42, 3.96, mean_v=0.0)]  # μ_V: unused by a symmetric run
    cell = results(runs)["2", "42", "Symmetric"]
    assert cell.ours == pytest.approx(3.93) and cell.n == 1
    assert "seed 42: 2 runs disagree (3.9000 in a, 3.9600 in b); their mean is the seed's value" in cell.notes
    assert "seed 42: 2 runs disagree" in page({("2", "42", "Symmetric"): cell})


def test_unfinished_runs_are_left_out_and_named(tmp_path):
    """A run interrupted (or still training) is no seed: the Mean cells average the three finished ones, the cell of
    its seed has no run and names it, the page lists it."""
    runs = table2_runs(tmp_path)
    unfinished = finished_run(tmp_path, "none-789-again", "ecd", "none", 789, 10.65, mean_v=0.5, finished=False)
    (runs[3] / "log.jsonl").write_text(json.dumps({"step": 3000, "best_val_loss_batch": 10.6535}) + "\n")
    loaded = [paper_run.ScoredRun.read(d) for d in runs + [unfinished]]
    found = {(r.cell.table, r.cell.row, r.cell.column): r for r in scorecard.score(paper_data.load_published(), loaded)}
    assert found["2", "Mean", "Symmetric"].n == 3
    assert found["2", "Mean", "Symmetric"].ours == pytest.approx(statistics.fmean([3.93, 3.82, 3.94]))
    seed = found["2", "789", "Symmetric"]
    assert seed.verdict == "no run" and any(r.startswith("left out: none-789 did not finish (step 3000 of 122070")
                                             for r in seed.reasons)
    text = scorecard.scorecard_markdown(paper_data.load_published(), list(found.values()), loaded, "test")
    assert "## Runs that are not samples" in text and "- none-789-again: did not finish (step 1000 of 122070" in text


@pytest.mark.parametrize("cause, changes", [
    ("data", {"data": "embedded"}),
    ("tokens", {"flags": PROTOCOL + ("--steps", "1000")}),
    ("model", {"flags": PROTOCOL + ("--n-layer", "6")}),
    ("precision", {"flags": PROTOCOL + ("--optim-state-dtype", "bf16")}),
    ("configuration", {"flags": PROTOCOL + ("--ecd-eta", "10")}),
    ("model", {"flags": PROTOCOL + ("--std-v-min", "0.02", "--std-v-max", "0.02"), "bias": "bqbv"}),
    ("validation", {"flags": PROTOCOL + ("--val-every", "500")}),
    ("validation", {"flags": ()}),  # single-batch estimates at the mean biases
    ("validation", {"flags": PROTOCOL + ("--val-tokens", "4096")}),  # one batch: every estimate the same one
])
def test_a_run_unlike_the_papers_is_not_comparable_and_says_why_even_at_the_published_value(tmp_path, cause,
                                                                                            changes):
    bias = changes.pop("bias", "none")
    run = finished_run(tmp_path, "run", "ecd", bias, 42, TABLE2[bias][42], mean_v=0.5, **changes)
    cell = results([run])["2", "42", "Symmetric" if bias == "none" else "b_Q + b_V"]
    assert cell.difference == 0 and cell.verdict == "not comparable"
    assert [reason.split(":")[0] for reason in cell.reasons] == [cause] * len(cell.reasons)


def test_a_run_resumed_with_other_settings_or_past_its_data_is_not_comparable(tmp_path):
    """config.json holds a resumed run's last settings: the log's `changed` records say what changed on --resume;
    a run that reads more tokens than its training data holds went round it more than once."""
    log = [{"resumed_from": "x", "step": 500, "tokens": 2048000, "changed": {"optim.lr": [1.0, 0.5]}},
           {"step": 1000, "val_loss_batch": 3.93, "best_val_loss_batch": 3.93},
           {"summary": True, "step": 122070, "best_val_loss_batch": 3.93}]
    resumed = finished_run(tmp_path, "resumed", "ecd", "none", 42, None, mean_v=0.5, log=log)
    config = json.loads((resumed / "config.json").read_text())
    assert config["optim"]["lr"] == 1.0  # what the run would record had it kept its lr: the log says otherwise
    cell = results([resumed])["2", "42", "Symmetric"]
    assert cell.verdict == "not comparable"
    assert cell.reasons == ["configuration: changed on --resume at step 500: --lr 1.0 -> 0.5"]
    longer = [{**log[0], "changed": {"train.steps": [1000, 122070]}}] + log[1:]  # constant lr: the longer run
    assert results([finished_run(tmp_path, "longer", "ecd", "none", 42, None, mean_v=0.5, log=longer)])[
        "2", "42", "Symmetric"].verdict == "reproduced"
    small = finished_run(tmp_path, "small", "ecd", "none", 42, 3.93, mean_v=0.5)
    config = json.loads((small / "config.json").read_text())
    config["data"]["train"]["tokens"] = 100_000_000  # `--chunks 1`
    (small / "config.json").write_text(json.dumps(config))
    cell = results([small])["2", "42", "Symmetric"]
    assert cell.verdict == "not comparable" and cell.reasons[0].startswith(
        "tokens: the run trains on 499,998,720 tokens, 5 times the 100,000,000 its training data holds")


def test_runs_of_one_cell_on_different_data_or_settings_are_not_comparable_and_never_averaged(tmp_path):
    data = [finished_run(tmp_path, "a", "ecd", "none", 42, 3.93, mean_v=0.5),
            finished_run(tmp_path, "b", "ecd", "none", 42, 3.50, mean_v=0.5, data="fineweb-copy")]
    cell = results(data)["2", "42", "Symmetric"]
    assert cell.verdict == "not comparable" and cell.ours is None
    assert any(r.startswith("mixed: the runs of this cell differ in data") for r in cell.reasons)
    settings = [finished_run(tmp_path / "s", "a", "ecd", "none", 42, 3.93, mean_v=0.0),
                finished_run(tmp_path / "s", "b", "ecd", "none", 42, 3.50, flags=PROTOCOL + ("--ecd-eta", "10"))]
    cell = results(settings)["2", "42", "Symmetric"]
    assert cell.verdict == "not comparable" and cell.ours is None
    assert any(r.startswith("mixed: the runs of this cell differ in ecd_eta") for r in cell.reasons)


def test_a_cell_without_its_evaluation_says_what_to_run(tmp_path):
    runs = table2_runs(tmp_path)
    cell = results(runs)["3", "P 42 b_Q + b_V", "SB Top-5"]
    assert cell.verdict == "not evaluated" and "python -m eval.report --run" in cell.reasons[0]
    logic = {"top5": 0.5, "top1": 0.2, "logic_loss": 3.0, "top5_category_mean": 17 / 24, "top1_category_mean": 0.25}
    evaluated = finished_run(tmp_path / "e", "sb", "ecd", "bqbv", 42, 3.37, mean_v=0.5, logic=logic)
    cell = results([evaluated])["3", "P 42 b_Q + b_V", "SB Top-5"]
    assert cell.ours == pytest.approx(100 * 17 / 24) and cell.verdict == "inconclusive"  # one seed of a 4-point step
    assert cell.resolution == pytest.approx(4.1)  # the smallest Δ Table 3 reports for this configuration


def test_the_pooled_delta_is_over_its_member_cells(tmp_path):
    """Table 3's Mean Δ Top-5 (4.76 ± 8.79 over its twelve Δ cells): ours is the mean over the member cells that
    have runs, and the paper's error is its Std over its twelve cells, not over the four seeds."""
    logic = lambda top5: {"top5": 0.5, "top1": 0.2, "logic_loss": 3.0, "top5_category_mean": top5,  # noqa: E731
                          "top1_category_mean": 0.25}
    runs = [finished_run(tmp_path, f"{b}-{s}", "ecd", b, s, TABLE2[b][s], mean_v=0.5, logic=logic(v))
            for s, (sym, sb) in {42: (16 / 24, 17 / 24), 83: (15 / 24, 17 / 24), 123: (16 / 24, 14 / 24),
                                 789: (15 / 24, 15 / 24)}.items() for b, v in (("none", sym), ("bqbv", sb))]
    found = results(runs)
    pool = found["3", "Mean", "Δ Top-5"]
    members = [100 * d for d in (1 / 24, 2 / 24, -2 / 24, 0)]
    assert pool.n == 4 and pool.ours == pytest.approx(statistics.fmean(members))
    ours_var, paper_var = statistics.variance(members) / 4, 8.79 ** 2 / 12
    df = verdicts.welch_df([(ours_var, 3), (paper_var, 11)])
    assert pool.half_width == pytest.approx(verdicts.quantile(df) * math.sqrt(ours_var + paper_var))
    assert pool.verdict == "inconclusive"


def test_the_page_says_at_the_top_when_no_cell_with_runs_is_comparable(tmp_path, capsys):
    runs = [finished_run(tmp_path, f"{bias}-{seed}", "ecd", bias, seed, 3.9, mean_v=0.5, data="embedded")
            for seed in (42, 83) for bias in ("none", "bqbv")]
    page_path = scorecard.write_scorecard(runs, tmp_path / "out")
    text = page_path.read_text()
    top = text.split("**The rule**")[0]
    assert "every one of the" in top and "not comparable" in top and "data" in top
    verdicts_ = json.loads((tmp_path / "out" / "scorecard.json").read_text())["cells"]
    assert {c["verdict"] for c in verdicts_} == {"not comparable", "no run"}
    assert "## How the runs differ from the paper's" in text and "not FineWeb-Edu" in text


def test_the_grids_report_names_a_missing_published_file_on_one_line_and_keeps_compare_md(tmp_path, monkeypatch,
                                                                                          capsys):
    from grid import report

    runs = table2_runs(tmp_path / "g")
    missing = tmp_path / "nowhere.toml"
    monkeypatch.setattr(paper_data, "PUBLISHED", missing)
    monkeypatch.setattr(report, "report_runs", lambda *args: ([], False))  # the runs' own reports: not needed here
    assert report.report_grid(tmp_path / "g", runs, [], [], []) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if "scorecard" in line]
    assert len(lines) == 1 and str(missing) in lines[0] and "cannot read the published numbers" in lines[0]
    assert (tmp_path / "g" / "compare.md").is_file() and not (tmp_path / "g" / "scorecard.md").exists()
