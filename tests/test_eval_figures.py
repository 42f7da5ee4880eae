"""What the evaluation figures draw (docs/evaluation.md#loss-curves): validation only where it was measured, one x
axis (tokens) across a resume, a visible marker for one logged point, every layer in the alignment legend, integer
layer ticks and drawn per-layer lines in the structure plot, a note on single-checkpoint tracking, titles in words."""
from __future__ import annotations

import re

from eval import alignment, curves, dynamics, structure
from eval.figures import head_maps_figure, pyplot

JSON_KEY = re.compile(r"\b[a-z]+_[A-Za-z_]+\b")  # J_QK, f_rot_QK, relative_difference_QK ...


def old_log() -> list[dict]:
    """A log as the trainer wrote it before: training records repeat the last validation loss (with its step), the
    resume record has no tokens, and the attempt cut off after its checkpoint at step 20 logged steps 30 and 40."""
    log = [{"step": 0, "tokens": 0, "val_loss": 10.8, "val_step": 0, "val_loss_batch": None}]
    log += [{"step": s, "tokens": 100 * s, "train_loss": 10 - s / 10, "val_loss": 10.8, "val_step": 0}
            for s in (10, 20, 30, 40)]
    log += [{"resumed_from": "runs/x/checkpoints/latest.pt", "step": 20, "changed": {}}]
    log += [{"step": s, "tokens": 100 * s, "train_loss": 9 - s / 100, "val_loss": 10.8, "val_step": 0}
            for s in (30, 40, 50)]
    log += [{"step": 50, "tokens": 5000, "val_loss": 7.5, "val_step": 50, "val_loss_batch": None},
            {"summary": True, "step": 50, "tokens": 5000, "val_loss": 7.5, "val_step": 50}]
    return log


def test_validation_is_drawn_where_measured_and_a_resume_keeps_tokens_and_replaces_the_cut_off_steps():
    series = curves.loss_series(old_log())
    assert series.x == "tokens"  # the resume record carries no tokens: the axis stays in tokens
    assert series.validation == [(0, 10.8), (5000, 7.5)]  # not a flat line of repeats at every training record
    assert series.train == [(1000, 9.0), (2000, 8.0), (3000, 8.7), (4000, 8.6), (5000, 8.5)]
    assert curves.validation_losses(old_log()) == [(0, 10.8), (50, 7.5)]
    new = [r for r in old_log() if "train_loss" in r]  # the newer format: no val_loss in training records
    for record in new:
        del record["val_loss"], record["val_step"]
    assert curves.loss_series(new).validation == []
    without_tokens = [{**r, "tokens": None} if r.get("step") == 40 else r for r in old_log()]
    assert curves.loss_series(without_tokens).x == "step"
    assert curves.common_axis([old_log(), without_tokens]) == "step"  # one unit across the runs of a comparison


def test_one_logged_point_is_drawn_with_a_marker():
    fig = curves.loss_figure([{"step": 1, "tokens": 64, "train_loss": 10.0}])
    line = fig.axes[0].lines[0]
    assert list(line.get_xdata()) == [64] and line.get_marker() not in (None, "", "None")
    pyplot().close(fig)
    fig = curves.runs_loss_figure([("a", [{"step": 1, "tokens": 64, "train_loss": 10.0}]), ("b", old_log())])
    ax = fig.axes[0]
    assert ax.get_xlabel() == "tokens" and ax.lines[0].get_marker() not in (None, "", "None")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
    pyplot().close(fig)


def alignment_result(layers: int, heads: int) -> dict:
    per_layer = [{c: 0.1 * layer for c in alignment.CATEGORIES} for layer in range(layers)]
    return {"mode": "raw", "null_threshold": 0.5, "top_alignment": [[0.3] * heads for _ in range(layers)],
            "enrichment": {"pooled": {c: 0.2 for c in alignment.CATEGORIES}, "per_layer": per_layer}}


def test_the_alignment_legend_lists_every_layer():
    fig = alignment.alignment_figure(alignment_result(4, 2), "run")
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert legend == ["pooled over layers", "layer 0", "layer 1", "layer 2", "layer 3"]
    assert "raw token embeddings" in fig._suptitle.get_text()
    pyplot().close(fig)


def structure_result(step: int, layers: int = 3) -> dict:
    return {"step": step, "tokens": None, "median": {"symmetry": 0.1, "directionality": 0.0},
            "layers": {"symmetry": [0.1 * i for i in range(layers)], "directionality": [0.0] * layers}}


def test_the_structure_plot_draws_each_layer_with_integer_ticks_and_says_when_it_cannot_track():
    fig = structure.structure_figure([structure_result(5)], "run", "figures")
    per_step, per_layer = fig.axes[0], fig.axes[2]
    assert list(per_layer.get_xticks()) == [0, 1, 2]
    layer_lines = [line for line in per_step.lines if line.get_color() != "k" and list(line.get_xdata()) == [5]]
    assert len(layer_lines) == 3 and all(line.get_marker() not in (None, "", "None") for line in layer_lines)
    assert "single layers (colour: depth)" in [t.get_text() for t in per_step.get_legend().get_texts()]
    assert "tracking over training needs several" in fig._suptitle.get_text()
    assert all(float(t).is_integer() for t in per_step.get_xticks())
    pyplot().close(fig)
    fig = structure.structure_figure([structure_result(5), structure_result(10)], "run", "figures")
    assert "tracking" not in fig._suptitle.get_text()
    pyplot().close(fig)


def dynamics_checkpoint(step: int) -> dict:
    keys = ("J_QK", "J_VO", "f_rot_QK", "f_rot_VO", "f_rot_QK_approx", "f_rot_VO_approx")
    return {"step": step, "summary": {k: 0.1 for k in keys}, "per_head": {k: [[0.1, 0.2]] for k in keys}}


def test_dynamics_figures_speak_words_and_say_when_one_checkpoint_cannot_track():
    fig = dynamics.training_figure([], [dynamics_checkpoint(3)], "run")
    assert "tracking over training needs several" in fig._suptitle.get_text()
    labels = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
    assert "QK, checkpoints" in labels and not any(JSON_KEY.search(label) for label in labels)
    pyplot().close(fig)
    online = [{"step": 1, **dynamics_checkpoint(1)["summary"]}]
    fig = dynamics.training_figure(online, [dynamics_checkpoint(3)], "run")
    assert "tracking" not in fig._suptitle.get_text()
    assert all(line.get_marker() not in (None, "", "None") for line in fig.axes[0].lines)
    pyplot().close(fig)
    fig = head_maps_figure(dynamics_checkpoint(3), {k: dynamics.LABELS[k] for k in ("J_QK", "f_rot_VO")}, "run")
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles[0].startswith("angular momentum |J̃| of QK") and not any(JSON_KEY.search(t) for t in titles)
    pyplot().close(fig)
