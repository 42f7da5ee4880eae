"""The scorecard (docs/reproduce.md): runs against the numbers Silverstein, Kunin and Shyam published (Symmetry
Breaking in Transformers for Efficient and Interpretable Training, arXiv:2601.22257), cell by cell.

    python -m eval.compare runs/table1 runs/table2 --against-paper       # scorecard.md beside compare.md

The published numbers are data (eval/published/arxiv-2601.22257.toml, read by eval.paper_data), never code. Per
cell: the published value, ours (one value per seed, over the finished runs that match the cell's configuration and
seeds), the difference with its 95% interval and one verdict by the rule of eval.verdicts: reproduced, inconclusive
or differs (a Δ significant the other way: reversed); diverged when a run of the cell diverged; not comparable when
a run differs from the paper's run (data, tokens, model, precision, configuration, validation) or the cell's runs
differ among themselves; not evaluated; no run. The per-seed spread behind every interval is ours over the seeds of
the cell's configuration, else the paper's Std for it, else the metric's reference spread (docs/reproduce.md).
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eval import verdicts
from eval.outputs import markdown_table, write_json
from eval.paper_data import Cell, Published, load_published, series_key
from eval.paper_run import METRICS, ScoredRun, matches, metric_problem
from eval.samples import BIAS_SETTINGS, data_identity, disagreeing_seeds, per_seed
from eval.verdicts import Estimate, Spread
from fileio import atomic_write

VERDICTS = ("reproduced", "inconclusive", "differs", "diverged", "not comparable", "not evaluated", "no run")
CELL_REASONS = ("mixed", "not evaluated", "no value", "validation", "left out", "diverged")  # not a run's


@dataclass
class Side:
    """One side of a cell (its runs, or a Δ's baseline) over some seeds: {seed: value} (per seed the best of the
    side's configurations, the runs of a seed averaged), the finished runs that gave it, and what is wrong."""

    values: dict = field(default_factory=dict)
    used: list[ScoredRun] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    diverged: list[ScoredRun] = field(default_factory=list)
    left_out: list[ScoredRun] = field(default_factory=list)


def side(metric: str, selectors: list[dict], seeds: list[int], runs: list[ScoredRun]) -> Side:
    """The runs of `selectors` with one of `seeds`: unfinished runs left out, diverged ones named, runs of one
    configuration that differ in a setting that changes results (samples.cell_settings) never averaged (a `mixed`
    problem), a run without the metric not evaluated, a seed whose runs disagree named."""
    spec, found = METRICS[metric], Side()
    best = min if spec.lower_is_better else max
    per_selector = []
    for selector in selectors:
        matched = [r for r in runs if matches(r, selector, seeds)]
        found.left_out += [r for r in matched if r.outcome == "unfinished"]
        found.diverged += [r for r in matched if r.outcome == "diverged"]
        matched = [r for r in matched if r.outcome == "finished"]
        found.used += matched
        varying = [] if all(r.settings == matched[0].settings for r in matched) else sorted(
            k for k in set().union(*(r.settings for r in matched)) if len({json.dumps(r.settings.get(k))
                                                                             for r in matched}) > 1)
        if varying:
            values = "; ".join(f"{k} {sorted({json.dumps(r.settings.get(k)) for r in matched})}" for k in varying)
            found.problems.append(f"mixed: the runs of this cell differ in {values} (never averaged)")
        read = [(r.seed, spec.read(r), r.path.name) for r in matched]
        found.problems += [f"not evaluated: {spec.missing.replace('RUN', str(r.path))}"
                           for r, (_, value, _) in zip(matched, read) if value is None]
        read = [triple for triple in read if triple[1] is not None]
        found.problems += disagreeing_seeds(read, spec.fmt.lstrip("+"))
        per_selector.append(per_seed([(seed, value) for seed, value, _ in read]))
    seeds_found = sorted({s for values in per_selector for s in values})
    found.values = {s: best(v[s] for v in per_selector if s in v) for s in seeds_found}
    return found


@dataclass
class Measured:
    """Ours with its error (`ours`: for a claim, what must be significant), the difference to the published value
    less the statistics' expected difference with its error (`gap`), the per-seed spread behind them, n, the
    per-seed values (a paired Δ: the per-seed Δs), what selection alone gives a best-of-k Δ (`null`) and notes."""

    ours: Estimate
    gap: Estimate
    spread: Spread
    n: int
    per_seed: dict
    paired: bool = False
    null: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class Result:
    """One cell's outcome: verdict, reasons (not comparable, diverged, not evaluated, no run), ours (value, per-seed
    values, n; `sd` the per-seed spread behind our error and `spread` its source; `se`, `df` our standard error;
    `paired` for a Δ), the difference to the published value with the half-width of its 95% interval, the
    resolution a level must reach, whether a Δ is significant the other way (`reversed`), notes (left-out runs,
    disagreeing seeds, how it was judged, what would decide it) and the runs."""

    cell: Cell
    verdict: str
    reasons: list[str] = field(default_factory=list)
    ours: float | None = None
    per_seed: dict = field(default_factory=dict)
    n: int = 0
    sd: float | None = None
    spread: str = ""
    se: float | None = None
    df: float | None = None
    paired: bool = False
    difference: float | None = None
    half_width: float | None = None
    resolution: float | None = None
    reversed: bool = False
    notes: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)


@dataclass
class Context:
    """What judging a cell needs beyond its own runs: every run, the published file, per series (Cell.series) the
    seeds of its cells and the paper's Std for it (value, number of seeds)."""

    runs: list[ScoredRun]
    published: Published
    series_seeds: dict[str, list[int]]
    series_std: dict[str, tuple[float, int]]

    @classmethod
    def of(cls, published: Published, runs: list[ScoredRun]) -> Context:
        seeds, stds = {}, {}
        for cell in published.cells:
            seeds.setdefault(cell.series, set()).update(cell.seeds)
            if cell.std is not None and not cell.pool and len(cell.seeds) > stds.get(cell.series, (0, 0))[1]:
                stds[cell.series] = (cell.std, len(cell.seeds))
        return cls(runs, published, {k: sorted(v) for k, v in seeds.items()}, stds)

    def values(self, metric: str, selectors: list[dict], series: str) -> dict:
        """Our per-seed values of `selectors` over the seeds of `series`."""
        return side(metric, selectors, self.series_seeds.get(series, []), self.runs).values

    def spreads(self, series: str, values: list[float], metric: str, delta: bool) -> tuple[Spread, Spread]:
        """(ours, the paper's) per-seed spread of a series from our `values` of it: ours with two or more seeds,
        else the paper's Std for the series, else the metric's reference spread (√2 times it for a Δ of two runs);
        the paper's: its Std, else ours (the same object)."""
        std = self.series_std.get(series)
        paper = Spread(std[0], std[1] - 1, f"the paper's Std over {std[1]} seeds") if std else None
        if len(values) >= 2:
            ours = Spread(statistics.stdev(values), len(values) - 1, f"ours over {len(values)} seeds")
            return ours, paper or ours
        if paper is None:
            ref = self.published.spread[metric]
            paper = Spread(ref.sd * math.sqrt(2), ref.df, "√2 × the metric's reference spread") if delta else \
                Spread(ref.sd, ref.df, "the metric's reference spread")
        return paper, paper

    def pooled_spread(self, metric: str, selectors: list[dict], seeds: list[int]) -> Spread:
        """One per-seed spread of several configurations over `seeds`: their variances pooled (each over its seeds,
        degrees of freedom added), else the metric's reference spread."""
        groups = [list(side(metric, [s], seeds, self.runs).values.values()) for s in selectors]
        df = sum(len(g) - 1 for g in groups if g)
        if df == 0:
            ref = self.published.spread[metric]
            return Spread(ref.sd, ref.df, "the metric's reference spread")
        variance = sum(statistics.variance(g) * (len(g) - 1) for g in groups if len(g) > 1) / df
        return Spread(math.sqrt(variance), df, f"ours, {len(selectors)} configurations pooled")

    def level_spreads(self, metric: str, selectors: list[dict]) -> tuple[Spread, Spread]:
        """The spreads of the level of `selectors` (one side of a Δ), over the seeds of its series."""
        series = series_key(metric, selectors)
        return self.spreads(series, list(self.values(metric, selectors, series).values()), metric, False)

    def resolution(self, cell: Cell) -> float:
        """The smallest effect the cell's table reports for the cell's configuration (a Δ column the cell's
        configurations enter; for a level, also its difference to the level of the same configuration with other
        bias settings at the same seeds: Table 14's rows), else the metric's resolution."""
        def key(selector: dict, bias: bool = True) -> str:
            return json.dumps({k: v for k, v in selector.items() if bias or k not in BIAS_SETTINGS}, sort_keys=True)

        mine = {key(s) for s in cell.runs + ([cell.baseline] if cell.baseline else [])}
        same = [c for c in self.published.cells if c.table == cell.table and c.metric == cell.metric]
        effects = [abs(c.value) for c in same if c.baseline is not None and c.value
                   and mine & {key(s) for s in c.runs + [c.baseline]}]
        if not cell.claim:
            effects += [abs(c.value - cell.value) for c in same if not c.claim and c.seeds == cell.seeds
                        and c.statistic == cell.statistic and c.value != cell.value
                        and {key(s, False) for s in c.runs} == {key(s, False) for s in cell.runs}]
        return min(effects) if effects else self.published.resolution[cell.metric]


def _gap(value: float, ours: Spread, paper: Spread, ours_var: float, paper_var: float) -> Estimate:
    """ours − published with its error; Welch's degrees of freedom, or ours' where the paper's spread is ours."""
    df = ours.df if paper is ours else verdicts.welch_df([(ours_var, ours.df), (paper_var, paper.df)])
    return Estimate(value, math.sqrt(ours_var + paper_var), df)


def measure_cell(cell: Cell, treatment: dict, baseline: dict | None, context: Context) -> Measured:
    """Ours, its error and the difference to the published value with its error, by the cell's kind: a level (the
    mean or the least of its seeds), a Δ paired by seed, an unpaired Δ, or the least of one side less the least of
    the other (Table 1)."""
    sign = 1.0 if METRICS[cell.metric].lower_is_better else -1.0  # the best of k seeds: the least, or the largest
    n_paper, least = len(cell.seeds), cell.statistic == "least"
    if baseline is None:
        ours, paper = context.spreads(cell.series, list(context.values(cell.metric, cell.runs, cell.series).values()),
                                      cell.metric, False)
        n, notes = len(treatment), []
        if least:
            (e_n, v_n), (e_p, v_p) = verdicts.least_of(n), verdicts.least_of(n_paper)
            value = (min if sign > 0 else max)(treatment.values())
            offset = sign * (e_n - e_p) * ours.sd
            ours_var, paper_var = v_n * ours.sd ** 2, v_p * paper.sd ** 2
            if n != n_paper:
                notes.append(f"the least of {n} seed{'s' * (n > 1)} against the paper's least of {n_paper}: compared "
                             f"after the statistics' expected difference ({offset:+.3g} at our spread)")
        else:
            value, offset = statistics.fmean(treatment.values()), 0.0
            ours_var, paper_var = ours.sd ** 2 / n, paper.sd ** 2 / n_paper
        return Measured(Estimate(value, math.sqrt(ours_var), ours.df),
                        _gap(value - cell.value - offset, ours, paper, ours_var, paper_var), ours, n, treatment,
                        notes=notes)
    null, null_var, notes = 0.0, 0.0, []
    if len(cell.runs) > 1:  # the best of k configurations per seed: selection alone moves the Δ
        level = context.pooled_spread(cell.metric, cell.runs + [cell.baseline], context.series_seeds[cell.series])
        expected = verdicts.least_of(len(cell.runs))[0]
        null = sign * expected * level.sd
        null_var = expected ** 2 * level.sd ** 2 / (2 * level.df)  # the error of that spread
        notes.append(f"each seed takes the best of {len(cell.runs)} configurations: selection alone gives {null:+.3g} "
                     f"at the spread {level.sd:.3g} ({level.source}), which our Δ must exceed")
    deltas = {s: treatment[s] - baseline[s] for s in treatment if s in baseline}
    if set(treatment) == set(baseline) and not least:  # paired by seed: the per-seed Δs' own spread
        t_all, b_all = (context.values(cell.metric, cell.runs, cell.series),
                        context.values(cell.metric, [cell.baseline], cell.series))
        ours, paper = context.spreads(cell.series, [t_all[s] - b_all[s] for s in t_all if s in b_all], cell.metric,
                                      True)
        n, value = len(deltas), statistics.fmean(deltas.values())
        ours_var, paper_var = ours.sd ** 2 / n, paper.sd ** 2 / n_paper
        return Measured(Estimate(value, math.sqrt(ours_var + null_var), ours.df),
                        _gap(value - cell.value, ours, paper, ours_var, paper_var), ours, n, deltas, True, null, notes)
    (t_ours, t_paper), (b_ours, b_paper) = (context.level_spreads(cell.metric, cell.runs),
                                            context.level_spreads(cell.metric, [cell.baseline]))
    n_t, n_b, std = len(treatment), len(baseline), context.series_std.get(cell.series)
    if least:  # the least of each side's seeds (Table 1's Δ)
        (e_t, v_t), (e_b, v_b), (e_p, v_p) = (verdicts.least_of(n_t), verdicts.least_of(n_b),
                                              verdicts.least_of(n_paper))
        pick = min if sign > 0 else max
        value = pick(treatment.values()) - pick(baseline.values())
        offset = sign * ((e_t - e_p) * t_ours.sd - (e_b - e_p) * b_ours.sd)
        terms = [(v_t * t_ours.sd ** 2, t_ours.df), (v_b * b_ours.sd ** 2, b_ours.df)]
        paper_terms = [(v_p * t_paper.sd ** 2, t_paper.df), (v_p * b_paper.sd ** 2, b_paper.df)]
    else:  # unpaired: the seeds of the two sides differ; the paper's Δ is paired, its Std that of its per-seed Δs
        value, offset = statistics.fmean(treatment.values()) - statistics.fmean(baseline.values()), 0.0
        terms = [(t_ours.sd ** 2 / n_t, t_ours.df), (b_ours.sd ** 2 / n_b, b_ours.df)]
        paper_terms = ([(std[0] ** 2 / n_paper, std[1] - 1)] if std else
                       [(t_paper.sd ** 2 / n_paper, t_paper.df), (b_paper.sd ** 2 / n_paper, b_paper.df)])
    ours_var, paper_var = sum(v for v, _ in terms), sum(v for v, _ in paper_terms)
    df = verdicts.welch_df(terms)
    n = min(n_t, n_b)
    spread = Spread(math.sqrt(ours_var * n), df, "each side's own spread (unpaired)")
    shared = t_paper is t_ours and b_paper is b_ours and not (std and not least)  # the paper's side is ours
    gap_df = df if shared else verdicts.welch_df(terms + paper_terms)
    return Measured(Estimate(value, math.sqrt(ours_var + null_var), df),
                    Estimate(value - cell.value - offset, math.sqrt(ours_var + paper_var), gap_df), spread, n, deltas,
                    False, null, notes)


def fill_result(result: Result, measured: Measured, resolution: float, comparable: bool) -> Result:
    """Fill `result` from `measured`; a comparable result gets its verdict by eval.verdicts.judge (what would
    decide an inconclusive claim noted), a not comparable one keeps it."""
    cell = result.cell
    result.ours, result.n, result.per_seed, result.paired = (measured.ours.value, measured.n, measured.per_seed,
                                                             measured.paired)
    result.sd, result.spread, result.se, result.df = (measured.spread.sd, measured.spread.source, measured.ours.se,
                                                      measured.ours.df)
    result.difference, result.half_width = measured.gap.value, measured.gap.half_width
    result.resolution = resolution
    result.notes += measured.notes
    if not comparable:
        return result
    judgement = verdicts.judge(measured.gap, cell.value, resolution, measured.ours if cell.claim else None,
                               measured.null)
    result.verdict, result.reversed = judgement.verdict, judgement.reversed
    result.notes += judgement.words
    if result.verdict == "inconclusive" and cell.claim and cell.value != 0:
        needed = verdicts.seeds_to_decide(cell.value - measured.null, measured.spread.sd)
        result.notes.append(f"{needed} seeds would decide it at our spread ({measured.spread.sd:.3g})" if needed
                            else f"no number of seeds decides it at our spread ({measured.spread.sd:.3g})")
    return result


def judge_cell(cell: Cell, context: Context) -> Result:
    """The verdict of one (non-pooled) cell."""
    treatment = side(cell.metric, cell.runs, cell.seeds, context.runs)
    baseline = side(cell.metric, [cell.baseline], cell.seeds, context.runs) if cell.baseline else None
    sides = [treatment] + ([baseline] if baseline else [])
    used, diverged = [r for s in sides for r in s.used], [r for s in sides for r in s.diverged]
    left = [f"left out: {r.path.name} {r.why}" for s in sides for r in s.left_out]
    if not used and not diverged:
        return Result(cell, "no run", left + [f"grids/{g}.toml trains it" for g in cell.grids])
    names = sorted({r.path.name for r in used + diverged})
    if diverged:
        return Result(cell, "diverged", [f"diverged: {r.path.name} {r.why}" for r in diverged] + left, runs=names)
    problems = [p for s in sides for p in s.problems]
    if len({json.dumps(data_identity(r.config)) for r in used}) > 1:
        problems.append("mixed: the runs of this cell were trained or validated on different data or validation "
                        "budgets (never averaged)")
    reasons = sorted({p for r in used for p in r.problems + [metric_problem(cell.metric, r)] if p})
    reasons += [p for p in problems if p.startswith("mixed")]
    evaluated = [p for p in problems if p.startswith("not evaluated")]
    notes = left + [p for p in problems if p.startswith("seed")]
    result = Result(cell, "not comparable" if reasons else "not evaluated", reasons, runs=names, notes=notes)
    if any(p.startswith("mixed") for p in reasons):  # never averaged
        return result
    if (baseline is not None and not baseline.values) or not treatment.values or evaluated:
        result.reasons = reasons or evaluated or ["no value for this cell's seeds"]
        return result
    measured = measure_cell(cell, treatment.values, baseline.values if baseline else None, context)
    return fill_result(result, measured, context.resolution(cell), not reasons)


def judge_pool(cell: Cell, members: list[Result], context: Context) -> Result:
    """A pooled Δ (the mean of the other Δ cells of its column, e.g. Table 3's Mean and Std rows): ours is the mean
    over those cells' own Δs, its spread theirs; the paper's Std is over its members, so its n is their number."""
    had = [m for m in members if m.verdict != "no run"]
    if not had:
        return Result(cell, "no run", sorted({r for m in members for r in m.reasons}))
    runs = sorted({r for m in had for r in m.runs})
    reasons = sorted({r for m in had if m.verdict == "not comparable" for r in m.reasons})
    if any(m.verdict == "diverged" for m in had):
        return Result(cell, "diverged", sorted({r for m in had if m.verdict == "diverged" for r in m.reasons}),
                      runs=runs)
    if not reasons and any(m.ours is None for m in had):
        return Result(cell, "not evaluated", sorted({r for m in had for r in m.reasons}), runs=runs)
    valued = {m.cell.row: m.ours for m in had if m.ours is not None}
    result = Result(cell, "not comparable" if reasons else "not evaluated", reasons, runs=runs)
    if not valued:
        return result
    n, n_paper = len(valued), len(members)
    ours, paper = context.spreads(cell.series, list(valued.values()), cell.metric, True)
    if cell.std is not None:
        paper = Spread(cell.std, n_paper - 1, f"the paper's Std over its {n_paper} Δ cells")
    value = statistics.fmean(valued.values())
    ours_var, paper_var = ours.sd ** 2 / n, paper.sd ** 2 / n_paper
    measured = Measured(Estimate(value, math.sqrt(ours_var), ours.df),
                        _gap(value - cell.value, ours, paper, ours_var, paper_var), ours, n, valued)
    return fill_result(result, measured, context.resolution(cell), not reasons)


def score(published: Published, runs: list[ScoredRun]) -> list[Result]:
    """Every published cell judged against `runs`."""
    context = Context.of(published, runs)
    results = {id(c): judge_cell(c, context) for c in published.cells if not c.pool}
    for cell in published.cells:
        if cell.pool:
            members = [results[id(c)] for c in published.cells
                       if c.table == cell.table and c.column == cell.column and c.claim and not c.pool]
            results[id(cell)] = judge_pool(cell, members, context)
    return [results[id(c)] for c in published.cells]


# -- the page -------------------------------------------------------------------------------------------------

PAPER = ("Silverstein, Kunin and Shyam, *Symmetry Breaking in Transformers for Efficient and Interpretable "
         "Training*, arXiv:2601.22257")
RULE = ("**The rule** (docs/reproduce.md#what-reproduced-means). Ours is one value per seed over the finished runs of "
        "the cell's configuration (two runs of one seed are one sample), their mean, or their least where the paper "
        "reports the best of its seeds, or per seed the best of several configurations (Table 23's Best SB). Every ± "
        "is a 95% interval from Student's t. The per-seed spread behind it is ours over the seeds of the cell's "
        "configuration (its column), else the paper's Std for that configuration, else the metric's reference "
        "spread (the published-data file's [spread]); the paper's side has its Std, else ours. A **claim** (a Δ) is "
        "*reproduced* when our Δ has the published sign, its interval excludes zero (or what picking the best of "
        "several configurations gives alone) and the difference to the published Δ is within its interval; it "
        "*differs* when that difference is outside it, or *reversed* when our Δ is significant the other way; else "
        "it is *inconclusive*, and the page says how many seeds would decide it at our spread. A **level** (or a Δ "
        "of 0) is *reproduced* when the difference is within its interval and that interval is no wider than the "
        "resolution (the smallest effect the table reports for the cell's configuration, at most the metric's "
        "resolution {resolution}), so that a value that far off would have been told apart; *differs* when "
        "outside; else *inconclusive*. *Diverged*: a run of the cell diverged. *Not comparable*: a run differs "
        "from the paper's run in data, tokens, model, optimizer-state precision, a setting that changes results "
        "(on --resume too) or its validation, or the cell's runs differ among themselves. Unfinished runs are left "
        "out and named. The best validation loss is the paper's statistic: the least single-batch estimate every "
        "1000 steps with the last sampled biases; logic numbers are the paper's 14-item suite under its protocol.")


def _fmt(r: Result) -> str:
    return METRICS[r.cell.metric].fmt.lstrip("+")


def _ours_text(r: Result) -> str:
    if r.ours is None:
        return "-"
    fmt = _fmt(r)
    own = f" ± {r.sd:{fmt}} sd" if r.spread.startswith("ours") else ""
    if r.cell.statistic == "least":
        mean = statistics.fmean(r.per_seed.values())
        return f"{r.ours:{fmt}} (least of n = {r.n}" + (f"; mean {mean:{fmt}}{own})" if r.n > 1 else ")")
    return f"{r.ours:{fmt}}{own} (n = {r.n})"


def _difference_text(r: Result) -> str:
    if r.difference is None:
        return "-"
    fmt = _fmt(r)
    source = "" if r.spread.startswith("ours") else f"; spread {r.sd:.3g}: {r.spread}"
    return f"{r.difference:+{fmt}} ± {r.half_width:{fmt}}{source}"


def _verdict_text(r: Result) -> str:
    """The verdict with its reasons: a run's differences from the paper by cause only (the runs' section below
    names them), a cell's own reasons and notes in full."""
    own = [reason for reason in r.reasons if reason.split(":")[0] in CELL_REASONS or r.verdict == "no run"]
    causes = list(dict.fromkeys(reason.split(":")[0] for reason in r.reasons if reason not in own))
    words = own + ([f"the runs differ from the paper's in {', '.join(causes)} (below)"] if causes else []) + r.notes
    verdict = "differs (reversed)" if r.reversed else r.verdict
    return f"**{verdict}**" + (f": {'; '.join(words)}" if words else "")


def _published_text(cell: Cell) -> str:
    """The published number as the paper prints it, with its spread."""
    return f"{cell.value:{'+' if cell.claim else ''}g}" + (f" ± {cell.std:g}" if cell.std is not None else "")


def _signs_text(r: Result) -> str:
    """Per seed: our Δ and whether its sign agrees with the published Δ (a published Δ of 0 has no sign)."""
    if not r.per_seed or r.cell.value == 0 or r.cell.pool or r.cell.baseline is None:
        return "-"
    fmt = _fmt(r)
    agree = [(seed, d, math.copysign(1, d) == math.copysign(1, r.cell.value) and d != 0)
             for seed, d in r.per_seed.items()]
    words = ", ".join(f"{seed} {d:+{fmt}} {'✓' if ok else '✗'}" for seed, d, ok in agree)
    return f"{sum(ok for _, _, ok in agree)}/{len(agree)} agree ({words})"


def _claim_ours(r: Result) -> str:
    if r.ours is None:
        return "-"
    fmt = _fmt(r)
    half = f" ± {verdicts.quantile(r.df) * r.se:{fmt}}" if r.se else ""
    if r.cell.pool:
        return f"{r.ours:+{fmt}}{half} (mean of the column's {r.n} Δ cells with runs, sd {r.sd:{fmt}})"
    kind = "least − least" if r.cell.statistic == "least" else "paired" if r.paired else "unpaired"
    sd = f", sd {r.sd:{fmt}}" if r.spread.startswith("ours") else ""
    return f"{r.ours:+{fmt}}{half} ({kind}, n = {r.n}{sd})"


def scorecard_markdown(published: Published, results: list[Result], runs: list[ScoredRun], source: str) -> str:
    """The page: what it compares, a warning at the top when no cell with runs is comparable, the counts, the
    rule, a section per table with runs (its levels), the claims (Δ columns), the runs left out and how the runs
    differ from the paper's."""
    with_runs = [r for r in results if r.verdict != "no run"]
    counts = Counter("reversed" if r.reversed else r.verdict for r in results)
    lines = ["# Scorecard: these runs against the paper's tables", "",
             f"{PAPER}: its published numbers ({published.path.name}) against {source}.", ""]
    if not with_runs:
        lines += ["**No run here matches a published cell** (optimizer, bias mode, μ_V, activation and seed of a "
                  "cell: docs/reproduce.md lists the grids that train them).", ""]
    elif all(r.verdict == "not comparable" for r in with_runs):
        common = Counter(reason.split(":")[0] for r in with_runs for reason in r.reasons)
        lines += [f"**Not comparable: every one of the {len(with_runs)} cells with runs is not comparable** with "
                  f"the paper ({', '.join(cause for cause, _ in common.most_common())} differ from its runs): "
                  "this page checks the path from grid to scorecard, not the paper's numbers.", ""]
    lines += ["Cells: " + ", ".join(f"{counts[v]} {v}" for v in VERDICTS[:3] + ("reversed",) + VERDICTS[3:]
                                    if counts[v]) + ".", "",
              RULE.format(resolution=", ".join(f"{m} {t:g}" for m, t in published.resolution.items())), ""]
    tables = list(dict.fromkeys(r.cell.table for r in results if not r.cell.claim))
    empty = [t for t in tables if all(r.verdict == "no run" for r in results if r.cell.table == t)]
    for table in tables:
        if table in empty:
            continue
        rows = [[r.cell.row, r.cell.column, METRICS[r.cell.metric].label, ", ".join(map(str, r.cell.seeds)),
                 _published_text(r.cell), _ours_text(r), _difference_text(r), _verdict_text(r)]
                for r in results if r.cell.table == table and not r.cell.claim]
        lines += [f"## Table {table}", "", published.captions[table], "",
                  markdown_table(["row", "column", "metric", "seeds", "published", "ours (n)",
                                  "ours − published (95%)", "verdict"], rows), ""]
    claims = [r for r in results if r.cell.claim and r.verdict != "no run"]
    if claims:
        rows = [[r.cell.table, r.cell.row, r.cell.column, ", ".join(map(str, r.cell.seeds)), _published_text(r.cell),
                 _claim_ours(r), _signs_text(r), _difference_text(r), _verdict_text(r)] for r in claims]
        lines += ["## Claims: the Δ columns", "",
                  "Each Δ (symmetry-broken minus symmetric, per the cell's configuration): ours paired by seed where "
                  "both sides hold the same seeds (the mean per-seed Δ ± its 95% interval, the per-seed Δs' sd), "
                  "else from each side's own spread; per seed whether our Δ has the published sign.", "",
                  markdown_table(["table", "row", "column", "seeds", "published Δ", "ours (95%)", "per seed (sign)",
                                  "ours − published (95%)", "verdict"], rows), ""]
    if empty:
        grids = sorted({g for r in results if r.cell.table in empty for g in r.cell.grids})
        lines += [f"Tables without a run here: {', '.join(empty)} (their grids: "
                  f"{', '.join(f'grids/{g}.toml' for g in grids)}).", ""]
    left = [r for r in runs if r.outcome != "finished"]
    if left:
        lines += ["## Runs that are not samples", "",
                  "Only finished runs are seeds of a cell; these are not averaged anywhere on this page:", ""]
        lines += [f"- {r.path.name}: {r.why}" for r in left] + [""]
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
    runs = [ScoredRun.read(Path(d)) for d in run_dirs]
    results = score(published, runs)
    if only_if_matched and all(r.verdict == "no run" for r in results):
        return None
    out.mkdir(parents=True, exist_ok=True)
    text = scorecard_markdown(published, results, runs, source or f"{len(run_dirs)} runs")
    write_json(out / "scorecard.json", {"published": str(published.path), "cells": [
        {**{k: v for k, v in dataclasses.asdict(r).items() if k != "cell"}, "table": r.cell.table,
         "row": r.cell.row, "column": r.cell.column, "metric": r.cell.metric, "published": r.cell.value,
         "published_std": r.cell.std, "seeds": r.cell.seeds, "source": r.cell.source} for r in results],
        "left_out": [{"run": r.path.name, "outcome": r.outcome, "why": r.why} for r in runs
                     if r.outcome != "finished"]})
    atomic_write(out / "scorecard.md", text.encode())
    counts = Counter(r.verdict for r in results)
    print(f"scorecard: {', '.join(f'{counts[v]} {v}' for v in VERDICTS if counts[v])}; wrote {out / 'scorecard.md'}")
    return out / "scorecard.md"
