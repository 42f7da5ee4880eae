"""Compare runs (arXiv 2601.22257 Tables 5, 14): validation loss, logic top-1/top-5, alignment, punctuation enrichment,
Δ top-5 against each run's symmetric baseline, and the Pearson r between enrichment and Δ top-5.

    python -m eval.compare runs/A runs/B runs/C ... [--out runs/compare] [--suite NAME] [--alignment-mode raw]

Reads each run's eval/*.json (run `python -m eval.report --run DIR` first); the table's step column is the
checkpoint step the evaluations came from (each evaluation's step where they differ, with a warning). The baseline
of a run is the run in the list with bias_mode `none` and the same optimizer, activation and seed. r uses the
symmetry-broken runs that have a baseline; its 95% interval is Fisher's (z = atanh r ± 1.96/√(n−3)). Writes
`compare.json`, `compare.md`, `compare_loss.png` (all loss curves) and `compare_enrichment.png`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from cli import ArgumentParser
from eval.common import EVAL_DIRNAME, markdown_table, pyplot, read_config, write_json, write_text
from runs import read_log


def pearson(x: list[float], y: list[float]) -> dict:
    """Pearson r with its 95% Fisher-z interval (None where n is too small or a variable is constant)."""
    n = len(x)
    if n < 3:
        return {"r": None, "ci": None, "n": n}
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    if sxx == 0 or syy == 0:
        return {"r": None, "ci": None, "n": n}
    r = sum((a - mx) * (b - my) for a, b in zip(x, y)) / math.sqrt(sxx * syy)
    if n < 4 or abs(r) >= 1:
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
    alignment = (alignment_file or {}).get("modes", {}).get(alignment_mode)
    steps = {name: result.get("step") for name, result in (("val_loss", val), ("logic_puzzles", logic_file),
                                                             ("alignment", alignment_file)) if result is not None}
    return {
        "run": run_dir.name, "path": str(run_dir), "optimizer": train.get("optimizer"), "steps": steps,
        "bias_mode": model.get("bias_mode"), "activation": model.get("activation"), "seed": train.get("seed"),
        "mean_v": model.get("mean_v"),
        "val_loss": val["val_loss"] if val else None,
        "suite": logic["name"] if logic else None,
        "logic_loss": logic["overall"]["logic_loss"] if logic else None,
        "top1": logic["overall"]["top1"] if logic else None,
        "top5": logic["overall"]["top5"] if logic else None,
        "align_mean_top": alignment["mean_top"] if alignment else None,
        "align_frac_above_null": alignment["frac_above_null"] if alignment else None,
        "punct_enrichment": alignment["enrichment"]["pooled"]["punctuation"] if alignment else None,
        "noise_enrichment": alignment["enrichment"]["pooled"]["unicode_noise"] if alignment else None,
    }


def step_label(steps: dict[str, int | None]) -> str:
    """The checkpoint step of a run's evaluations: one number, or each evaluation's step when they differ."""
    distinct = set(steps.values())
    if not distinct:
        return "-"
    if len(distinct) == 1:
        return str(distinct.pop())
    return ", ".join(f"{name} {step}" for name, step in steps.items())


def add_baselines(rows: list[dict]) -> None:
    """Set `baseline` (run name) and `delta_top5` (percentage points) from the matching symmetric run."""
    for row in rows:
        key = (row["optimizer"], row["activation"], row["seed"])
        base = next((b for b in rows if b["bias_mode"] == "none" and (b["optimizer"], b["activation"], b["seed"]) == key
                     and b is not row), None)
        row["baseline"] = base["run"] if base else None
        has_both = base is not None and row["top5"] is not None and base["top5"] is not None
        row["delta_top5"] = 100 * (row["top5"] - base["top5"]) if has_both else None


def plot_losses(run_dirs: list[Path], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, run_dir in enumerate(run_dirs):
        log = read_log(run_dir)
        color = plt.cm.tab10(i % 10)
        x_key = "tokens" if log and all("tokens" in r for r in log) else "step"
        train = [(r[x_key], r["train_loss"]) for r in log if r.get("train_loss") is not None]
        val = [(r[x_key], r["val_loss"]) for r in log if r.get("val_loss") is not None]
        if train:
            ax.plot(*zip(*train), lw=0.8, alpha=0.5, color=color)
        if val:
            ax.plot(*zip(*val), "o-", ms=3, color=color, label=f"{run_dir.name} (val)")
        elif train:
            ax.plot([], [], color=color, label=run_dir.name)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (thin: train, dots: validation)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_enrichment(rows: list[dict], correlation: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    points = [r for r in rows if r["delta_top5"] is not None and r["punct_enrichment"] is not None
              and r["bias_mode"] != "none"]
    ax.scatter([r["punct_enrichment"] for r in points], [r["delta_top5"] for r in points])
    for r in points:
        ax.annotate(r["run"], (r["punct_enrichment"], r["delta_top5"]), fontsize=6)
    r_text = f"r = {correlation['r']:.2f}" if correlation["r"] is not None else "r: n/a"
    ax.set_title(f"punctuation enrichment vs Δ top-5 ({r_text}, n = {correlation['n']})")
    ax.set_xlabel("punctuation enrichment (log2)")
    ax.set_ylabel("Δ top-5 vs symmetric baseline (pp)")
    ax.axhline(0, color="gray", lw=0.8)
    ax.axvline(0, color="gray", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(module="eval.compare", description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--out", type=Path, default=Path("runs") / "compare", help="output directory")
    parser.add_argument("--suite", default=None, help="logic suite name (default: the generated suite, else the first)")
    parser.add_argument("--alignment-mode", default="raw", choices=("raw", "ln", "residual"),
                        help="which eval.alignment mode the table shows")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "config.json").is_file()]
    if missing:
        parser.error(f"not run directories (no config.json): {', '.join(missing)}")
    rows = [run_row(r, args.suite, args.alignment_mode) for r in args.runs]
    add_baselines(rows)
    broken = [r for r in rows if r["bias_mode"] != "none" and r["delta_top5"] is not None
              and r["punct_enrichment"] is not None]
    correlation = pearson([r["punct_enrichment"] for r in broken], [r["delta_top5"] for r in broken])
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"runs": rows, "pearson_punct_enrichment_vs_delta_top5": correlation,
              "alignment_mode": args.alignment_mode}
    write_json(args.out / "compare.json", result)
    plot_losses(args.runs, args.out / "compare_loss.png")
    plot_enrichment(rows, correlation, args.out / "compare_enrichment.png")

    def pct(v):
        return f"{100 * v:.1f}%" if v is not None else "-"

    def num(v, fmt=".3f"):
        return format(v, fmt) if v is not None else "-"
    table = [[r["run"], step_label(r["steps"]), r["optimizer"], r["bias_mode"], num(r["val_loss"]),
              num(r["logic_loss"]), pct(r["top5"]), pct(r["top1"]), num(r["delta_top5"], "+.1f"),
              num(r["align_mean_top"]), pct(r["align_frac_above_null"]), num(r["punct_enrichment"], "+.2f")]
             for r in rows]
    ci = correlation["ci"]
    r_line = (f"Pearson r(punctuation enrichment, Δ top-5) = {correlation['r']:.2f}"
              + (f", 95% CI [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "") + f" (n = {correlation['n']})"
              if correlation["r"] is not None
              else f"Pearson r: not enough runs with a baseline (n = {correlation['n']})")
    write_text(args.out / "compare.md", "\n".join([
        "# Run comparison", "",
        markdown_table(["run", "step", "optimizer", "bias", "val loss", "logic loss", "top-5", "top-1", "Δ top-5 (pp)",
                        f"align ({args.alignment_mode})", "% > null", "punct. enrich."], table), "",
        r_line, "", "![loss curves](compare_loss.png)", "",
        "![enrichment vs delta top-5](compare_enrichment.png)", ""]))
    for r in rows:
        if len(set(r["steps"].values())) > 1:
            print(f"warning: {r['run']}: evaluations from different steps ({step_label(r['steps'])}); "
                  f"run `python -m eval.report --run {r['path']}` to bring them to one checkpoint")
    print(r_line)
    return result


if __name__ == "__main__":
    main()
