"""One Markdown page per run (`<run>/report.md`) linking every figure: the page to open after a run.

    python -m eval.report --run runs/NAME [--skip-missing]

Runs every evaluation (val_loss, logic_puzzles, alignment, dynamics) whose outputs are missing or were computed
from another checkpoint than the one reported on (the outputs' records in `eval/manifest.json`: checkpoint path,
step and sha256; docs/evaluation.md#outputs-and-reports), then writes `report.md` with the configuration, the
training summary from log.jsonl, a table of the evaluations with the step each came from, each evaluation's headline
numbers, figures and Markdown page, `eval/report_loss.png` and `eval/report.json`. `--skip-missing` runs nothing
and reports what exists, marking outputs of another checkpoint as such.

Every failed evaluation is printed (module and error, with its traceback) and named in the report; what succeeded
is still written, and the command exits with status 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import export
from eval import alignment, dynamics, logic_puzzles, val_loss
from eval.common import (
    add_target_args,
    checkpoint_identity,
    load_target_checkpoint,
    markdown_table,
    output_dir,
    read_config,
    read_manifest,
    resolve_target,
    stale_reason,
    write_json,
    write_text,
)
from eval.val_loss import plot_loss_curves
from runs import read_log

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
    """Headline lines for one evaluation (none for an evaluation without a headline here: its page is linked)."""
    step = results.get("step")
    if name == "val_loss":
        return [f"**Validation loss {results['val_loss']:.4f}** on {results['tokens']:,} fixed tokens (step {step})."]
    if name == "logic_puzzles":
        rows = [[s["name"], step, s["overall"]["n"], f"{100 * s['overall']['top1']:.1f}",
                 f"{100 * s['overall']['top5']:.1f}", f"{s['overall']['logic_loss']:.3f}"] for s in results["suites"]]
        return [markdown_table(["suite", "step", "n", "top-1 %", "top-5 %", "logic loss"], rows)]
    if name == "alignment":
        rows = [[m, step, f"{r['mean_top']:.3f}", f"{r['max_top']:.3f}", f"{100 * r['frac_above_null']:.1f}",
                 f"{r['enrichment']['pooled']['punctuation']:+.2f}",
                 f"{r['enrichment']['pooled']['unicode_noise']:+.2f}"] for m, r in results["modes"].items()]
        return [markdown_table(["keys", "step", "mean top", "max top", "% heads > null", "punct.", "noise"], rows)]
    if name == "dynamics":
        last = results["checkpoints"][-1]
        summary = last["summary"]
        return [f"Step {last['step']}: |J̃_QK| {summary['J_QK']:.3g}, |J̃_VO| {summary['J_VO']:.3g}, "
                f"f_rot QK {100 * summary['f_rot_QK']:.2f}%, VO {100 * summary['f_rot_VO']:.2f}% (means over heads)."]
    return []


def run_evaluation(name: str, argv: list[str]) -> str | None:
    """Run `eval.<name>` with `argv`; None on success, else the error (printed with its traceback to stderr)."""
    print(f"report: running eval.{name}", flush=True)
    try:
        EVALUATIONS[name](argv)
    except (Exception, SystemExit) as exc:  # SystemExit: a CLI's own clear error (bad flag, missing file)
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            return None
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        print(f"report: eval.{name} failed: {error}", file=sys.stderr, flush=True)
        return error
    return None


def main(argv: list[str] | None = None) -> dict:
    """Write the report; exits with status 1 (after writing) when an evaluation failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(parser)
    parser.add_argument("--skip-missing", action="store_true",
                        help="run no evaluation: report the outputs that exist, marking those of another checkpoint")
    args = parser.parse_args(argv)
    run_dir, ckpt_path, _ = resolve_target(args.checkpoint)
    config = read_config(run_dir)  # before the evaluations: a damaged config.json fails at once
    eval_dir = output_dir(args, run_dir)
    step = load_target_checkpoint(ckpt_path).get("step")
    identity = checkpoint_identity(ckpt_path, step)
    target = ["--checkpoint", str(args.checkpoint)]
    results, failures, status = {}, {}, {}
    for name in EVALUATIONS:
        if name == "dynamics" and export.is_exported(ckpt_path):
            status[name] = "not applicable: an exported model keeps no optimizer state"
            continue
        reason = stale_reason(eval_dir, name, identity)
        if reason is not None and not args.skip_missing:
            print(f"report: {name}: {reason}")
            error = run_evaluation(name, target + ["--out", str(eval_dir), "--device", args.device])
            reason = stale_reason(eval_dir, name, identity)
            if error is None and reason is not None:
                error = (f"it ran but left no outputs recorded for this checkpoint ({reason}; "
                         "see eval.common.record_outputs)")
                print(f"report: eval.{name} failed: {error}", file=sys.stderr, flush=True)
            if error is not None:
                failures[name] = error
                status[name] = f"failed: {error}"
                continue
        entry = read_manifest(eval_dir)["outputs"].get(name)
        if reason is None or (args.skip_missing and entry is not None and reason.startswith("computed from")):
            results[name] = json.loads((eval_dir / f"{name}.json").read_text())
            status[name] = "current" if reason is None else f"stale: {reason}"
        else:
            status[name] = reason
    manifest = read_manifest(eval_dir)["outputs"]
    log = read_log(run_dir)
    summary = training_summary(log)
    if log:
        plot_loss_curves(log, eval_dir / "report_loss.png", title=run_dir.name)
    rel = eval_dir.relative_to(run_dir) if eval_dir.is_relative_to(run_dir) else eval_dir
    model, train, optim = config.get("model", {}), config.get("train", {}), config.get("optim", {})
    lines = [f"# Run report — {run_dir.name}, step {step}", "",
             f"Checkpoint `{ckpt_path}` (step {step}, sha256 `{identity['sha256'][:12]}`). "
             f"Model {model.get('n_layer')}L/{model.get('n_head')}H/{model.get('n_embd')}C, "
             f"{model.get('activation')}, bias mode **{model.get('bias_mode')}**; "
             f"optimizer **{train.get('optimizer')}** (lr {optim.get('lr')}); seed {train.get('seed')}. "
             "Full configuration: `config.json`; code: `code/`.", ""]
    if summary:
        rows = [[k, f"{v:.4g}" if isinstance(v, float) else v] for k, v in summary.items() if v is not None]
        lines += ["## Training", "", markdown_table(["", "value"], rows), ""]
        if (eval_dir / "report_loss.png").is_file():
            lines += [f"![loss curves]({rel}/report_loss.png)", ""]
    rows = [[name, results[name].get("step") if name in results else "-",
             manifest[name]["checkpoint"]["sha256"][:12] if name in results else "-", status[name]]
            for name in EVALUATIONS]
    lines += ["## Evaluations", "", markdown_table(["evaluation", "step", "checkpoint sha256", "status"], rows), ""]
    for name in EVALUATIONS:
        lines += [f"## {name.replace('_', ' ').capitalize()}", ""]
        if name not in results:
            lines += [f"Not available: {status[name]}.", ""]
            continue
        if status[name] != "current":
            lines += [f"**Not from the reported checkpoint** ({status[name]}).", ""]
        files = [f for f in manifest[name]["files"] if (eval_dir / f).is_file()]
        lines += _section(name, results[name]) + [""]
        lines += [f"Details: [{f}]({rel}/{f})" for f in files if f.endswith(".md")] + [""]
        lines += [f"![{Path(f).stem}]({rel}/{f})" for f in files if f.endswith(".png")] + [""]
    write_text(run_dir / "report.md", "\n".join(lines))
    index = {"run": str(run_dir), "checkpoint": identity, "step": step, "training": summary,
             "evaluations": {name: {"status": status[name], "step": results[name].get("step") if name in results
                                    else None} for name in EVALUATIONS},
             "failures": failures,
             "figures": sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.png"))}
    write_json(eval_dir / "report.json", index)
    print(f"report: {run_dir / 'report.md'}")
    if failures:
        for name, error in failures.items():
            print(f"report: FAILED eval.{name}: {error}", file=sys.stderr)
        raise SystemExit(f"report: {len(failures)} of {len(EVALUATIONS)} evaluations failed "
                         f"({', '.join(failures)}); the report shows the others")
    return index


if __name__ == "__main__":
    main()
