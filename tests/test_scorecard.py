"""The scorecard (docs/reproduce.md): fabricated run records against the published numbers give reproduced, differs
and not comparable by the documented rule, not comparable for each cause and for mixed runs (never averaged), the
claims' paired Δ with the sign per seed, and one-line errors for a missing or damaged published-data file."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

import train_gpt
from eval import compare, paper_run, scorecard

PAPER_STEPS = 122070
TABLE2 = {"none": {42: 3.93, 83: 3.82, 123: 3.94, 789: 3.81}, "bqbv": {42: 3.37, 83: 3.40, 123: 3.37, 789: 3.40}}


def data_record(kind: str) -> dict:
    """What config.json records of FineWeb-Edu shards (`fineweb`, or `fineweb-copy`: the same names, other
    contents) or of the embedded corpus."""
    prefix = {"fineweb": "finewebedu", "fineweb-copy": "finewebedu", "embedded": "embedded"}[kind]
    split = {name: {"given": "", "pattern": f"/data/{prefix}_{name}_*.bin", "tokens": 100_000_000,
                    "files": [{"path": f"/data/{prefix}_{name}_00000{i}.bin", "tokens": 100_000_000,
                               "sha256": kind[0] * 64} for i in ((0,) if name == "val" else (1, 2, 3, 4, 5))]}
             for name in ("train", "val")}
    return {**split, "fingerprint": {"fineweb": "f" * 16, "fineweb-copy": "c" * 16, "embedded": "e" * 16}[kind]}


def finished_run(root: Path, name: str, optimizer: str, bias: str, seed: int, best: float | None, *,
              mean_v: float | None = None, gelu: bool = False, data: str = "fineweb", flags: tuple = (),
              finished: bool = True, logic: dict | None = None) -> Path:
    """A run directory as a finished paper run leaves it: config.json of the paper's preset with these settings,
    log.jsonl whose best single-batch validation estimate is `best`, and the paper suite's logic numbers."""
    argv = ["--preset", "gpt2-124m-gelu" if gelu else "gpt2-124m", "--optimizer", optimizer, "--bias-mode", bias,
            "--seed", str(seed), *(["--mean-v", str(mean_v)] if mean_v is not None else []), *flags]
    config = train_gpt.parse_config(argv)
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({**config.to_dict(), "data": data_record(data)}))
    steps = config.train.steps
    log = [{"step": 1000, "tokens": 4096000, "val_loss_batch": best, "best_val_loss_batch": best}]
    log += [{"summary": True, "step": steps, "best_val_loss_batch": best}] if finished else []
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    if logic is not None:
        (run / "eval").mkdir()
        (run / "eval" / "logic_puzzles.json").write_text(json.dumps(
            {"suites": [{"name": "paper", "protocol": "paper", "overall": logic}]}))
    return run


def table2_runs(root: Path, **changes: float) -> list[Path]:
    """Table 2's eight runs with the published values, `changes` ({"none_789": value}) replacing some."""
    return [finished_run(root, f"{bias}-{seed}", "ecd", bias, seed, changes.get(f"{bias}_{seed}", value), mean_v=0.5)
            for bias, values in TABLE2.items() for seed, value in values.items()]


def results(run_dirs: list[Path]) -> dict[tuple[str, str, str], scorecard.Result]:
    found = scorecard.score(scorecard.load_published(), [paper_run.Run.read(d) for d in run_dirs])
    return {(r.cell.table, r.cell.row, r.cell.column): r for r in found}


def test_cells_equal_to_the_paper_are_reproduced_and_one_far_off_differs(tmp_path):
    found = results(table2_runs(tmp_path, none_789=4.01))
    assert found["2", "42", "Symmetric"].verdict == "reproduced" and found["2", "42", "Symmetric"].difference == 0
    assert found["2", "789", "Symmetric"].verdict == "differs"
    assert found["2", "789", "Symmetric"].difference == pytest.approx(0.2)
    assert found["2", "789", "Symmetric"].band == pytest.approx(0.05)  # no published spread: the tolerance
    mean = found["2", "Mean", "Symmetric"]
    ours = [3.93, 3.82, 3.94, 4.01]
    band = 2 * math.hypot(0.07 / 2, statistics.stdev(ours) / 2)  # both sides' spread over √4
    assert mean.ours == pytest.approx(statistics.fmean(ours)) and mean.band == pytest.approx(band)
    assert mean.verdict == ("reproduced" if abs(statistics.fmean(ours) - 3.88) <= band else "differs")
    assert found["1", "ECD", "Symmetric"].verdict == "reproduced"  # Table 2's seeds 42 and 123 are Table 1's
    assert found["1", "SGDM", "Symmetric"].verdict == "no run"
    assert found["1", "SGDM", "Symmetric"].reasons == ["grids/table1.toml trains it"]


def test_claims_are_paired_by_seed_with_their_uncertainty_and_the_sign_per_seed(tmp_path):
    found = results(table2_runs(tmp_path, bqbv_789=3.90))  # seed 789: Δ −0.41 becomes +0.09
    claim = found["2", "Mean", "Δ"]
    diffs = {42: 3.37 - 3.93, 83: 3.40 - 3.82, 123: 3.37 - 3.94, 789: 3.90 - 3.81}
    assert claim.paired and claim.per_seed == pytest.approx(diffs)
    assert claim.ours == pytest.approx(statistics.fmean(diffs.values()))
    assert claim.se == pytest.approx(statistics.stdev(diffs.values()) / 2)
    page = scorecard.scorecard_markdown(scorecard.load_published(), list(found.values()), [], "test")
    assert "3/4 agree (42 -0.5600 ✓, 83 -0.4200 ✓, 123 -0.5700 ✓, 789 +0.0900 ✗)" in page
    assert found["2", "789", "Δ"].verdict == "differs" and found["2", "42", "Δ"].verdict == "reproduced"


def test_the_least_of_the_seeds_and_the_best_configuration_per_seed(tmp_path):
    runs = [finished_run(tmp_path, "ecd-none-42", "ecd", "none", 42, 3.99, mean_v=0.0),
            finished_run(tmp_path, "ecd-none-123", "ecd", "none", 123, 3.93, mean_v=0.0),
            finished_run(tmp_path, "g-none-42", "ecd", "none", 42, 3.185, gelu=True),
            finished_run(tmp_path, "g-bq-42", "ecd", "bq", 42, 3.30, gelu=True),
            finished_run(tmp_path, "g-v00-42", "ecd", "bqbv", 42, 3.137, gelu=True, mean_v=0.0)]
    found = results(runs)
    table1 = found["1", "ECD", "Symmetric"]
    assert table1.ours == 3.93 and table1.n == 2 and table1.verdict == "reproduced"  # the better of 3.99, 3.93
    best = found["23", "42", "GELU Best SB"]
    assert best.ours == 3.137 and best.verdict == "reproduced"  # b_Q + b_V (μ_V = 0) beats b_Q only
    assert found["23", "42", "GELU Δ"].ours == pytest.approx(3.137 - 3.185)


@pytest.mark.parametrize("cause, changes", [
    ("data", {"data": "embedded"}),
    ("tokens", {"flags": ("--steps", "1000")}),
    ("tokens", {"finished": False}),
    ("model", {"flags": ("--n-layer", "6")}),
    ("precision", {"flags": ("--optim-state-dtype", "bf16")}),
    ("configuration", {"flags": ("--ecd-eta", "10")}),
    ("validation", {"flags": ("--val-every", "500")}),
])
def test_a_run_unlike_the_papers_is_not_comparable_and_says_why_even_at_the_published_value(tmp_path, cause,
                                                                                            changes):
    run = finished_run(tmp_path, "run", "ecd", "none", 42, 3.93, mean_v=0.5, **changes)
    cell = results([run])["2", "42", "Symmetric"]
    assert cell.difference == 0 and cell.verdict == "not comparable"
    assert [reason.split(":")[0] for reason in cell.reasons] == [cause] * len(cell.reasons)


def test_runs_of_one_cell_on_different_data_or_settings_are_not_comparable_and_never_averaged(tmp_path):
    data = [finished_run(tmp_path, "a", "ecd", "none", 42, 3.93, mean_v=0.5),
            finished_run(tmp_path, "b", "ecd", "none", 42, 3.50, mean_v=0.5, data="fineweb-copy")]
    cell = results(data)["2", "42", "Symmetric"]
    assert cell.verdict == "not comparable" and cell.ours is None
    assert any(r.startswith("mixed: the runs of this cell differ in data") for r in cell.reasons)
    settings = [finished_run(tmp_path / "s", "a", "ecd", "none", 42, 3.93, mean_v=0.0),
                finished_run(tmp_path / "s", "b", "ecd", "none", 42, 3.50, flags=("--ecd-eta", "10"))]
    cell = results(settings)["2", "42", "Symmetric"]
    assert cell.verdict == "not comparable" and cell.ours is None
    assert any(r.startswith("mixed: the runs of this cell differ in ecd_eta") for r in cell.reasons)


def test_settings_a_bias_mode_does_not_use_do_not_split_a_cell(tmp_path):
    runs = [finished_run(tmp_path, "a", "ecd", "none", 42, 3.92, mean_v=0.0),  # Table 1's symmetric run
            finished_run(tmp_path, "b", "ecd", "none", 42, 3.94, mean_v=0.5)]  # Table 2's
    cell = results(runs)["2", "42", "Symmetric"]
    assert cell.verdict == "reproduced" and cell.n == 1 and cell.ours == pytest.approx(3.93)


def test_a_cell_without_its_evaluation_says_what_to_run(tmp_path):
    runs = table2_runs(tmp_path)
    cell = results(runs)["3", "P 42 b_Q + b_V", "SB Top-5"]
    assert cell.verdict == "not evaluated" and "python -m eval.report --run" in cell.reasons[0]
    logic = {"top5": 0.5, "top1": 0.2, "logic_loss": 3.0, "top5_category_mean": 17 / 24, "top1_category_mean": 0.25}
    evaluated = finished_run(tmp_path / "e", "sb", "ecd", "bqbv", 42, 3.37, mean_v=0.5, logic=logic)
    cell = results([evaluated])["3", "P 42 b_Q + b_V", "SB Top-5"]
    assert cell.ours == pytest.approx(100 * 17 / 24) and cell.verdict == "reproduced"


def test_the_page_says_at_the_top_when_no_cell_with_runs_is_comparable(tmp_path, capsys):
    runs = [finished_run(tmp_path, f"{bias}-{seed}", "ecd", bias, seed, 3.9, mean_v=0.5, data="embedded")
            for seed in (42, 83) for bias in ("none", "bqbv")]
    page = scorecard.write_scorecard(runs, tmp_path / "out")
    text = page.read_text()
    top = text.split("**The rule.**")[0]
    assert "every one of the" in top and "not comparable" in top and "data" in top
    verdicts = json.loads((tmp_path / "out" / "scorecard.json").read_text())["cells"]
    assert {c["verdict"] for c in verdicts} == {"not comparable", "no run"}
    assert "## How the runs differ from the paper's" in text and "not FineWeb-Edu" in text


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read the published numbers"),
    ("[[table]\nbroken", "not a valid published-data file"),
    ("[tolerance]\nbest_val_loss = 0.05\n", "must give every metric once"),
])
def test_a_missing_or_damaged_published_file_is_a_one_line_error_naming_it(tmp_path, capsys, content, expected):
    path = tmp_path / "published.toml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(scorecard.PublishedDataError, match=expected) as error:
        scorecard.load_published(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    run = finished_run(tmp_path, "run", "ecd", "none", 42, 3.93)
    with pytest.raises(SystemExit) as stopped:
        compare.main([str(run), "--out", str(tmp_path / "cmp"), "--against-paper", str(path)])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1 and str(path) in err
    assert not (tmp_path / "cmp").exists()  # nothing written


def test_a_cell_naming_an_unknown_configuration_is_refused(tmp_path):
    text = scorecard.PUBLISHED.read_text().replace('runs = "ecd-sym" }', 'runs = "ecd-symmetric" }', 1)
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(scorecard.PublishedDataError, match="table 1, row 'ECD', column 'Symmetric': runs "
                                                           "ecd-symmetric not in the table's"):
        scorecard.load_published(tmp_path / "p.toml")


def test_the_grids_report_names_a_missing_published_file_on_one_line_and_keeps_compare_md(tmp_path, monkeypatch,
                                                                                          capsys):
    from grid import report

    runs = table2_runs(tmp_path / "g")
    missing = tmp_path / "nowhere.toml"
    monkeypatch.setattr(scorecard, "PUBLISHED", missing)
    monkeypatch.setattr(report, "report_runs", lambda *args: ([], False))  # the runs' own reports: not needed here
    assert report.report_grid(tmp_path / "g", runs, [], [], []) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if "scorecard" in line]
    assert len(lines) == 1 and str(missing) in lines[0] and "cannot read the published numbers" in lines[0]
    assert (tmp_path / "g" / "compare.md").is_file() and not (tmp_path / "g" / "scorecard.md").exists()
