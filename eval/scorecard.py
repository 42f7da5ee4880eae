"""The scorecard (docs/reproduce.md): runs against the numbers Silverstein, Kunin and Shyam published (Symmetry
Breaking in Transformers for Efficient and Interpretable Training, arXiv:2601.22257), cell by cell.

    python -m eval.compare runs/table1 runs/table2 --against-paper       # scorecard.md beside compare.md

The published numbers are data (eval/published/arxiv-2601.22257.toml: every cell with its table, row, column,
seeds, the runs it describes and its source), never code. Per cell: the published value, ours (mean ± std over the
seeds, n), the difference and one verdict: reproduced when |ours − published| is within two standard errors of the
difference (each side's seed spread / √n; a published number without a spread contributes the metric's absolute
tolerance / 2), differs otherwise, and not comparable whenever a run of the cell differs from the paper's run in its
data (not FineWeb-Edu), tokens, model, precision or configuration, or the cell's runs differ among themselves, with
the reason. The Δ columns are claims: our Δ paired by seed with its standard error, and per seed whether its sign
agrees with the published Δ.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eval.common import markdown_table, write_json
from eval.paper_run import METRICS, Run, matches, metric_problem, result_settings
from eval.samples import Summary, data_identity, difference, per_seed
from fileio import atomic_write

PUBLISHED = Path(__file__).resolve().parent / "published" / "arxiv-2601.22257.toml"
PAPER = ("Silverstein, Kunin and Shyam, *Symmetry Breaking in Transformers for Efficient and Interpretable "
         "Training*, arXiv:2601.22257")
STATISTICS = ("mean", "least")
CELL_REASONS = ("mixed", "not evaluated", "no value", "validation")  # a cell's reasons, not a run's differences
VERDICTS = ("reproduced", "differs", "not comparable", "not evaluated", "no run")


class PublishedDataError(ValueError):
    """The published-data file is missing or damaged (the message names it and what is wrong)."""


@dataclass
class Cell:
    """One published number: where it is (table, row, column, source), what it is (metric, value, the published
    spread `std` over its seeds when the paper gives one), which runs it describes (`runs`: selectors of config
    values, several when the cell is the best of those configurations per seed; `baseline`: for a Δ, the runs it
    is taken against; `pool`: a Δ that is the mean of the other Δ cells of its column) and over which seeds
    (`statistic` mean or least)."""

    table: str
    row: str
    column: str
    metric: str
    value: float
    seeds: list[int]
    statistic: str
    runs: list[dict]
    source: str
    grids: list[str]
    baseline: dict | None = None
    std: float | None = None
    pool: bool = False

    @property
    def claim(self) -> bool:
        return self.baseline is not None or self.pool

    @property
    def name(self) -> str:
        return f"Table {self.table}, {self.row}, {self.column}"


@dataclass
class Published:
    """The published-data file: its path, the absolute tolerance per metric, the tables' captions and cells."""

    path: Path
    tolerance: dict[str, float]
    captions: dict[str, str]
    cells: list[Cell]


def _toml_loads(text: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def load_published(path: Path | None = None) -> Published:
    """The published-data file at `path` (default: the shipped one, PUBLISHED), every entry checked;
    PublishedDataError (one line naming the file and the entry) when it is missing, not TOML or not as
    docs/reproduce.md#the-published-numbers describes."""
    path = Path(path or PUBLISHED)
    try:
        data = _toml_loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PublishedDataError(f"{path}: cannot read the published numbers ({exc.strerror}); the repository ships "
                                 f"them in {PUBLISHED}") from None
    except (ValueError, UnicodeDecodeError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise PublishedDataError(f"{path}: not a valid published-data file ({exc})") from None
    except ImportError:
        raise PublishedDataError(f"{path}: reading TOML needs Python 3.11 or newer, or the tomli package") from None
    try:
        return _parse(path, data)
    except KeyError as exc:
        raise PublishedDataError(f"{path}: an entry lacks its {exc} (docs/reproduce.md#the-published-numbers)") \
            from None
    except (TypeError, ValueError) as exc:
        raise PublishedDataError(f"{path}: {exc}") from None


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {value!r} is not a finite number")
    return float(value)


def _parse(path: Path, data: dict) -> Published:
    tolerance = {name: _number(v, f"[tolerance] {name}") for name, v in data["tolerance"].items()}
    if set(tolerance) != set(METRICS):
        raise ValueError(f"[tolerance] must give every metric once: {', '.join(sorted(METRICS))}")
    captions, cells = {}, []
    for table in data["table"]:
        name = str(table["table"])
        unknown = set(table) - {"table", "caption", "grid", "metric", "statistic", "seeds", "cells", "runs"}
        if unknown:
            raise ValueError(f"table {name}: unknown keys {', '.join(sorted(unknown))}")
        captions[name] = str(table["caption"])
        selectors = {key: dict(value) for key, value in table["runs"].items()}
        for key, selector in selectors.items():
            if not isinstance(selector.get("grid", table.get("grid")), str):
                raise ValueError(f"table {name}: runs {key} names no grid file (grid = \"...\")")
        for entry in table["cells"]:
            where = f"table {name}, row {entry.get('row')!r}, column {entry.get('column')!r}"
            unknown = set(entry) - {"row", "column", "value", "runs", "baseline", "std", "seeds", "metric",
                                    "statistic", "source", "pool"}
            if unknown:
                raise ValueError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
            metric = entry.get("metric", table.get("metric"))
            statistic = entry.get("statistic", table.get("statistic", "mean"))
            seeds = entry.get("seeds", table.get("seeds"))
            if metric not in METRICS:
                raise ValueError(f"{where}: metric {metric!r} is none of {', '.join(METRICS)}")
            if statistic not in STATISTICS:
                raise ValueError(f"{where}: statistic {statistic!r} is none of {', '.join(STATISTICS)}")
            if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) for s in seeds)):
                raise ValueError(f"{where}: seeds must be a non-empty list of integers")
            names = entry.get("runs", [])
            names = [names] if isinstance(names, str) else list(names)
            baseline = entry.get("baseline")
            missing = [n for n in names + ([baseline] if baseline else []) if n not in selectors]
            if missing or not (names or entry.get("pool")):
                raise ValueError(f"{where}: runs {', '.join(missing) or '(none)'} not in the table's [runs]")
            chosen = [selectors[n] for n in names] + ([selectors[baseline]] if baseline else [])
            cells.append(Cell(
                name, str(entry["row"]), str(entry["column"]), metric, _number(entry["value"], where), seeds,
                statistic, [_config_keys(selectors[n]) for n in names], str(entry.get("source", captions[name])),
                sorted({s.get("grid", table.get("grid")) for s in chosen}),
                _config_keys(selectors[baseline]) if baseline else None,
                _number(entry["std"], where) if "std" in entry else None, bool(entry.get("pool", False))))
    return Published(path, tolerance, captions, cells)


def _config_keys(selector: dict) -> dict:
    return {k: v for k, v in selector.items() if k != "grid"}


# -- verdicts -------------------------------------------------------------------------------------------------


def band(published_std: float | None, published_n: int, ours_sd: float | None, ours_n: int,
         tolerance: float) -> float:
    """How far ours may sit from the published value and still reproduce it: two standard errors of the
    difference, 2·√(u_ours² + u_paper²). u_paper = std/√n where the paper gives a spread, else tolerance/2;
    u_ours = sd/√n over our seeds, or the paper's per-seed std for a single seed of ours, else 0."""
    paper = published_std / math.sqrt(published_n) if published_std is not None else tolerance / 2
    ours = (ours_sd / math.sqrt(ours_n) if ours_sd is not None and ours_n > 1
            else published_std if published_std is not None else 0.0)
    return 2 * math.hypot(paper, ours)


@dataclass
class Result:
    """One cell's outcome: verdict, ours (value, per-seed values, sd, n), the difference and its band, the reasons
    (not comparable, not evaluated, no run), and for a claim the per-seed Δ and the standard error."""

    cell: Cell
    verdict: str
    reasons: list[str] = field(default_factory=list)
    ours: float | None = None
    sd: float | None = None
    n: int = 0
    per_seed: dict = field(default_factory=dict)
    se: float | None = None
    paired: bool = False
    difference: float | None = None
    band: float | None = None
    runs: list[str] = field(default_factory=list)


def side_values(cell: Cell, selectors: list[dict], runs: list[Run]) -> tuple[dict, list[Run], list[str]]:
    """({seed: value} of the best selector per seed, the runs used, problems): runs of one selector that differ in
    their settings or data are not one sample (problems say how); a run without the metric is not evaluated."""
    metric = METRICS[cell.metric]
    best = min if metric.lower_is_better else max
    per_selector, used, problems = [], [], []
    for selector in selectors:
        matched = [r for r in runs if matches(r, selector, cell.seeds)]
        used += matched
        settings = [result_settings(r.config) for r in matched]
        varying = sorted(k for k in set().union(*settings) if len({json.dumps(s.get(k)) for s in settings}) > 1)
        if varying:
            values = "; ".join(f"{k} {sorted({json.dumps(s.get(k)) for s in settings})}" for k in varying)
            problems.append(f"mixed: the runs of this cell differ in {values} (never averaged)")
        problems += [f"not evaluated: {metric.missing.replace('RUN', str(r.path))}"
                     for r in matched if metric.read(r) is None]
        per_selector.append(per_seed([(r.seed, metric.read(r)) for r in matched if metric.read(r) is not None]))
    seeds = sorted({s for values in per_selector for s in values})
    return {s: best(v[s] for v in per_selector if s in v) for s in seeds}, used, problems


def judge(cell: Cell, runs: list[Run], tolerance: float) -> Result:
    """The verdict of one (non-pooled) cell against `runs`."""
    treatment, used, problems = side_values(cell, cell.runs, runs)
    baseline: dict = {}
    if cell.baseline is not None:
        baseline, base_runs, base_problems = side_values(cell, [cell.baseline], runs)
        used, problems = used + base_runs, problems + base_problems
    if not used:
        return Result(cell, "no run", [f"grids/{g}.toml trains it" for g in cell.grids])
    names = sorted({r.path.name for r in used})
    identities = {json.dumps(data_identity(r.config)) for r in used}
    if len(identities) > 1:
        problems.append(f"mixed: the runs of this cell were trained or validated on different data "
                        f"({len(identities)} data fingerprints or budgets)")
    reasons = sorted({p for r in used for p in r.problems + [metric_problem(cell.metric, r)] if p})
    reasons += [p for p in problems if p.startswith("mixed")]
    evaluated = [p for p in problems if p.startswith("not evaluated")]
    result = Result(cell, "not comparable" if reasons else "not evaluated", reasons, runs=names)
    if any(p.startswith("mixed") for p in reasons):  # never averaged
        return result
    if (cell.baseline is not None and not baseline) or not treatment or evaluated:
        result.reasons = reasons or evaluated or ["no value for this cell's seeds"]
        return result
    least = cell.statistic == "least"
    best = min if METRICS[cell.metric].lower_is_better else max
    if cell.baseline is None:
        summary = Summary(treatment)
        result.ours = best(treatment.values()) if least else summary.mean
        result.sd, result.n, result.per_seed = summary.std, summary.n, treatment
    else:
        delta = difference(treatment, baseline)
        result.ours = best(treatment.values()) - best(baseline.values()) if least else delta.delta
        result.sd, result.se, result.paired = delta.sd, delta.se, delta.paired
        result.n, result.per_seed = min(delta.counts), delta.per_seed
    return settle(result, tolerance)


def settle(result: Result, tolerance: float, published_n: int | None = None) -> Result:
    """The difference, its band and the verdict of a result that has ours (not comparable stays so);
    `published_n`: the number of values behind the published spread (default: the cell's seeds)."""
    cell = result.cell
    result.difference = result.ours - cell.value
    result.band = band(cell.std, published_n or len(cell.seeds), result.sd, result.n, tolerance)
    if result.verdict != "not comparable":  # a comparable result with its value
        result.verdict = "reproduced" if abs(result.difference) <= result.band else "differs"
    return result


def judge_pool(cell: Cell, members: list[Result], tolerance: float) -> Result:
    """A pooled Δ (the mean of the other Δ cells of its column, e.g. Table 3's Mean and Std rows): ours is the
    mean ± std over those cells' own Δs."""
    had = [m for m in members if m.verdict != "no run"]
    if not had:
        return Result(cell, "no run", sorted({r for m in members for r in m.reasons}))
    runs = sorted({r for m in had for r in m.runs})
    reasons = sorted({r for m in had if m.verdict == "not comparable" for r in m.reasons})
    if not reasons and any(m.ours is None for m in had):
        return Result(cell, "not evaluated", sorted({r for m in had for r in m.reasons}), runs=runs)
    valued = {m.cell.row: m.ours for m in had if m.ours is not None}
    result = Result(cell, "not comparable" if reasons else "not evaluated", reasons, runs=runs)
    if not valued:
        return result
    summary = Summary(valued)
    result.ours, result.sd, result.n, result.per_seed = summary.mean, summary.std, summary.n, valued
    return settle(result, tolerance, len(members))


def score(published: Published, runs: list[Run]) -> list[Result]:
    """Every published cell judged against `runs`."""
    results = {id(c): judge(c, runs, published.tolerance[c.metric]) for c in published.cells if not c.pool}
    for cell in published.cells:
        if cell.pool:
            members = [results[id(c)] for c in published.cells
                       if c.table == cell.table and c.column == cell.column and c.claim and not c.pool]
            results[id(cell)] = judge_pool(cell, members, published.tolerance[cell.metric])
    return [results[id(c)] for c in published.cells]


# -- the page -------------------------------------------------------------------------------------------------


def _ours_text(r: Result) -> str:
    fmt = METRICS[r.cell.metric].fmt
    if r.ours is None:
        return "-"
    spread = f" ± {r.sd:{fmt}}" if r.sd is not None else ""
    if r.cell.statistic == "least":
        mean = Summary(r.per_seed).mean
        return f"{r.ours:{fmt}} (least of n = {r.n}" + (f"; mean {mean:{fmt}}{spread})" if r.n > 1 else ")")
    return f"{r.ours:{fmt}}{spread} (n = {r.n})"


def _verdict_text(r: Result) -> str:
    """The verdict with its reasons: a run's differences from the paper by cause only (the runs' section below
    names them), a cell's own reasons (mixed runs, what to evaluate, which grid trains it) in full."""
    own = [reason for reason in r.reasons if reason.split(":")[0] in CELL_REASONS or r.verdict == "no run"]
    causes = list(dict.fromkeys(reason.split(":")[0] for reason in r.reasons if reason not in own))
    words = own + ([f"the runs differ from the paper's in {', '.join(causes)} (below)"] if causes else [])
    return f"**{r.verdict}**" + (f": {'; '.join(words)}" if words else "")


def _published_text(cell: Cell) -> str:
    """The published number as the paper prints it, with its spread."""
    return f"{cell.value:{'+' if cell.claim else ''}g}" + (f" ± {cell.std:g}" if cell.std is not None else "")


def _difference_text(r: Result) -> str:
    if r.difference is None:
        return "-"
    fmt = METRICS[r.cell.metric].fmt.lstrip("+")
    return f"{r.difference:+{fmt}} (band ± {r.band:{fmt}})"


def _signs_text(r: Result) -> str:
    """Per seed: our Δ and whether its sign agrees with the published Δ (a published Δ of 0 has no sign)."""
    if not r.per_seed or r.cell.value == 0 or r.cell.pool:
        return "-"
    fmt = METRICS[r.cell.metric].fmt.lstrip("+")
    agree = [(seed, d, math.copysign(1, d) == math.copysign(1, r.cell.value) and d != 0)
             for seed, d in r.per_seed.items()]
    words = ", ".join(f"{seed} {d:+{fmt}} {'✓' if ok else '✗'}" for seed, d, ok in agree)
    return f"{sum(ok for _, _, ok in agree)}/{len(agree)} agree ({words})"


def _claim_ours(r: Result) -> str:
    if r.ours is None:
        return "-"
    fmt = METRICS[r.cell.metric].fmt.lstrip("+")
    if r.cell.pool:
        spread = f" ± {r.sd:{fmt}}" if r.sd is not None else ""
        return f"{r.ours:+{fmt}}{spread} (mean of the column's {r.n} Δ cells with runs)"
    se = f" ± {r.se:{fmt}} (se)" if r.se is not None else ""
    sd = f", sd {r.sd:{fmt}}" if r.sd is not None else ""
    kind = f"{'paired' if r.paired else 'unpaired'}, n = {r.n}{sd}"
    if r.cell.statistic == "least" and r.paired:  # the published statistic, then the paired Δ beside it
        return f"{r.ours:+{fmt}} (least − least; paired by seed {Summary(r.per_seed).mean:+{fmt}}{se}, n = {r.n}{sd})"
    return f"{r.ours:+{fmt}}{se} ({kind})"


def scorecard_markdown(published: Published, results: list[Result], runs: list[Run], source: str) -> str:
    """The page: what it compares, a warning at the top when no cell with runs is comparable, the counts, the
    rule, a section per table with runs (its cells), the claims (Δ columns) and the runs' differences."""
    with_runs = [r for r in results if r.verdict != "no run"]
    counts = Counter(r.verdict for r in results)
    lines = ["# Scorecard: these runs against the paper's tables", "",
             f"{PAPER}: its published numbers ({published.path.name}) against {source}.", ""]
    if not with_runs:
        lines += ["**No run here matches a published cell** (optimizer, bias mode, μ_V, activation and seed of a "
                  "cell: docs/reproduce.md lists the grids that train them).", ""]
    elif all(r.verdict == "not comparable" for r in with_runs):
        common = Counter(reason.split(":")[0] for r in with_runs for reason in r.reasons)
        lines += [f"**Not comparable: every one of the {len(with_runs)} cells with runs is not comparable** with "
                  f"the paper ({', '.join(f'{cause}' for cause, _ in common.most_common())} differ from its runs): "
                  "this page checks the path from grid to scorecard, not the paper's numbers.", ""]
    lines += ["Cells: " + ", ".join(f"{counts[v]} {v}" for v in VERDICTS if counts[v]) + ".", "",
              "**The rule.** Ours is the mean over the cell's seeds (one value per seed: the runs of a seed are one "
              "sample), or the least of them where the paper reports the best of its seeds. A cell is *reproduced* "
              "when |ours − published| ≤ 2·√(u_ours² + u_paper²): u_paper is the published std / √n where the "
              "paper gives a spread, else the metric's absolute tolerance / 2 "
              f"({', '.join(f'{m} {t:g}' for m, t in published.tolerance.items())}); u_ours is our seeds' std / √n "
              "(a single seed of ours takes the paper's per-seed std where it gives one). Otherwise it *differs*. "
              "It is *not comparable* whenever a run of the cell differs from the paper's run in its data (not "
              "FineWeb-Edu), tokens, model, precision of the optimizer state or any other setting that changes "
              "results, or when the cell's runs differ among themselves: such a cell is never called reproduced. "
              "The best validation loss is the paper's statistic, the least single-batch estimate every 1000 "
              "steps (best_val_loss_batch); logic numbers are the paper's 14-item suite under its protocol.", ""]
    tables = list(dict.fromkeys(r.cell.table for r in results if not r.cell.claim))
    empty = [t for t in tables if all(r.verdict == "no run" for r in results if r.cell.table == t)]
    for table in tables:
        if table in empty:
            continue
        rows = [[r.cell.row, r.cell.column, METRICS[r.cell.metric].label, ", ".join(map(str, r.cell.seeds)),
                 _published_text(r.cell), _ours_text(r), _difference_text(r), _verdict_text(r)]
                for r in results if r.cell.table == table and not r.cell.claim]
        lines += [f"## Table {table}", "", published.captions[table], "",
                  markdown_table(["row", "column", "metric", "seeds", "published", "ours (n)", "difference",
                                  "verdict"], rows), ""]
    claims = [r for r in results if r.cell.claim and r.verdict != "no run"]
    if claims:
        rows = [[r.cell.table, r.cell.row, r.cell.column, ", ".join(map(str, r.cell.seeds)), _published_text(r.cell),
                 _claim_ours(r), _signs_text(r), _difference_text(r), _verdict_text(r)] for r in claims]
        lines += ["## Claims: the Δ columns", "",
                  "Each Δ (symmetry-broken minus symmetric, per the cell's configuration) with ours paired by seed "
                  "where both sides hold the same seeds: the mean per-seed Δ ± its standard error (sd of the "
                  "per-seed Δs / √n), and per seed whether its sign agrees with the published Δ.", "",
                  markdown_table(["table", "row", "column", "seeds", "published Δ", "ours", "per seed (sign)",
                                  "difference", "verdict"], rows), ""]
    if empty:
        grids = sorted({g for r in results if r.cell.table in empty for g in r.cell.grids})
        lines += [f"Tables without a run here: {', '.join(empty)} (their grids: "
                  f"{', '.join(f'grids/{g}.toml' for g in grids)}).", ""]
    differing: dict[tuple[str, ...], list[str]] = {}
    for run in runs:
        if run.problems:
            differing.setdefault(tuple(run.problems), []).append(run.path.name)
    if differing:
        lines += ["## How the runs differ from the paper's", ""]
        lines += [f"- {', '.join(names)}: {'; '.join(problems)}" for problems, names in differing.items()] + [""]
    return "\n".join(lines)


def write_scorecard(run_dirs: list[Path], out: Path, published: Published | None = None,
                    source: str | None = None, only_if_matched: bool = False) -> Path | None:
    """Judge every published cell against the runs of `run_dirs` and write `out`/scorecard.md and
    scorecard.json; with `only_if_matched`, write nothing (and return None) when no run matches any cell.
    Returns the page's path."""
    published = published or load_published()
    runs = [Run.read(Path(d)) for d in run_dirs]
    results = score(published, runs)
    if only_if_matched and all(r.verdict == "no run" for r in results):
        return None
    out.mkdir(parents=True, exist_ok=True)
    text = scorecard_markdown(published, results, runs, source or f"{len(run_dirs)} runs")
    write_json(out / "scorecard.json", {"published": str(published.path), "cells": [
        {**{k: v for k, v in dataclasses.asdict(r).items() if k != "cell"}, "table": r.cell.table,
         "row": r.cell.row, "column": r.cell.column, "metric": r.cell.metric, "published": r.cell.value,
         "published_std": r.cell.std, "seeds": r.cell.seeds, "source": r.cell.source} for r in results]})
    atomic_write(out / "scorecard.md", text.encode())
    counts = Counter(r.verdict for r in results)
    print(f"scorecard: {', '.join(f'{counts[v]} {v}' for v in VERDICTS if counts[v])}; wrote {out / 'scorecard.md'}")
    return out / "scorecard.md"
