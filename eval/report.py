"""One Markdown page per run (`<run>/report.md`) linking every figure: the page to open after a run.

    python -m eval.report --run runs/NAME [--quick | --full] [--skip-missing]

Runs every evaluation (val_loss, logic_puzzles with the fixed and the paper's suites, alignment, dynamics) whose
outputs are missing or were computed from another checkpoint than the one reported on (the outputs' records in
`eval/manifest.json`: checkpoint path, step and sha256; docs/evaluation.md#outputs-and-reports), then writes
`report.md` with the configuration, the training summary from log.jsonl, a table of the evaluations with the step
each came from, each evaluation's headline numbers, figures and Markdown page, `eval/report_loss.png` and
`eval/report.json`. `--skip-missing` runs nothing and reports what exists, marking outputs of another checkpoint as
such.

Budgets follow the run: a run that trained fewer than 20M tokens (smoke and test runs) gets the quick evaluation set
(25 generated logic prompts per category, 32,768 tokens of text for the residual alignment), a longer run the full
set; `--quick` and `--full` choose. Full outputs stand for a quick report; quick ones are rerun by a full report.

Each evaluation prints a line when it starts and when it ends, with its time. The page is rewritten after every
evaluation, so an interrupted report (Ctrl-C: exit 130) leaves a page with what was done. Every failed evaluation is
printed (module and error, with its traceback) and named in the report; what succeeded is still written, and the
command exits with status 1.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from cli import ArgumentParser
import export
from eval import alignment, dynamics, logic_puzzles, val_loss
from eval.configuration import read_config
from eval.curves import loss_figure, validation_losses
from eval.figures import save_figure
from eval.outputs import (annotate_output, checkpoint_identity, markdown_table, read_manifest, stale_reason,
                          write_json)
from eval.samples import STATISTICS
from eval.target import add_target_args, load_target_checkpoint, output_dir, resolve_target
from fileio import LockHeldError, atomic_write, exits_on_filesystem_errors, hold_lock
from run.log import read_log

EVALUATIONS = {"val_loss": val_loss.main, "logic_puzzles": logic_puzzles.main, "alignment": alignment.main,
               "dynamics": dynamics.main}
QUICK_BELOW_TOKENS = 20_000_000  # runs that trained fewer tokens get the quick evaluation set by default
# What a report evaluates besides the defaults: the paper's 14-item logic suite (under its own protocol) beside the
# fixed one, so the scorecard finds the paper's numbers of every reported run (docs/reproduce.md).
REPORT_FLAGS = {"logic_puzzles": ["--suite", "fixed", "--suite", "paper"]}
QUICK_FLAGS = {"logic_puzzles": ["--per-category", "25"], "alignment": ["--residual-tokens", "32768"]}
QUICK_WORDS = "25 generated logic prompts per category, 32,768 tokens of text for the residual alignment"
REPORT_LOCK = ".report.lock"  # in the output directory: held by the eval.report writing there


def training_summary(log: list[dict]) -> dict:
    """Final losses, the validation statistics (eval.samples.STATISTICS: the best and the least validation loss,
    one name each on every page), throughput and time from log.jsonl records."""
    if not log:
        return {}
    val = [loss for _, loss in validation_losses(log)]
    last = log[-1]
    speeds = [r["tokens_per_s"] for r in log if r.get("tokens_per_s")]
    mfus = [r["mfu"] for r in log if r.get("mfu")]
    return {"steps": last.get("step"), "tokens": last.get("tokens"), "elapsed_s": last.get("train_time_s"),
            "final_train_loss": next((r["train_loss"] for r in reversed(log) if r.get("train_loss") is not None), None),
            "final_val_loss": val[-1] if val else None,
            **{key: statistic.read(log) for key, statistic in STATISTICS.items()},
            "tokens_per_s": speeds[-1] if speeds else None, "mfu": mfus[-1] if mfus else None}


def choose_budget(quick: bool, full: bool, tokens: int | None) -> tuple[str, str]:
    """("quick" or "full", why) for a report on a run that trained `tokens` (None: unknown, the full set)."""
    if quick or full:
        return ("quick" if quick else "full"), "chosen with --" + ("quick" if quick else "full")
    if tokens is None:
        return "full", "the checkpoint does not say how long its run trained; --quick for the quick set"
    if tokens < QUICK_BELOW_TOKENS:
        return "quick", f"the run trained {tokens:,} tokens, fewer than {QUICK_BELOW_TOKENS:,}; --full for the full set"
    return "full", f"the run trained {tokens:,} tokens"


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
    """Run `eval.<name>` with `argv`; None on success, else the error (printed with its traceback to stderr).
    KeyboardInterrupt propagates."""
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


def current_reason(eval_dir: Path, name: str, identity: dict, budget: str) -> str | None:
    """stale_reason, and for a full report outputs computed with the quick budget."""
    reason = stale_reason(eval_dir, name, identity)
    quick = read_manifest(eval_dir)["outputs"].get(name, {}).get("budget") == "quick"
    if reason is None and budget == "full" and quick and name in QUICK_FLAGS:
        return "computed with the quick budget"
    return reason


class Page:
    """The report's state (per evaluation: results, status) and its files, written again after each change."""

    def __init__(self, run_dir: Path, eval_dir: Path, ckpt_path: Path, step: int | None, identity: dict,
                 budget: tuple[str, str], config: dict) -> None:
        self.run_dir, self.eval_dir, self.ckpt_path, self.step, self.identity = (run_dir, eval_dir, ckpt_path, step,
                                                                               identity)
        self.budget, self.config = budget, config
        self.results: dict[str, dict] = {}
        self.status: dict[str, str] = {}
        self.failures: dict[str, str] = {}
        self.log = read_log(run_dir)
        self.summary = training_summary(self.log)
        if self.log:
            save_figure(loss_figure(self.log, title=run_dir.name), eval_dir / "report_loss.png")

    def take_outputs(self, name: str, reason: str | None, skip_missing: bool) -> None:
        """Take evaluation `name`'s outputs as they are: current, stale (shown with --skip-missing) or absent."""
        entry = read_manifest(self.eval_dir)["outputs"].get(name)
        if reason is None or (skip_missing and entry is not None and reason.startswith("computed from")):
            self.results[name] = json.loads((self.eval_dir / f"{name}.json").read_text())
            self.status[name] = "current" if reason is None else f"stale: {reason}"
        else:
            self.status[name] = reason

    def write(self) -> dict:
        """report.md and eval/report.json from the state so far; returns the index."""
        run_dir, eval_dir, results, status, step = self.run_dir, self.eval_dir, self.results, self.status, self.step
        manifest = read_manifest(eval_dir)["outputs"]
        rel = eval_dir.relative_to(run_dir) if eval_dir.is_relative_to(run_dir) else eval_dir
        model, train, optim = (self.config.get(section, {}) for section in ("model", "train", "optim"))
        lines = [f"# Run report — {run_dir.name}, step {step}", "",
                 f"Checkpoint `{self.ckpt_path}` (step {step}, sha256 `{self.identity['sha256'][:12]}`). "
                 f"Model {model.get('n_layer')}L/{model.get('n_head')}H/{model.get('n_embd')}C, "
                 f"{model.get('activation')}, bias mode **{model.get('bias_mode')}**; "
                 f"optimizer **{train.get('optimizer')}** (lr {optim.get('lr')}); seed {train.get('seed')}. "
                 "Full configuration: `config.json`; code: `code/`.", "",
                 f"Evaluation budget: **{self.budget[0]}** ({self.budget[1]})"
                 + (f": {QUICK_WORDS}." if self.budget[0] == "quick" else "."), ""]
        if self.summary:
            rows = [[STATISTICS[k].label if k in STATISTICS else k, f"{v:.4g}" if isinstance(v, float) else v]
                    for k, v in self.summary.items() if v is not None]
            lines += ["## Training", "", markdown_table(["", "value"], rows), ""]
            if (eval_dir / "report_loss.png").is_file():
                lines += [f"![loss curves]({rel}/report_loss.png)", ""]
        rows = [[name, results[name].get("step") if name in results else "-",
                 manifest[name]["checkpoint"]["sha256"][:12] if name in results else "-", status.get(name, "-")]
                for name in EVALUATIONS]
        lines += ["## Evaluations", "", markdown_table(["evaluation", "step", "checkpoint sha256", "status"], rows), ""]
        for name in EVALUATIONS:
            lines += [f"## {name.replace('_', ' ').capitalize()}", ""]
            if name not in results:
                lines += [f"Not available: {status.get(name, 'not reached')}.", ""]
                continue
            if status[name] != "current":
                lines += [f"**Not from the reported checkpoint** ({status[name]}).", ""]
            files = [f for f in manifest[name]["files"] if (eval_dir / f).is_file()]
            lines += _section(name, results[name]) + [""]
            lines += [f"Details: [{f}]({rel}/{f})" for f in files if f.endswith(".md")] + [""]
            lines += [f"![{Path(f).stem}]({rel}/{f})" for f in files if f.endswith(".png")] + [""]
        atomic_write(run_dir / "report.md", "\n".join(lines).encode())
        index = {"run": str(run_dir), "checkpoint": self.identity, "step": step, "training": self.summary,
                 "budget": self.budget[0],
                 "evaluations": {name: {"status": status.get(name, "not reached"),
                                        "step": results[name].get("step") if name in results else None}
                                 for name in EVALUATIONS},
                 "failures": self.failures,
                 "figures": sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.png"))}
        write_json(eval_dir / "report.json", index)
        return index


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> dict:
    """Write the report; exits with status 1 (after writing) when an evaluation failed, 130 when interrupted, 2 on a
    filesystem error (docs/runs.md#filesystem-errors)."""
    parser = ArgumentParser(module="eval.report", description=__doc__)
    add_target_args(parser)
    parser.add_argument("--skip-missing", action="store_true",
                        help="run no evaluation: report the outputs that exist, marking those of another checkpoint")
    budget_flags = parser.add_mutually_exclusive_group()
    budget_flags.add_argument("--quick", action="store_true",
                              help=f"the quick evaluation set ({QUICK_WORDS}) whatever the run's size")
    budget_flags.add_argument("--full", action="store_true",
                              help="the full evaluation set whatever the run's size (default for runs that trained "
                                   f"{QUICK_BELOW_TOKENS:,} tokens or more)")
    args = parser.parse_args(argv)
    run_dir, ckpt_path, _ = resolve_target(args.checkpoint)
    config = read_config(run_dir)  # before the evaluations: a damaged config.json fails at once
    eval_dir = output_dir(args, run_dir)
    try:  # one report at a time per output directory
        lock = hold_lock(eval_dir / REPORT_LOCK, f"eval.report pid {os.getpid()} on host {socket.gethostname()}")
    except LockHeldError as exc:
        raise SystemExit(f"error: {eval_dir} is in use by {exc.holder}: wait for it to finish, or stop it") from None
    with lock:
        return write_report(args, run_dir, ckpt_path, config, eval_dir)


def write_report(args: argparse.Namespace, run_dir: Path, ckpt_path: Path, config: dict, eval_dir: Path) -> dict:
    """The report of main's parsed `args`: the evaluations to run (each in this process), then the page."""
    checkpoint = load_target_checkpoint(ckpt_path)
    step = checkpoint["step"]
    identity = checkpoint_identity(ckpt_path, step)
    budget = choose_budget(args.quick, args.full,
                           None if export.is_exported(ckpt_path) else checkpoint["metrics"]["tokens"])
    page = Page(run_dir, eval_dir, ckpt_path, step, identity, budget, config)
    todo = []
    for name in EVALUATIONS:
        if name == "dynamics" and export.is_exported(ckpt_path):
            page.status[name] = "not applicable: an exported model keeps no optimizer state"
            continue
        reason = (stale_reason(eval_dir, name, identity) if args.skip_missing
                  else current_reason(eval_dir, name, identity, budget[0]))
        if reason is not None and not args.skip_missing:
            todo.append((name, reason))
            page.status[name] = f"to run: {reason}"
        else:
            page.take_outputs(name, reason, args.skip_missing)
    page.write()
    print(f"report: {run_dir.name}, step {step}: {len(todo)} of {len(EVALUATIONS)} evaluations to run, "
          f"{budget[0]} budget ({budget[1]})", flush=True)
    target = ["--checkpoint", str(args.checkpoint), "--out", str(eval_dir), "--device", args.device]
    for i, (name, reason) in enumerate(todo, 1):
        print(f"report: [{i}/{len(todo)}] eval.{name} ({reason}) ...", flush=True)
        start = time.perf_counter()
        try:
            error = run_evaluation(name, target + REPORT_FLAGS.get(name, [])
                                   + (QUICK_FLAGS.get(name, []) if budget[0] == "quick" else []))
        except KeyboardInterrupt:
            for later, _ in todo[i - 1:]:
                page.status[later] = "interrupted: run the report again"
            page.write()
            print(f"\nreport: interrupted during eval.{name}; {run_dir / 'report.md'} shows what was done",
                  file=sys.stderr)
            raise SystemExit(130) from None
        reason = stale_reason(eval_dir, name, identity)
        if error is None and reason is not None:
            error = (f"it ran but left no outputs recorded for this checkpoint ({reason}; see "
                     "eval.outputs.record_outputs)")
            print(f"report: eval.{name} failed: {error}", file=sys.stderr, flush=True)
        if error is not None:
            page.failures[name] = error
            page.status[name] = f"failed: {error}"
        else:
            annotate_output(eval_dir, name, budget=budget[0])
            page.take_outputs(name, None, False)
        page.write()
        print(f"report: [{i}/{len(todo)}] eval.{name} {'failed' if error else 'done'} in "
              f"{time.perf_counter() - start:.1f}s", flush=True)
    index = page.write()
    print(f"report: {run_dir / 'report.md'}")
    if page.failures:
        for name, error in page.failures.items():
            print(f"report: FAILED eval.{name}: {error}", file=sys.stderr)
        raise SystemExit(f"report: {len(page.failures)} of {len(EVALUATIONS)} evaluations failed "
                         f"({', '.join(page.failures)}); the report shows the others")
    return index


if __name__ == "__main__":
    main()
