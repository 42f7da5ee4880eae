"""Symmetry and directionality of the query-key matrices (docs/structure.md#symmetry-and-directionality-scores).

    python -m eval.structure --run runs/NAME                 # every checkpoint of the run, tracked over steps
    python -m eval.structure --checkpoint FILE               # one checkpoint
    python -m eval.structure --run runs/NAME --convention paper

Per layer M = Σ_h A_Q^h A_K^hᵀ = W_Qᵀ W_K (C×C, rows: the query side's input, columns: the key side's; nn.Linear
stores W_Q as (out, in)) and per head M^h = A_Q^h A_K^hᵀ (learned bias rows left out). With M_s, M_n the symmetric
and skew parts, r_i, c_j the row and column norms, t_r, t_c their thresholds mean + γ·std, and
r̄ = Σ_{r_i > t_r} r_i, r_exc = Σ_{r_i > t_r} (r_i − t_r) (c̄, c_exc likewise), the conventions (docs/structure.md):
  figures (default): s = (‖M_s‖² − ‖M_n‖²)/‖M‖² ∈ [−1, 1], d = (r_exc − c_exc)/(r_exc + c_exc): what the paper's
             figures and tables show (its plotting code maps the published scores to 2s − 1 and −d); d > 0: rows
             dominate, d < 0: columns dominate.
  paper:     the same s, d = (r̄ − c̄)/(r̄ + c̄): Definition 3.2 as printed (whole norms), sign as figures.
  published: ‖M_s‖²/‖M‖² ∈ [0, 1] and (c_exc − r_exc)/(c_exc + r_exc): what the authors' score functions return
             (d > 0: columns dominate).
Medians across layers are what the paper reports. Writes structure_<convention>.json, .md and .png (medians vs
step, and the per-layer scores of the last checkpoint).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from cli import ArgumentParser
from run.checkpoint import run_checkpoints
from run.process import resolve_device
from eval.figures import pyplot, save_figure, step_axis
from eval.outputs import markdown_table, write_json
from eval.target import add_target_args, load_target_checkpoint, output_dir, resolve_target
from gauge.dynamics import head_factors, num_attention_layers, plain_name
from fileio import atomic_write, exits_on_filesystem_errors

CONVENTIONS = ("figures", "paper", "published")  # docs/structure.md#conventions; the first is the default
GAMMA = 2.0  # threshold = mean + GAMMA · std of the norms


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")


def symmetry_score(m: Tensor, convention: str = "figures") -> Tensor:
    """Symmetry score of square matrices m (..., n, n) (docs/structure.md#symmetry-and-directionality-scores).

    figures, paper: (‖M_s‖² − ‖M_n‖²)/‖M‖² with M_s = (M + Mᵀ)/2, M_n = (M − Mᵀ)/2: +1 symmetric, −1 skew, → 0
    random. published: ‖M_s‖²/‖M‖² = (s + 1)/2. A zero matrix scores 0 (figures, paper) or 1/2 (published).
    """
    _check_convention(convention)
    m = m.double()
    total = m.square().sum(dim=(-2, -1))
    sym = (0.5 * (m + m.mT)).square().sum(dim=(-2, -1))
    skew = (0.5 * (m - m.mT)).square().sum(dim=(-2, -1))
    score = torch.where(total > 0, (sym - skew) / total.clamp_min(1e-300), 0.0)
    return 0.5 * (score + 1.0) if convention == "published" else score


def _outliers(norms: Tensor, gamma: float, excess: bool) -> Tensor:
    """Σ over the norms above their threshold mean + γ·std (unbiased std, as torch.std) of the norm itself, or of
    its excess over the threshold, over the last dim."""
    threshold = norms.mean(-1, keepdim=True) + gamma * norms.std(-1, keepdim=True)
    above = norms > threshold
    values = norms - threshold if excess else norms
    return torch.where(above, values, 0.0).sum(-1)


def directionality_score(m: Tensor, convention: str = "figures", gamma: float = GAMMA) -> Tensor:
    """Directionality score of square matrices m (..., n, n) (docs/structure.md#symmetry-and-directionality-scores).

    Row norms r_i and column norms c_j, each set with the threshold mean + γ·std. figures: (r_exc − c_exc) /
    (r_exc + c_exc), summing each norm's excess over its threshold; paper: (r̄ − c̄)/(r̄ + c̄), summing the whole
    norms above the threshold; published: (c_exc − r_exc)/(c_exc + r_exc) = −figures. figures and paper: positive
    when high-norm rows dominate, negative when columns do. 0 when nothing is above either threshold.
    """
    _check_convention(convention)
    m = m.double()
    excess = convention != "paper"
    rows = _outliers(torch.linalg.vector_norm(m, dim=-1), gamma, excess)
    cols = _outliers(torch.linalg.vector_norm(m, dim=-2), gamma, excess)
    first, second = (cols, rows) if convention == "published" else (rows, cols)
    total = rows + cols
    return torch.where(total > 0, (first - second) / total.clamp_min(1e-300), 0.0)


def query_key_matrices(tensors: dict[str, Tensor], layer: int, n_head: int) -> tuple[Tensor, Tensor]:
    """(M of the layer (C, C), M^h per head (H, C, C)) in float64 from named parameters: M^h = A_Q^h A_K^hᵀ (without
    bias rows), M = Σ_h M^h = W_Qᵀ W_K."""
    factors = head_factors(tensors, layer, n_head)
    C = factors["O"].shape[-1]
    per_head = factors["Q"][:, :C] @ factors["K"][:, :C].mT
    return per_head.sum(0), per_head


def checkpoint_structure(ckpt: dict, convention: str, gamma: float, device: torch.device) -> dict:
    """A checkpoint's scores of every layer ("layers": {"symmetry", "directionality"}: lists of L) and head
    ("heads": L×H lists) and their medians across layers ("median")."""
    tensors = {plain_name(n): t.to(device) for n, t in ckpt["model"].items() if ".attn." in n}
    layers = {"symmetry": [], "directionality": []}
    heads = {"symmetry": [], "directionality": []}
    for layer in range(num_attention_layers(tensors)):
        m, per_head = query_key_matrices(tensors, layer, ckpt["config"]["model"]["n_head"])
        for out, matrices in ((layers, m), (heads, per_head)):
            out["symmetry"].append(symmetry_score(matrices, convention).tolist())
            out["directionality"].append(directionality_score(matrices, convention, gamma).tolist())
    median = {key: float(np.median(values)) for key, values in layers.items()}
    return {"step": ckpt["step"], "tokens": ckpt["metrics"]["tokens"], "layers": layers, "heads": heads,
            "median": median}


ONE_CHECKPOINT_NOTE = ("one checkpoint: tracking over training needs several (--keep-checkpoints keeps "
                       "checkpoints/step_XXXXXX.pt)")


def structure_figure(results: list[dict], title: str, convention: str):
    """Medians across layers (black) and each layer (thin, coloured by depth) vs step for the symmetry and the
    directionality score, and the last checkpoint's scores per layer."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in results]
    for ax, key in zip(axes[:2], ("symmetry", "directionality")):
        per_layer = np.array([r["layers"][key] for r in results])  # (checkpoints, L)
        for layer in range(per_layer.shape[1]):
            ax.plot(steps, per_layer[:, layer], "o-", lw=0.8, ms=3, alpha=0.6,
                    color=plt.cm.viridis(layer / max(per_layer.shape[1] - 1, 1)),
                    label="single layers (colour: depth)" if layer == 0 else None)
        ax.plot(steps, [r["median"][key] for r in results], "o-", color="k", label="median across layers")
        step_axis(ax, steps)
        ax.set_title(f"{key} score ({convention} convention)")
        ax.axhline(0.5 if key == "symmetry" and convention == "published" else 0.0, color="gray", lw=0.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    last = results[-1]
    layers = range(len(last["layers"]["symmetry"]))
    axes[2].plot(layers, last["layers"]["symmetry"], "o-", label="symmetry")
    axes[2].plot(layers, last["layers"]["directionality"], "s-", label="directionality")
    axes[2].set_xticks(list(layers))
    axes[2].set_xlabel("layer")
    axes[2].set_title(f"per layer at step {last['step']}")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    fig.suptitle(title + (f"\n{ONE_CHECKPOINT_NOTE}" if len(results) == 1 else ""), fontsize=10)
    fig.tight_layout()
    return fig


CONVENTION_NOTES = {
    "figures": "Symmetry in [−1, 1] (+1 symmetric, −1 skew); directionality (row − column excess over the thresholds) "
               "> 0: rows dominate, < 0: columns dominate. The sign and scale of the paper's figures and tables.",
    "paper": "Symmetry in [−1, 1] (+1 symmetric, −1 skew); directionality (row − column sums of the whole norms above "
             "the thresholds) > 0: rows dominate, < 0: columns dominate. Definition 3.2 as printed.",
    "published": "Symmetry ‖M_s‖²/‖M‖² in [0, 1]; directionality (column − row excess) > 0: columns dominate. What "
                 "the authors' score functions return, before their figures flip and rescale them.",
}


def markdown_summary(results: list[dict], run_name: str, convention: str, gamma: float, stem: str) -> str:
    last = results[-1]
    lines = [f"# W_QK structure ({convention} convention) — {run_name}", "",
             "Per layer M = W_Qᵀ W_K (C×C); per head M^h = A_Q^h A_K^hᵀ. Threshold of the directionality score: "
             f"mean + {gamma:g}·std of the norms. "
             + CONVENTION_NOTES[convention], "",
             "## Medians across layers", "",
             markdown_table(["step", "tokens", "symmetry", "directionality"],
                            [[r["step"], r["tokens"] if r["tokens"] is not None else "-", r["median"]["symmetry"],
                              r["median"]["directionality"]] for r in results]), "",
             f"## Per layer and head at step {last['step']}", ""]
    n_head = len(last["heads"]["symmetry"][0])
    for key in ("symmetry", "directionality"):
        rows = [[layer, last["layers"][key][layer], *last["heads"][key][layer]]
                for layer in range(len(last["layers"][key]))]
        lines += [f"{key}:", "", markdown_table(["layer", "layer M", *(f"head {h}" for h in range(n_head))], rows), ""]
    lines += [f"![structure]({stem}.png)", ""]
    return "\n".join(lines)


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(module="eval.structure", description=__doc__)
    add_target_args(parser)
    parser.add_argument("--convention", choices=CONVENTIONS, default=CONVENTIONS[0],
                        help="figures: the sign and scale of the paper's figures and tables; paper: Definition 3.2 "
                             "as printed (whole norms); published: the raw return values of the authors' score "
                             "functions (docs/structure.md#conventions)")
    parser.add_argument("--gamma", type=float, default=GAMMA, help="directionality threshold: mean + gamma * std")
    args = parser.parse_args(argv)
    run_dir, ckpt_path, whole_run = resolve_target(args.checkpoint)
    out, device = output_dir(args, run_dir), resolve_device(args.device)
    paths = run_checkpoints(run_dir) if whole_run else [ckpt_path]
    results = []
    for i, path in enumerate(paths):
        ckpt = load_target_checkpoint(path)
        if results and results[-1]["step"] == ckpt["step"]:
            continue  # latest.pt duplicating the last step_XXXXXX.pt
        result = checkpoint_structure(ckpt, args.convention, args.gamma, device)
        result["checkpoint"] = str(path)
        results.append(result)
        print(f"[{i + 1}/{len(paths)}] step {result['step']}: median symmetry {result['median']['symmetry']:.4f}  "
              f"directionality {result['median']['directionality']:.4f}")
    stem = f"structure_{args.convention}"
    summary = {"convention": args.convention, "gamma": args.gamma, "checkpoints": results}
    write_json(out / f"{stem}.json", summary)
    save_figure(structure_figure(results, run_dir.name, args.convention), out / f"{stem}.png")
    page = markdown_summary(results, run_dir.name, args.convention, args.gamma, stem)
    atomic_write(out / f"{stem}.md", page.encode())
    print(f"wrote {out / stem}.json, .md, .png")
    return summary


if __name__ == "__main__":
    main()
