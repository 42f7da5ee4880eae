"""Compare runs (arXiv 2601.22257 Tables 1, 2, 5, 14): the optimizer × attention-bias table of the best validation
loss (mean ± std over seeds, Δ against the symmetric baseline with its standard error), then per run the validation
loss, logic top-1/top-5, alignment, punctuation enrichment, Δ top-5 against the run's symmetric baseline, and the
Pearson r between enrichment and Δ top-5.

    python -m eval.compare --run runs/A --run runs/B ... [--out runs/compare] [--suite NAME] [--alignment-mode raw]
    python -m eval.compare runs/table2 --against-paper     # also scorecard.md: the runs against the paper's tables

(`--checkpoint` is the same flag; run directories given without a flag, `python -m eval.compare runs/*`, work too, and
a directory of runs, such as a grid's, stands for its runs.) Reads each run's log.jsonl and eval/*.json (`python -m
eval.report --run DIR` computes them; a missing cell names the evaluation to run). Rows of the pivot tables are the
optimizer and every other setting that differs between the runs, the data included (runs trained or validated on
other data are never averaged together), except the seed (a cell averages its seeds; two runs of one seed are one
sample) and the bias mode (the columns). Δ is paired by seed where the two cells hold the same seeds. The baseline of
a run is the run with bias mode `none`, the same other settings and the same seed. r uses the symmetry-broken runs
that have a baseline; its 95% interval is Fisher's (z = atanh r ± 1.96/√(n−3)). Writes `compare.json`, `compare.md`,
`compare_loss.png` (every loss curve on one axis) and, when r has points, `compare_enrichment.png`; prints the
tables and where it wrote.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import train_gpt
from cli import ArgumentParser
from eval import scorecard
from eval.common import EVAL_DIRNAME, markdown_table, read_config, write_json
from eval.figures import pyplot, save_figure
from eval.curves import runs_loss_figure, validation_losses
from eval.samples import Difference, Summary, data_description, data_identity, difference, per_seed, repeated_seeds
from fileio import atomic_write, exits_on_filesystem_errors, make_directory
from optim import OPTIMIZERS
from run.checkpoint import run_dir_of
from run.log import read_log
from variants import ResearchConfig

BIAS_WORDS = {"none": "symmetric (none)", "bq": "b_Q (bq)", "bv": "b_V (bv)", "bqbv": "b_Q + b_V (bqbv)",
              "learned": "learned b_Q, b_V (learned)"}
AVERAGED = {"seed", "bias_mode", "optimizer"}  # averaged over, the columns, the row's first word


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
    measured = [loss for _, loss in validation_losses(read_log(run_dir))]
    return {
        "run": run_dir.name, "path": str(run_dir), "optimizer": train.get("optimizer"), "steps": steps,
        "data": data_identity(config), "data_description": data_description(config),
        "bias_mode": model.get("bias_mode"), "activation": model.get("activation"), "seed": train.get("seed"),
        "mean_v": model.get("mean_v"),
        "best_val_loss": min(measured) if measured else None,
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


def add_conditions(rows: list[dict], configs: list[dict]) -> None:
    """Set each row's `condition`: its optimizer and every setting that affects results and differs between the
    runs (the optimizer's own settings between runs of the same optimizer), and the data when it differs (the data
    fingerprint or, without one, the files given; the validation budget: samples.data_identity), except the seed
    and the bias mode."""
    keep = {f.name for cls in (train_gpt.GPTConfig, train_gpt.TrainConfig, ResearchConfig)
            for f in dataclasses.fields(cls) if f.metadata.get("affects_results", True)} - AVERAGED
    flat = [{k.replace("_", "-"): v for section in ("model", "train", "research") for k, v in c.get(section, {}).items()
             if k in keep} | data_identity(c) for c in configs]
    varying = sorted(k for k in set().union(*flat) if len({json.dumps(f.get(k)) for f in flat}) > 1)
    for row, values, config in zip(rows, flat, configs):
        same = [c.get("optim", {}) for c, r in zip(configs, rows) if r["optimizer"] == row["optimizer"]]
        own = OPTIMIZERS[row["optimizer"]].config if row["optimizer"] in OPTIMIZERS else None
        optim_varying = sorted(k for k in set().union(*same) if len({json.dumps(s.get(k)) for s in same}) > 1
                               and (own is None or k in {f.name for f in dataclasses.fields(own)}))
        words = [f"{k} {values.get(k)}" for k in varying]
        words += [f"{k.replace('_', '-')} {config['optim'].get(k)}" for k in optim_varying]
        row["condition"] = ", ".join([str(row["optimizer"])] + words)


def add_baselines(rows: list[dict]) -> None:
    """Set `baseline` (run name) and `delta_top5` (percentage points) from the run with bias mode none, the same
    condition (add_conditions) and the same seed."""
    for row in rows:
        key = (row.get("condition", row["optimizer"]), row["seed"])
        base = next((b for b in rows if b["bias_mode"] == "none" and b is not row
                     and (b.get("condition", b["optimizer"]), b["seed"]) == key), None)
        row["baseline"] = base["run"] if base else None
        has_both = base is not None and row["top5"] is not None and base["top5"] is not None
        row["delta_top5"] = 100 * (row["top5"] - base["top5"]) if has_both else None


def pivot(rows: list[dict], metric: str, scale: float = 1.0) -> dict:
    """{"modes": bias modes in order, "rows": [{"condition", "cells": {mode: {"mean", "std", "n", "runs",
    "repeated_seeds", "delta"}}}]}: `metric` × `scale` per condition × bias mode, one value per seed (the runs of a
    seed averaged: samples.per_seed), mean and sample std over the n seeds with a value out of `runs` runs, and the
    difference to the symmetric mode's cell with its standard error (samples.difference; paired by seed when the
    two cells hold the same seeds)."""
    modes = [m for m in BIAS_WORDS if any(r["bias_mode"] == m for r in rows)]
    modes += sorted({r["bias_mode"] for r in rows} - set(modes), key=str)
    table = []
    for condition in dict.fromkeys(r["condition"] for r in rows):
        cells, seeds = {}, {}
        for mode in modes:
            runs = [r for r in rows if r["condition"] == condition and r["bias_mode"] == mode]
            pairs = [(r["seed"], scale * r[metric]) for r in runs if r[metric] is not None]
            seeds[mode] = per_seed(pairs)
            summary = Summary(seeds[mode])
            cells[mode] = {"mean": summary.mean, "std": summary.std, "n": summary.n, "runs": len(runs),
                           "repeated_seeds": repeated_seeds(pairs)}
        for mode, cell in cells.items():
            cell["delta"] = dataclasses.asdict(difference(seeds[mode], seeds["none"])) if "none" in cells else None
        table.append({"condition": condition, "cells": cells})
    return {"metric": metric, "modes": modes, "rows": table}


def pivot_markdown(table: dict, fmt: str, missing: str) -> str:
    """A pivot as Markdown: a column per bias mode (mean ± std, n when more than one seed, and a seed that more
    than one run has) and a Δ column after each mode but the symmetric one (± its standard error)."""
    modes = table["modes"]
    header = ["optimizer and settings"]
    for mode in modes:
        header += [BIAS_WORDS.get(mode, str(mode))] + ([f"Δ {BIAS_WORDS.get(mode, mode).split(' (')[0]}"]
                                                        if mode != "none" and "none" in modes else [])
    body = []
    for row in table["rows"]:
        line = [row["condition"]]
        for mode in modes:
            cell = row["cells"][mode]
            if cell["mean"] is None:
                text = missing if cell["runs"] else "no run"
            else:
                text = format(cell["mean"], fmt) + (f" ± {cell['std']:{fmt}}" if cell["std"] is not None else "")
                notes = [f"n = {cell['n']}"] * (cell["n"] > 1)
                notes += [f"seed {seed} more than once: one sample" for seed in cell["repeated_seeds"]]
                text += f" ({'; '.join(notes)})" if notes else ""
            line.append(text)
            if mode != "none" and "none" in modes:
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
    rows = [run_row(r, suite, alignment_mode) for r in run_dirs]
    add_conditions(rows, [read_config(r) for r in run_dirs])
    add_baselines(rows)
    broken = [r for r in rows if r["bias_mode"] != "none" and r["delta_top5"] is not None
              and r["punct_enrichment"] is not None]
    correlation = pearson([r["punct_enrichment"] for r in broken], [r["delta_top5"] for r in broken])
    make_directory(out)
    tables = {"best_val_loss": pivot(rows, "best_val_loss"), "top5": pivot(rows, "top5", 100.0)}
    result = {"runs": rows, "pivots": tables, "pearson_punct_enrichment_vs_delta_top5": correlation,
              "alignment_mode": alignment_mode}
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
              format(r["best_val_loss"], ".4f") if r["best_val_loss"] is not None else "not in log.jsonl",
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
    sections = [
        "## Best validation loss (optimizer × attention biases)", "",
        pivot_markdown(tables["best_val_loss"], ".4f", "not in log.jsonl"), "",
        "The least validation loss each run's trainer measured (log.jsonl); mean ± sample std over the seeds of a "
        "cell, n when more than one (the runs of one seed are one sample: their mean). Δ: a column's mean minus the "
        "symmetric column's (negative: lower loss with the biases) ± its standard error: paired by seed when both "
        "cells hold the same seeds (the per-seed differences' std / √n), else unpaired (√(s₁²/n₁ + s₀²/n₀)); none "
        "below two seeds.", "", *data_lines(rows)]
    if any(r["top5"] is not None for r in rows):
        sections += ["## Logic puzzles top-5 (optimizer × attention biases)", "",
                     pivot_markdown(tables["top5"], ".1f", "run eval.logic_puzzles"), "",
                     "Top-5 accuracy in % on the logic suite; Δ in percentage points.", ""]
    sections += ["## Runs", "",
                 markdown_table(["run", "step", "optimizer", "bias", "best val loss (log)", "val loss (eval)",
                                 "logic loss", "top-5 %", "top-1 %", "Δ top-5 (pp)", f"align ({alignment_mode})",
                                 "% heads > null", "punct. enrich."], table), "",
                 "A cell `run eval.X` is missing: `python -m eval.report --run RUN` computes every evaluation.", "",
                 r_line, ""]
    figures = ["![loss curves](compare_loss.png)", ""]
    if enrichment.name in written:
        figures += ["![enrichment vs delta top-5](compare_enrichment.png)", ""]
    atomic_write(out / "compare.md", "\n".join(["# Run comparison", "", *sections, *figures]).encode())
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
    parser.add_argument("--against-paper", nargs="?", const=scorecard.PUBLISHED, default=None, type=Path,
                        metavar="PUBLISHED.toml", help="also write scorecard.md: the runs cell by cell against the "
                        "paper's published numbers (default file: %(const)s; docs/reproduce.md)")
    args = parser.parse_args(argv)
    if not args.run and not args.positional:
        parser.error("name the runs to compare: --run DIR (repeatable) or run directories")
    run_dirs = run_directories(parser, args.run + args.positional)
    try:  # before comparing: a missing or damaged file is a one-line error and nothing is written
        published = scorecard.load_published(args.against_paper) if args.against_paper else None
    except scorecard.PublishedDataError as exc:
        parser.error(str(exc))
    result = compare_runs(run_dirs, args.out, args.suite, args.alignment_mode)
    if published is not None:
        scorecard.write_scorecard(run_dirs, args.out, published)
    return result


if __name__ == "__main__":
    main()
