"""One Markdown page per run (`<run>/report.md`) linking every figure: the page to open after a run.

    python -m eval.report --run runs/NAME [--skip-missing]

Runs the evaluations whose results are missing (val_loss, logic_puzzles, alignment, dynamics; `--skip-missing`
only collects what exists), then writes `report.md` with the configuration, the training summary from log.jsonl,
each evaluation's headline numbers and figures, links to their Markdown pages, `eval/report_loss.png` and
`eval/report.json`.
"""
from __future__ import annotations

import argparse
import json

from eval import alignment, dynamics, logic_puzzles, val_loss
from eval.common import add_target_args, markdown_table, output_dir, read_config, resolve_target, write_json
from eval.val_loss import plot_loss_curves
from train_gpt import read_log

EVALUATIONS = {"val_loss": val_loss.main, "logic_puzzles": logic_puzzles.main, "alignment": alignment.main,
               "dynamics": dynamics.main}


def training_summary(log: list[dict]) -> dict:
    """Final and best losses, throughput and time from log.jsonl records."""
    if not log:
        return {}
    val = [r["val_loss"] for r in log if r.get("val_loss") is not None]
    last = log[-1]
    speeds = [r["tokens_per_s"] for r in log if r.get("tokens_per_s")]
    mfus = [r["mfu"] for r in log if r.get("mfu")]
    return {"steps": last.get("step"), "tokens": last.get("tokens"), "elapsed_s": last.get("train_time_s"),
            "final_train_loss": next((r["train_loss"] for r in reversed(log) if r.get("train_loss") is not None), None),
            "final_val_loss": val[-1] if val else None, "best_val_loss": min(val) if val else None,
            "tokens_per_s": speeds[-1] if speeds else None, "mfu": mfus[-1] if mfus else None}


def _section(name: str, results: dict) -> list[str]:
    """Headline lines for one evaluation."""
    if name == "val_loss":
        return [f"**Validation loss {results['val_loss']:.4f}** on {results['tokens']:,} fixed tokens "
                f"(step {results['step']})."]
    if name == "logic_puzzles":
        rows = [[s["name"], s["overall"]["n"], f"{100 * s['overall']['top1']:.1f}", f"{100 * s['overall']['top5']:.1f}",
                 f"{s['overall']['logic_loss']:.3f}"] for s in results["suites"]]
        return [markdown_table(["suite", "n", "top-1 %", "top-5 %", "logic loss"], rows)]
    if name == "alignment":
        rows = [[m, f"{r['mean_top']:.3f}", f"{r['max_top']:.3f}", f"{100 * r['frac_above_null']:.1f}",
                 f"{r['enrichment']['pooled']['punctuation']:+.2f}",
                 f"{r['enrichment']['pooled']['unicode_noise']:+.2f}"] for m, r in results["modes"].items()]
        return [markdown_table(["keys", "mean top", "max top", "% heads > null", "punct.", "noise"], rows)]
    last = results["checkpoints"][-1]["summary"]
    return [f"Last checkpoint: |J̃_QK| {last['J_QK']:.3g}, |J̃_VO| {last['J_VO']:.3g}, "
            f"f_rot QK {100 * last['f_rot_QK']:.2f}%, VO {100 * last['f_rot_VO']:.2f}% (means over heads)."]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(parser)
    parser.add_argument("--skip-missing", action="store_true", help="do not run missing evaluations")
    args = parser.parse_args(argv)
    run_dir, ckpt_path = resolve_target(args.run, args.checkpoint)
    eval_dir = output_dir(args, run_dir)
    target = ["--run", str(run_dir)] if args.run is not None else ["--checkpoint", str(ckpt_path)]
    results, failures = {}, {}
    for name, evaluate in EVALUATIONS.items():
        path = eval_dir / f"{name}.json"
        if not path.is_file() and not args.skip_missing:
            try:
                evaluate(target + ["--out", str(eval_dir), "--device", args.device])
            except (ValueError, FileNotFoundError) as e:  # e.g. no optimizer state, no validation data
                failures[name] = str(e)
        if path.is_file():
            results[name] = json.loads(path.read_text())
    config = read_config(run_dir)
    log = read_log(run_dir)
    summary = training_summary(log)
    if log:
        plot_loss_curves(log, eval_dir / "report_loss.png", title=run_dir.name)
    rel = eval_dir.relative_to(run_dir) if eval_dir.is_relative_to(run_dir) else eval_dir
    model, train, optim = config.get("model", {}), config.get("train", {}), config.get("optim", {})
    lines = [f"# Run report — {run_dir.name}", "",
             f"Checkpoint `{ckpt_path}`. Model {model.get('n_layer')}L/{model.get('n_head')}H/{model.get('n_embd')}C, "
             f"{model.get('activation')}, bias mode **{model.get('bias_mode')}**; "
             f"optimizer **{train.get('optimizer')}** (lr {optim.get('lr')}); seed {train.get('seed')}. "
             "Full configuration: `config.json`; code: `code/`.", ""]
    if summary:
        rows = [[k, f"{v:.4g}" if isinstance(v, float) else v] for k, v in summary.items() if v is not None]
        lines += ["## Training", "", markdown_table(["", "value"], rows), "",
                  f"![loss curves]({rel}/report_loss.png)", ""]
    for name in EVALUATIONS:
        lines += [f"## {name.replace('_', ' ').capitalize()}", ""]
        if name in results:
            lines += _section(name, results[name]) + ["", f"Details: [{name}.md]({rel}/{name}.md)", ""]
            lines += [f"![{png.stem}]({rel}/{png.name})" for png in sorted(eval_dir.glob(f"{name.split('_')[0]}*.png"))]
            lines.append("")
        else:
            lines += [f"Not available: {failures.get(name, 'not computed')}.", ""]
    (run_dir / "report.md").write_text("\n".join(lines))
    index = {"run": str(run_dir), "checkpoint": str(ckpt_path), "training": summary,
             "evaluations": sorted(results), "failures": failures,
             "figures": sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.png"))}
    write_json(eval_dir / "report.json", index)
    print(f"report: {run_dir / 'report.md'}")
    return index


if __name__ == "__main__":
    main()
