"""Gauge-sensitivity diagnostic: does one optimizer step depend on which representative of the weights it starts
from? (docs/structure.md#gauge-sensitivity-diagnostic, docs/gauge.md#quotient-aware-updates)
The computation lives in gauge/sensitivity.py (shared with the trainer's --gauge-diagnostic-every); this module is
its command line and report.

    python -m eval.gauge --run runs/NAME                      # the run's optimizer and hyperparameters
    python -m eval.gauge --checkpoint FILE --optimizer sgdm --gauge orthogonal --samples 8

Per attention head the products M_QK = Â_Q Â_Kᵀ and M_VO = Â_V B_O are unchanged by the gauge (Â_Q, Â_K) →
(Â_Q S, Â_K S⁻ᵀ), (Â_V, B_O) → (Â_V T, T⁻¹ B_O) (docs/model.md#conventions). The diagnostic draws S, T per head
(GL(d) with condition number --condition, or orthogonal), checks that the model's logits on a validation batch (mean
biases) are unchanged, takes one step of a fresh optimizer (the run's, with its peak learning rate; no optimizer
state is carried over) from both representatives on that batch, maps the gauged step's factors back through the
inverse gauge, and compares the represented motion ΔM = M_after − M_before per head and sector:
    relative difference  ‖ΔM(θ') − ΔM(θ)‖ / ‖ΔM(θ)‖           (0: the step does not see the gauge)
    random-gauge variance  E_S ‖ΔM(θ'_S) − E_S ΔM(θ'_S)‖² / ‖ΔM(θ)‖²  over the sampled gauges
    smoothed difference  ‖E_S ΔM(θ'_S) − ΔM(θ)‖ / ‖ΔM(θ)‖  (how far random-gauge smoothing moves the step)
    Gram imbalance  ‖H_A − H_B‖_F / ‖H_A‖_F (H_A = AᵀA, H_B = BᵀB) and the largest column-RMS ratio of A to B (or
    B to A), of θ and (mean over samples) of the gauged θ'.
With sampled biases of nonzero mean (b_Q in modes bq/bqbv; b_V with --mean-v ≠ 0) the gauge is not an exact symmetry
(q + μ_Q changes): the logit change is then reported, not asserted. Runs in float64 by default so that the
differences are not rounding. Writes gauge.json, gauge.md and gauge.png (per-head maps of the relative difference).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from cli import ArgumentParser
import train_gpt
from config import config_from_dict
from data.loader import validation_batches
from fileio import atomic_write, exits_on_filesystem_errors
from eval.configuration import run_hyperparameters, validation_files
from eval.figures import head_maps_figure, save_figure
from eval.outputs import markdown_table, write_json
from eval.target import add_target_args, open_target
from optim import OPTIMIZERS
from gauge.sensitivity import GAUGE_KINDS, SECTORS, gauge_diagnostic

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def optimizer_config(checkpoint_config: dict, optimizer: str | None, lr: float | None):
    """(name, config) of the step's optimizer: the run's with its saved hyperparameters, or `optimizer` with its
    defaults; `lr` overrides the learning rate."""
    run_optimizer = checkpoint_config.get("train", {}).get("optimizer", "adamw")
    name = optimizer or run_optimizer
    if name not in OPTIMIZERS:
        raise SystemExit(f"error: --optimizer {name!r} is not one of {sorted(OPTIMIZERS)}")
    saved = checkpoint_config.get("optim", {}) if name == run_optimizer else {}
    cfg = config_from_dict(saved, OPTIMIZERS[name].config)
    if lr is not None:
        cfg.lr = lr
    return name, cfg


def plot(result: dict, path: Path, title: str) -> None:
    labels = {**{f"relative_difference_{s}": f"relative change of one step's ΔM_{s}" for s in SECTORS},
              **{f"gram_imbalance_gauged_{s}": f"Gram imbalance of the gauged {s} factors" for s in SECTORS}}
    condition = f", condition {result['condition']:g}" if result["gauge"] == "gl" else ""
    suptitle = f"{title}: {result['optimizer']} step, {result['samples']} {result['gauge']} gauges{condition}"
    save_figure(head_maps_figure(result, labels, suptitle), path)


def markdown_summary(result: dict, run_name: str) -> str:
    s = result["summary"]
    labels = {"relative_difference": "relative ΔM difference (mean over gauges)",
              "relative_difference_var": "its variance over gauges",
              "random_gauge_variance": "random-gauge variance of ΔM (relative)",
              "smoothed_difference": "smoothed difference (gauge-averaged ΔM vs ΔM(θ))",
              "gram_imbalance": "Gram imbalance of θ", "gram_imbalance_gauged": "Gram imbalance of θ'",
              "column_rms_ratio": "max column-RMS ratio of θ", "column_rms_ratio_gauged": "max column-RMS ratio of θ'"}
    exact = [k for k, v in result["exact"].items() if v]
    lines = [f"# Gauge sensitivity — {run_name}, step {result.get('step')}", "",
             f"One fresh {result['optimizer']} step (lr {result['lr']:g}, no optimizer state) from θ and from "
             f"{result['samples']} gauged copies θ' ({result['gauge']} gauges"
             + (f", condition number {result['condition']:g}" if result["gauge"] == "gl" else "")
             + f") on one batch of {result['batch']} sequences, in {result['dtype']}. Means over heads.", "",
             markdown_table(["metric", "QK", "VO"], [[label, s[f"{k}_QK"], s[f"{k}_VO"]] for k, label in
                                                     labels.items()]), "",
             f"Exact sectors with the mean biases: {', '.join(exact) or 'none'}. Relative logit change under the "
             f"gauges: max {max(result['logit_change']):.3g}"
             + ("" if len(exact) == len(SECTORS) else " (reported, not asserted: the gauge is not a symmetry here)"),
             "", "![gauge sensitivity](gauge.png)", ""]
    return "\n".join(lines)


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(module="eval.gauge", description=__doc__)
    add_target_args(parser)
    parser.add_argument("--optimizer", default=None, choices=sorted(OPTIMIZERS),
                        help="optimizer of the step (default: the run's, with its hyperparameters; another one "
                             "takes its defaults)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate of the step (default: the config's)")
    parser.add_argument("--gauge", choices=GAUGE_KINDS, default="gl", help="GL(d) or orthogonal gauges")
    parser.add_argument("--condition", type=float, default=10.0, help="condition number of the GL(d) gauges")
    parser.add_argument("--samples", type=int, default=4, help="sampled gauges")
    parser.add_argument("--seed", type=int, default=0, help="seed of the gauges")
    parser.add_argument("--batch-size", type=int, default=4, help="validation sequences in the batch")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the run's seq_len")
    parser.add_argument("--val-files", default=None, help="validation shard glob (default: the run's config)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float64", help="dtype of the model copies")
    parser.add_argument("--tolerance", type=float, default=1e-6,
                        help="largest relative logit change accepted under an exact gauge")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.batch_size < 1:
        raise SystemExit("error: --samples and --batch-size must be >= 1")
    target = open_target(args)
    ckpt, device = target.checkpoint, target.device
    hp = run_hyperparameters(ckpt["config"])
    seq_len = args.seq_len or hp.seq_len
    files = args.val_files or validation_files(ckpt["config"])
    x, y, _ = next(validation_batches(files, args.batch_size, seq_len, args.batch_size * seq_len,
                                      vocab_size=ckpt["config"]["model"]["vocab_size"], device=device))
    name, optim_cfg = optimizer_config(ckpt["config"], args.optimizer, args.lr)
    model = train_gpt.model_from_checkpoint(ckpt).to(device)
    result = gauge_diagnostic(model, name, optim_cfg, x, y, args.gauge, args.condition, args.samples, args.seed,
                              DTYPES[args.dtype], args.tolerance, progress=True)
    result.update(step=ckpt["step"], checkpoint=str(target.checkpoint_path), lr=optim_cfg.lr,
                  batch=args.batch_size, seq_len=seq_len, val_files=files)
    write_json(target.out / "gauge.json", result)
    plot(result, target.out / "gauge.png", target.run_dir.name)
    atomic_write(target.out / "gauge.md", markdown_summary(result, target.run_dir.name).encode())
    s = result["summary"]
    if all(math.isnan(s[f"relative_difference_{sector}"]) for sector in SECTORS):
        print(f"note: one fresh {name} step does not move the attention weights (ΔM = 0), so the relative metrics "
              "are undefined (NaN; null in gauge.json)")
    print(f"relative ΔM difference QK {s['relative_difference_QK']:.3g}  VO {s['relative_difference_VO']:.3g}  "
          f"(max logit change {max(result['logit_change']):.3g}); wrote {target.out / 'gauge.json'}")
    return result


if __name__ == "__main__":
    main()
