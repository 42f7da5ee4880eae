"""Compare runs (arXiv 2601.22257 Tables 1, 2, 5, 14): optimizer × attention-bias tables of the best validation loss
(the paper's statistic) and the least validation loss (mean ± std over seeds, Δ against the symmetric baseline with
its standard error), then per run the validation losses, logic top-1/top-5, alignment, punctuation enrichment, Δ
top-5 against the run's symmetric baseline, and the Pearson r between enrichment and Δ top-5.

    python -m eval.compare --run runs/A --run runs/B ... [--out runs/compare] [--suite NAME] [--alignment-mode raw]
    python -m eval.compare runs/table2 --against-paper     # also scorecard.md: the runs against the paper's tables

(`--checkpoint` is the same flag; run directories given without a flag, `python -m eval.compare runs/*`, work too, and
a directory of runs, such as a grid's, stands for its runs.) Reads each run's log.jsonl and eval/*.json (`python -m
eval.report --run DIR` computes them; a missing cell names the evaluation to run). Only finished runs count: one
interrupted, still training or diverged is left out of every table and named with the reason. The runs of a table
cell are the seeds of one cell (eval.samples.cell_settings, the scorecard's too): rows are the optimizer and every
other setting that differs between the runs, the data included (runs trained or validated on other data are never
averaged together); columns are the bias mode and its settings; two runs of one seed are one sample. Δ is paired by
seed where the two cells hold the same seeds. The baseline of a run is the symmetric run (bias mode `none`) of its
row and seed. r uses the symmetry-broken runs that have a baseline; its 95% interval is Fisher's (z = atanh r ±
1.96/√(n−3)). Writes `compare.json`, `compare.md`, `compare_loss.png` (every loss curve on one axis) and, when r has
points, `compare_enrichment.png`; prints the tables and where it wrote.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from cli import ArgumentParser
from eval import paper_data, scorecard
from eval.configuration import read_config
from eval.curves import runs_loss_figure
from eval.figures import pyplot, save_figure
from eval.outputs import EVAL_DIRNAME, markdown_table, write_json
from eval.samples import (BIAS_SETTINGS, STATISTICS, Difference, Summary, cell_settings, data_description,
                          data_identity, difference, per_seed, repeated_seeds, run_outcome)
from fileio import atomic_write, exits_on_filesystem_errors, make_directory
from optim import OPTIMIZERS
from run.checkpoint import run_dir_of
from run.log import read_log

BIAS_WORDS = {"none": "symmetric (none)", "bq": "b_Q (bq)", "bv": "b_V (bv)", "bqbv": "b_Q + b_V (bqbv)",
              "learned": "learned b_Q, b_V (learned)"}


def pearson(x: list[float], y: list[float]) -> dict:
    """Pearson r with its 95% Fisher-z interval (None where n is too small or a variable is constant)."""
    n = len(x)
    try:
        r = statistics.correlation(x, y) if n >= 3 else None
    except statistics.StatisticsError:  # a constant variable
        r = None
    if r is None or n < 4 or abs(r) >= 1:
        return {"r": r, "ci": None, "n": n}
    z, half = math.atanh(r), 1.96 / math.sqrt(n - 3)
    return {"r": r, "ci": [math.tanh(z - half), math.tanh(z + half)], "n": n}


def _load(run_dir: Path, name: str) -> dict | None:
    path = run_dir / EVAL_DIRNAME / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _pick_suite(logic: dict | None, name: str | None) -> dict | None:
    if logic is None:
        return None
    suites = logic["suites"]
    if name is not None:
        return next((s for s in suites if s["name"] == name), None)
    return next((s for s in suites if s["name"].startswith("generated")), suites[0])


def run_row(run_dir: Path, suite: str | None, alignment_mode: str) -> dict:
    """One run's configuration and headline numbers (None where an evaluation is missing)."""
    config = read_config(run_dir)
    model, train = config.get("model", {}), config.get("train", {})
    val = _load(run_dir, "val_loss")
    logic_file, alignment_file = _load(run_dir, "logic_puzzles"), _load(run_dir, "alignment")
    logic = _pick_suite(logic_file, suite)
    alignment = (alignment_file or {}).get("modes", {}).get(alignment_mode) or {}
    overall = logic["overall"] if logic else {}
    pooled = alignment["enrichment"]["pooled"] if alignment else {}
    steps = {name: result.get("step") for name, result in (("val_loss", val), ("logic_puzzles", logic_file),
                                                             ("alignment", alignment_file)) if result is not None}
    log = read_log(run_dir)
    outcome, why = run_outcome(config, log)
    return {
        "run": run_dir.name, "path": str(run_dir), "optimizer": train.get("optimizer"), "steps": steps,
        "outcome": outcome, "why": why, "data": data_identity(config), "data_description": data_description(config),
        "bias_mode": model.get("bias_mode"), "activation": model.get("activation"), "seed": train.get("seed"),
        "mean_v": model.get("mean_v"),
        **{key: statistic.read(log) for key, statistic in STATISTICS.items()},
        "val_loss": val["val_loss"] if val else None,
        "suite": logic["name"] if logic else None,
        "logic_loss": overall.get("logic_loss"), "top1": overall.get("top1"), "top5": overall.get("top5"),
        "align_mean_top": alignment.get("mean_top"), "align_frac_above_null": alignment.get("frac_above_null"),
        "punct_enrichment": pooled.get("punctuation"), "noise_enrichment": pooled.get("unicode_noise"),
    }


def step_label(steps: dict[str, int | None]) -> str:
    """The checkpoint step of a run's evaluations: one number, or each evaluation's step when they differ."""
    distinct = set(steps.values())
    if not distinct:
        return "-"
    if len(distinct) == 1:
        return str(distinct.pop())
    return ", ".join(f"{name} {step}" for name, step in steps.items())


def add_cells(rows: list[dict], configs: list[dict]) -> None:
    """Set each row's pivot `condition` and `column` from its cell (samples.cell_settings: runs of one condition and
    column are seeds of one cell). The condition: the optimizer and every other setting that differs between the
    runs (the optimizer's own between runs of that optimizer), the data included, except the bias settings; the
    column: the bias mode and its settings that differ between runs of that mode (a symmetric run has none: it is the
    baseline of every condition that differs from it only in bias settings)."""
    settings = [cell_settings(c) for c in configs]
    own = {name: {f.name for f in dataclasses.fields(spec.config)} for name, spec in OPTIMIZERS.items()}
    optim_fields = set().union(*own.values())

    def varying(keys: set[str], among: list[int]) -> list[str]:
        return sorted(k for k in keys if len({json.dumps(settings[i].get(k)) for i in among}) > 1)

    everyone = range(len(rows))
    general = varying(set().union(*settings) - optim_fields - BIAS_SETTINGS - {"optimizer"}, list(everyone))
    for i, row in enumerate(rows):
        same = [j for j in everyone if rows[j]["optimizer"] == row["optimizer"]]
        mode = [j for j in everyone if rows[j]["bias_mode"] == row["bias_mode"]]
        words = general + varying(own.get(row["optimizer"], set()), same)
        row["condition"] = ", ".join([str(row["optimizer"])] + [f"{k.replace('_', '-')} {settings[i].get(k)}"
                                                                 for k in words])
        bias = varying(BIAS_SETTINGS - {"bias_mode"}, mode)
        row["column"] = ", ".join([str(row["bias_mode"])] + [f"{k.replace('_', '-')} {settings[i].get(k)}"
                                                              for k in bias if k in settings[i]])


def add_baselines(rows: list[dict]) -> None:
    """Set `baseline` (run name) and `delta_top5` (percentage points) from the symmetric run (bias mode none) of the
    same condition (add_cells) and seed."""
    for row in rows:
        base = next((b for b in rows if b["bias_mode"] == "none" and b is not row
                     and (b["condition"], b["seed"]) == (row["condition"], row["seed"])), None)
        row["baseline"] = base["run"] if base else None
        has_both = base is not None and row["top5"] is not None and base["top5"] is not None
        row["delta_top5"] = 100 * (row["top5"] - base["top5"]) if has_both else None


def column_title(column: str, short: bool = False) -> str:
    """A pivot column's heading: the bias mode's words (`short`: without the flag value), then the settings that set
    the column apart."""
    mode, _, rest = column.partition(", ")
    words = BIAS_WORDS.get(mode, mode)
    return (words.split(" (")[0] if short else words) + (f", {rest}" if rest else "")


def pivot(rows: list[dict], metric: str, scale: float = 1.0) -> dict:
    """{"columns": the columns in order, "rows": [{"condition", "cells": {column: {"mean", "std", "n", "runs",
    "repeated_seeds", "delta"}}}]}: `metric` × `scale` per condition × column (add_cells), one value per seed (the
    runs of a seed averaged: samples.per_seed), mean and sample std over the n seeds with a value out of `runs` runs,
    and the difference to the condition's symmetric column with its standard error (samples.difference; paired by
    seed when the two cells hold the same seeds)."""
    order = list(BIAS_WORDS)
    columns = sorted({r["column"] for r in rows}, key=lambda c: (order.index(c.split(", ")[0])
                                                                 if c.split(", ")[0] in order else len(order), c))
    table = []
    for condition in dict.fromkeys(r["condition"] for r in rows):
        cells, seeds = {}, {}
        for column in columns:
            runs = [r for r in rows if r["condition"] == condition and r["column"] == column]
            pairs = [(r["seed"], scale * r[metric]) for r in runs if r[metric] is not None]
            seeds[column] = per_seed(pairs)
            summary = Summary(seeds[column])
            cells[column] = {"mean": summary.mean, "std": summary.std, "n": summary.n, "runs": len(runs),
                             "repeated_seeds": repeated_seeds(pairs)}
        for column, cell in cells.items():
            cell["delta"] = (dataclasses.asdict(difference(seeds[column], seeds["none"]))
                             if "none" in cells and column != "none" else None)
        table.append({"condition": condition, "cells": cells})
    return {"metric": metric, "columns": columns, "rows": table}


def pivot_markdown(table: dict, fmt: str, missing: str) -> str:
    """A pivot as Markdown: a column per bias mode and settings (mean ± std, n when more than one seed, and a seed
    that more than one run has) and a Δ column after each but the symmetric one (± its standard error)."""
    columns = table["columns"]
    header = ["optimizer and settings"]
    for column in columns:
        header += [column_title(column)] + ([f"Δ {column_title(column, short=True)}"]
                                            if column != "none" and "none" in columns else [])
    body = []
    for row in table["rows"]:
        line = [row["condition"]]
        for column in columns:
            cell = row["cells"][column]
            if cell["mean"] is None:
                text = missing if cell["runs"] else "no run"
            else:
                text = format(cell["mean"], fmt) + (f" ± {cell['std']:{fmt}}" if cell["std"] is not None else "")
                notes = [f"n = {cell['n']}"] * (cell["n"] > 1)
                notes += [f"seed {seed} more than once: one sample" for seed in cell["repeated_seeds"]]
                text += f" ({'; '.join(notes)})" if notes else ""
            line.append(text)
            if column != "none" and "none" in columns:
                line.append(Difference(**cell["delta"]).text(fmt) if cell["delta"] else "-")
        body.append(line)
    return markdown_table(header, body)


def plot_enrichment(points: list[dict], correlation: dict, path: Path) -> None:
    """Δ top-5 against punctuation enrichment of `points`, the symmetry-broken runs that have both (n > 0)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    ax.scatter([r["punct_enrichment"] for r in points], [r["delta_top5"] for r in points])
    for r in points:
        ax.annotate(r["run"], (r["punct_enrichment"], r["delta_top5"]), fontsize=6)
    r_text = f"r = {correlation['r']:.2f}" if correlation["r"] is not None else "r: too few runs"
    ax.set_title(f"punctuation enrichment vs Δ top-5 ({r_text}, n = {correlation['n']})")
    ax.set_xlabel("punctuation enrichment (log2)")
    ax.set_ylabel("Δ top-5 vs symmetric baseline (pp)")
    ax.axhline(0, color="gray", lw=0.8)
    ax.axvline(0, color="gray", lw=0.8)
    fig.tight_layout()
    save_figure(fig, path)


def run_directories(parser: ArgumentParser, given: list[Path]) -> list[Path]:
    """Run directories from --run/--checkpoint and positional values: a run directory as it is, a checkpoint file
    as its run, a directory of runs (a grid's) as its runs in name order; an error naming every value that is none
    of these."""
    runs, bad = [], []
    for path in given:
        run = path if path.is_dir() else run_dir_of(path) if path.is_file() else None
        inside = sorted(d for d in path.iterdir() if (d / "config.json").is_file()) if path.is_dir() else []
        if run is not None and (run / "config.json").is_file():
            runs.append(run)
        elif inside:
            runs += inside
        else:
            bad.append(run or path)
    if bad:
        parser.error(f"not run directories (no config.json) nor directories of runs: {', '.join(map(str, bad))}")
    return list(dict.fromkeys(runs))


def data_lines(rows: list[dict]) -> list[str]:
    """When the runs' data differ: a paragraph naming each data (fingerprint, shards, tokens) with its runs, so a
    row that differs in `data` says why it is a row of its own."""
    by_data: dict[str, list[dict]] = {}
    for row in rows:
        by_data.setdefault(row["data_description"], []).append(row)
    if len({json.dumps(r["data"]) for r in rows}) < 2:
        return []
    return ["**The runs differ in their data**, so they are rows of their own and never averaged together (the "
            "`data` and `val-tokens` words of a row):", ""] + [
        f"- {description}: {', '.join(r['run'] for r in members)}" for description, members in by_data.items()] + [""]


def compare_runs(run_dirs: list[Path], out: Path, suite: str | None = None, alignment_mode: str = "raw",
                 echo: bool = True) -> dict:
    """Compare the runs of `run_dirs` (run directories) into `out`: compare.json, compare.md, compare_loss.png and,
    when r has points, compare_enrichment.png. `suite`: the logic suite of the tables (None: the generated one);
    `alignment_mode`: raw, ln or residual. Prints the tables when `echo`. Returns compare.json's contents."""
    everyone = [run_row(r, suite, alignment_mode) for r in run_dirs]
    rows = [r for r in everyone if r["outcome"] == "finished"]  # only finished runs are samples
    left_out = [r for r in everyone if r["outcome"] != "finished"]
    add_cells(rows, [read_config(Path(r["path"])) for r in rows])
    add_baselines(rows)
    broken = [r for r in rows if r["bias_mode"] != "none" and r["delta_top5"] is not None
              and r["punct_enrichment"] is not None]
    correlation = pearson([r["punct_enrichment"] for r in broken], [r["delta_top5"] for r in broken])
    make_directory(out)
    tables = {**{key: pivot(rows, key) for key in STATISTICS}, "top5": pivot(rows, "top5", 100.0)}
    result = {"runs": rows, "left_out": [{k: r[k] for k in ("run", "path", "outcome", "why")} for r in left_out],
              "pivots": tables, "pearson_punct_enrichment_vs_delta_top5": correlation, "alignment_mode": alignment_mode}
    write_json(out / "compare.json", result)
    written = ["compare.json", "compare.md", "compare_loss.png"]
    save_figure(runs_loss_figure([(r.name, read_log(r)) for r in run_dirs], "loss curves"), out / written[2])
    enrichment = out / "compare_enrichment.png"
    if correlation["n"]:
        plot_enrichment(broken, correlation, enrichment)
        written.append(enrichment.name)
    else:
        enrichment.unlink(missing_ok=True)  # an earlier comparison's figure would describe other runs

    def cell(v, fmt: str, evaluation: str, scale: float = 1.0) -> str:
        return format(scale * v, fmt) if v is not None else f"run eval.{evaluation}"
    table = [[r["run"], step_label(r["steps"]), r["optimizer"], r["bias_mode"],
              *(format(r[key], ".4f") if r[key] is not None else "not in log.jsonl" for key in STATISTICS),
              cell(r["val_loss"], ".4f", "val_loss"), cell(r["logic_loss"], ".3f", "logic_puzzles"),
              cell(r["top5"], ".1f", "logic_puzzles", 100), cell(r["top1"], ".1f", "logic_puzzles", 100),
              format(r["delta_top5"], "+.1f") if r["delta_top5"] is not None else "-",
              cell(r["align_mean_top"], ".3f", "alignment"),
              cell(r["align_frac_above_null"], ".1f", "alignment", 100),
              cell(r["punct_enrichment"], "+.2f", "alignment")] for r in rows]
    ci = correlation["ci"]
    r_line = (f"Pearson r(punctuation enrichment, Δ top-5) = {correlation['r']:.2f}"
              + (f", 95% CI [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "") + f" (n = {correlation['n']})"
              if correlation["r"] is not None
              else f"Pearson r: not enough symmetry-broken runs with a baseline and both evaluations "
                   f"(n = {correlation['n']})")
    sections = []
    for key, statistic in STATISTICS.items():
        sections += [f"## {statistic.label.capitalize()} (optimizer × attention biases)", "",
                     pivot_markdown(tables[key], ".4f", "not in log.jsonl"), "",
                     f"The {statistic.label}: {statistic.meaning}, from log.jsonl. Mean ± sample std over the seeds "
                     "of a cell, n when more than one (the runs of one seed are one sample: their mean). Δ: a "
                     "column's mean minus the symmetric column's (negative: lower loss with the biases) ± its standard "
                     "error: paired by seed when both cells hold the same seeds (the per-seed differences' std / √n), "
                     "else unpaired (√(s₁²/n₁ + s₀²/n₀)); none below two seeds.", ""]
    sections += data_lines(rows)
    if not rows:
        sections = ["No finished run to compare (the runs below did not finish).", ""]
    if any(r["top5"] is not None for r in rows):
        sections += ["## Logic puzzles top-5 (optimizer × attention biases)", "",
                     pivot_markdown(tables["top5"], ".1f", "run eval.logic_puzzles"), "",
                     "Top-5 accuracy in % on the logic suite; Δ in percentage points.", ""]
    sections += ["## Runs", "",
                 markdown_table(["run", "step", "optimizer", "bias", *(s.label for s in STATISTICS.values()),
                                 "val loss (eval)",
                                 "logic loss", "top-5 %", "top-1 %", "Δ top-5 (pp)", f"align ({alignment_mode})",
                                 "% heads > null", "punct. enrich."], table), "",
                 "A cell `run eval.X` is missing: `python -m eval.report --run RUN` computes every evaluation.", "",
                 r_line, ""]
    if left_out:
        sections += ["## Runs left out", "", "Only finished runs are samples: these are in no table above.", "",
                     *(f"- {r['run']}: {r['why']}" for r in left_out), ""]
    figures = ["![loss curves](compare_loss.png)", ""]
    if enrichment.name in written:
        figures += ["![enrichment vs delta top-5](compare_enrichment.png)", ""]
    atomic_write(out / "compare.md", "\n".join(["# Run comparison", "", *sections, *figures]).encode())
    for r in left_out:
        print(f"compare: left out {r['run']}: {r['why']}")
    for r in rows:
        if len(set(r["steps"].values())) > 1:
            print(f"warning: {r['run']}: evaluations from different steps ({step_label(r['steps'])}); "
                  f"run `python -m eval.report --run {r['path']}` to bring them to one checkpoint")
    if echo:
        print("\n".join(sections))
    print(f"compare: wrote {', '.join(str(out / name) for name in written)}")
    return result


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(module="eval.compare", description=__doc__)
    parser.add_argument("--run", "--checkpoint", dest="run", action="append", type=Path, default=[], metavar="PATH",
                        help="a run directory (or a checkpoint file of one, or a directory of runs) to compare; "
                             "repeat for each")
    parser.add_argument("positional", nargs="*", type=Path, metavar="RUN", help="more run directories")
    parser.add_argument("--out", type=Path, default=Path("runs") / "compare", help="output directory")
    parser.add_argument("--suite", default=None, help="logic suite name (default: the generated suite, else the first)")
    parser.add_argument("--alignment-mode", default="raw", choices=("raw", "ln", "residual"),
                        help="which keys' alignment the table shows (docs/evaluation.md#b_q-alignment-and-enrichment)")
    parser.add_argument("--against-paper", nargs="?", const=paper_data.PUBLISHED, default=None, type=Path,
                        metavar="PUBLISHED.toml", help="also write scorecard.md: the runs cell by cell against the "
                        "paper's published numbers (default file: %(const)s; docs/reproduce.md)")
    args = parser.parse_args(argv)
    if not args.run and not args.positional:
        parser.error("name the runs to compare: --run DIR (repeatable) or run directories")
    run_dirs = run_directories(parser, args.run + args.positional)
    try:  # before comparing: a missing or damaged file is a one-line error and nothing is written
        published = paper_data.load_published(args.against_paper) if args.against_paper else None
    except paper_data.PublishedDataError as exc:
        parser.error(str(exc))
    result = compare_runs(run_dirs, args.out, args.suite, args.alignment_mode)
    if published is not None:
        scorecard.write_scorecard(run_dirs, args.out, published)
    return result


if __name__ == "__main__":
    main()
