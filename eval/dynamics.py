"""Angular momentum and rotational fraction of attention heads (docs/evaluation.md; arXiv 2601.22257 §3, App. C).

    python -m eval.dynamics --run runs/NAME          # every checkpoint of the run + the online log
    python -m eval.dynamics --checkpoint FILE        # one checkpoint

From a checkpoint's optimizer state (the velocity u: ECD Π/‖Π‖; SGDM −momentum buffer; AdamW −m̂/(√v̂ + ε), each
scaled to global norm 1: each optimizer's `saved_velocity`) per layer and head: |J̃_QK|, |J̃_VO|, the exact f_rot per
sector and the paper's approximation (eq. 24); between consecutive checkpoints the weight drift ratio. The trainer's
`--dynamics-every N` writes the same quantities (means over heads) into log.jsonl; they are plotted over training.
Writes `dynamics.json`, `dynamics.png` (per-head maps of the last checkpoint), `dynamics_training.png`, `dynamics.md`,
recorded with the target checkpoint (with `--run`: latest.pt) in `manifest.json`
(docs/evaluation.md#angular-momentum-and-rotational-fraction).
"""
from __future__ import annotations

import torch

from cli import ArgumentParser
import export
from run.checkpoint import TRAINING, run_checkpoints
from run.log import read_log
from eval.curves import MARKERS_BELOW
from eval.figures import head_maps_figure, pyplot, save_figure, step_axis
from eval.outputs import checkpoint_identity, markdown_table, record_outputs, write_json
from eval.target import add_target_args, load_target_checkpoint, output_dir, resolve_target
from fileio import atomic_write, exits_on_filesystem_errors
from gauge.dynamics import head_dynamics, plain_name, velocity_from_state_dict, weight_drift_ratio
from optim import OPTIMIZERS

LABELS = {"J_QK": "angular momentum |J̃| of QK", "J_VO": "angular momentum |J̃| of VO",
          "f_rot_QK": "rotational fraction of QK", "f_rot_VO": "rotational fraction of VO",
          "f_rot_QK_approx": "rotational fraction of QK (eq. 24)",
          "f_rot_VO_approx": "rotational fraction of VO (eq. 24)"}


def _params(ckpt: dict) -> dict[str, torch.Tensor]:
    return {plain_name(n): t for n, t in ckpt["model"].items()}


def checkpoint_dynamics(ckpt: dict) -> dict:
    """Per-head (L×H lists) and summary (mean over heads; J also as the total √Σ J²) diagnostics of a checkpoint."""
    if ckpt["kind"] != TRAINING:
        raise ValueError(f"a checkpoint of kind {ckpt['kind']} holds no optimizer state, so the velocity is unknown; "
                         "eval.dynamics reads the checkpoints of a training run")
    n_head = ckpt["config"]["model"]["n_head"]
    optimizer = OPTIMIZERS[ckpt["config"]["train"]["optimizer"]].optimizer
    per_head = head_dynamics(_params(ckpt), velocity_from_state_dict(optimizer, ckpt["optimizer"]), n_head)
    summary = {key: float(value.mean()) for key, value in per_head.items()}
    summary.update({f"{key}_total": float(per_head[key].square().sum().sqrt()) for key in ("J_QK", "J_VO")})
    return {"step": ckpt["step"], "tokens": ckpt["metrics"]["tokens"], "summary": summary,
            "per_head": {key: value.tolist() for key, value in per_head.items()}}


ONE_CHECKPOINT_NOTE = ("one checkpoint: tracking over training needs several (--keep-checkpoints keeps "
                       "checkpoints/step_XXXXXX.pt, --dynamics-every N logs these during training)")


def training_figure(log: list[dict], checkpoints: list[dict], title: str):
    """|J̃| and f_rot over training: the online log (lines, with markers while they are few) and checkpoint
    evaluations (dots); with one checkpoint and no online log it says what tracking needs."""
    plt = pyplot()
    fig, (ax_j, ax_f) = plt.subplots(1, 2, figsize=(12, 4))
    for ax, keys in ((ax_j, ("J_QK", "J_VO")), (ax_f, ("f_rot_QK", "f_rot_VO", "f_rot_QK_approx", "f_rot_VO_approx"))):
        for i, key in enumerate(keys):
            color = plt.cm.tab10(i)
            sector = LABELS[key].split(" of ", 1)[1]
            points = [(r["step"], r[key]) for r in log if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), lw=1.2, color=color, label=f"{sector}, logged in training",
                        marker="." if len(points) < MARKERS_BELOW else None)
            marks = [(c["step"], c["summary"][key]) for c in checkpoints if c["step"] is not None]
            if marks:
                ax.plot(*zip(*marks), "o", ms=5, color=color, label=f"{sector}, checkpoints")
        step_axis(ax, [r["step"] for r in log if r.get(keys[0]) is not None]
                  + [c["step"] for c in checkpoints if c["step"] is not None])
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_j.set_title("angular momentum |J̃| (mean over heads)")
    ax_f.set_title("rotational fraction (mean over heads)")
    online = any(r.get("J_QK") is not None for r in log)
    fig.suptitle(title + ("" if online or len(checkpoints) > 1 else f"\n{ONE_CHECKPOINT_NOTE}"), fontsize=10)
    fig.tight_layout()
    return fig


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(module="eval.dynamics", description=__doc__)
    add_target_args(parser)
    args = parser.parse_args(argv)
    run_dir, ckpt_path, whole_run = resolve_target(args.checkpoint)
    if export.is_exported(ckpt_path):
        raise SystemExit(f"error: --checkpoint {args.checkpoint} is an exported model, which keeps no optimizer "
                         "state: eval.dynamics needs a run directory or a checkpoint written by the trainer")
    out = output_dir(args, run_dir)
    paths = run_checkpoints(run_dir) if whole_run else [ckpt_path]
    results, drifts, previous = [], [], None
    for path in paths:
        ckpt = load_target_checkpoint(path)  # verified, mapped
        if previous is not None and previous["step"] == ckpt["step"]:
            continue  # latest.pt duplicating the last step_XXXXXX.pt
        try:
            result = checkpoint_dynamics(ckpt)
        except ValueError as exc:  # weights only, or an optimizer without a velocity: say which file
            raise SystemExit(f"error: {path}: {exc}") from None
        result["checkpoint"] = str(path)
        results.append(result)
        if previous is not None:  # the weight drift ratio since the previous checkpoint, mean over heads
            ratios = weight_drift_ratio(_params(previous), _params(ckpt), ckpt["config"]["model"]["n_head"])
            drifts.append({"from_step": previous["step"], "to_step": ckpt["step"],
                           **{key: float(value.mean()) for key, value in ratios.items()}})
        previous = ckpt
    log = read_log(run_dir)
    online = [{k: r[k] for k in ("step", *LABELS) if k in r} for r in log if "J_QK" in r]
    identity = checkpoint_identity(ckpt_path, results[-1]["step"])
    summary = {"checkpoint": identity, "step": identity["step"], "checkpoints": results, "weight_drift": drifts,
               "online": online}
    write_json(out / "dynamics.json", summary)
    heads = {key: LABELS[key] for key in ("J_QK", "J_VO", "f_rot_QK", "f_rot_VO")}
    title = f"{run_dir.name} — step {results[-1]['step']}"
    save_figure(head_maps_figure(results[-1], heads, title), out / "dynamics.png")
    save_figure(training_figure(log, results, run_dir.name), out / "dynamics_training.png")
    rows = [[r["step"], r["tokens"] if r["tokens"] is not None else "-"] +
            [f"{r['summary'][k]:.4g}" for k in ("J_QK", "J_VO", "J_QK_total", "J_VO_total")] +
            [f"{100 * r['summary'][k]:.2f}" for k in ("f_rot_QK", "f_rot_QK_approx", "f_rot_VO", "f_rot_VO_approx")]
            for r in results]
    text = [f"# Rotational dynamics — {run_dir.name}, step {identity['step']}", "",
            "Velocity u from the optimizer state at each checkpoint (unit global norm). |J̃| = ‖X − Xᵀ‖_F/√2 per head "
            "(mean over heads; total = √Σ over heads); f_rot in % (exact least-squares projection; ≈ eq. 24).", "",
            markdown_table(["step", "tokens", "|J̃_QK|", "|J̃_VO|", "|J̃_QK| total", "|J̃_VO| total", "f_rot QK %",
                            "≈ eq.24 QK %", "f_rot VO %", "≈ eq.24 VO %"], rows), ""]
    if drifts:
        text += ["## Weight drift ratio (‖ΔA‖ + ‖ΔB‖)/‖Δ(ABᵀ)‖, mean over heads", "",
                 markdown_table(["from step", "to step", "QK", "VO"],
                                [[d["from_step"], d["to_step"], f"{d['drift_QK']:.3g}", f"{d['drift_VO']:.3g}"]
                                 for d in drifts]), ""]
    text += ["![per-head dynamics](dynamics.png)", "", "![dynamics over training](dynamics_training.png)", ""]
    atomic_write(out / "dynamics.md", "\n".join(text).encode())
    record_outputs(out, "dynamics", identity, ["dynamics.json", "dynamics.png", "dynamics_training.png", "dynamics.md"])
    last = results[-1]["summary"]
    print(f"step {results[-1]['step']}: |J_QK| {last['J_QK']:.3g}  |J_VO| {last['J_VO']:.3g}  "
          f"f_rot QK {last['f_rot_QK']:.3g}  VO {last['f_rot_VO']:.3g}")
    return summary


if __name__ == "__main__":
    main()
