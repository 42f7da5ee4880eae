"""Loss curves from log.jsonl, as measured: training loss at every logged step, validation loss only at the steps
where it was computed, one x axis (tokens) across a resume (docs/evaluation.md#loss-curves).

Older logs repeat the last validation loss in every training record, and their `resumed_from` record carries no
token count; neither may turn into a point or change the axis. Records a resumed run wrote again (the steps after
its checkpoint) replace the interrupted attempt's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from eval.figures import pyplot

# A series with fewer points than this is drawn with markers, so that one logged point is visible.
MARKERS_BELOW = 50


def current_records(log: list[dict]) -> list[dict]:
    """The log's records with those a resume superseded left out: a `resumed_from` record at step s drops every
    earlier record past step s (logged by the attempt that was cut off after its last checkpoint)."""
    kept: list[dict] = []
    for record in log:
        if "resumed_from" in record and record.get("step") is not None:
            kept = [r for r in kept if r.get("step") is None or r["step"] <= record["step"]]
        kept.append(record)
    return kept


def measured_validation(record: dict) -> bool:
    """Whether a log record holds a validation loss computed at its own step: a validation record, not a training
    record repeating the last one (older logs) nor the final summary (which repeats the last validation)."""
    if record.get("val_loss") is None or record.get("summary"):
        return False
    return "train_loss" not in record or record.get("val_step", record.get("step")) == record.get("step")


def validation_losses(log: list[dict]) -> list[tuple[int, float]]:
    """(step, validation loss) where the trainer measured it, in step order, one per step."""
    return loss_series(log, "step").validation


@dataclass
class LossSeries:
    """A run's curves on one axis: `x` is "tokens" when every loss record carries its token count, else "step"."""

    x: str
    train: list[tuple[float, float]] = field(default_factory=list)
    validation: list[tuple[float, float]] = field(default_factory=list)


def loss_series(log: list[dict], x: str | None = None) -> LossSeries:
    """Training and measured validation losses of a log against `x` ("tokens" or "step"; default: tokens when
    every training and validation record has them)."""
    records = current_records(log)
    points = [r for r in records if r.get("train_loss") is not None or measured_validation(r)]
    if x is None:
        x = "tokens" if all(r.get("tokens") is not None for r in points) else "step"
    train = [(r[x], r["train_loss"]) for r in points if r.get("train_loss") is not None]
    validation = sorted({r[x]: r["val_loss"] for r in points if measured_validation(r)}.items())
    return LossSeries(x, train, validation)


def common_axis(logs: list[list[dict]]) -> str:
    """The x axis several runs can share: tokens if every run's loss records carry them, else steps."""
    return "tokens" if all(loss_series(log).x == "tokens" for log in logs) else "step"


def _draw(ax, series: LossSeries, color, label: str, train_label: str | None, val_label: str) -> None:
    """One run's curves; without `train_label` the training line is labelled only when there is no validation."""
    if series.train:
        ax.plot(*zip(*series.train), lw=1, alpha=0.6, color=color,
                label=train_label or (None if series.validation else label),
                marker="." if len(series.train) < MARKERS_BELOW else None)
    if series.validation:
        ax.plot(*zip(*series.validation), "o-", ms=4, color=color, label=val_label)
    if not series.train and not series.validation:
        ax.plot([], [], color=color, label=f"{label} (no losses logged)")


def loss_figure(log: list[dict], marker: tuple[float, float] | None = None, title: str = ""):
    """One run's training and validation loss; `marker` = (x, loss) of a fixed-budget evaluation, in the unit of
    the axis (tokens, or steps when the log lacks them)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series = loss_series(log)
    _draw(ax, series, "tab:blue", title, "training", "validation (trainer)")
    if marker is not None:
        ax.plot([marker[0]], [marker[1]], "r*", ms=12, label=f"fixed-budget evaluation {marker[1]:.4f}")
    ax.set_xlabel(series.x)
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def runs_loss_figure(named_logs: list[tuple[str, list[dict]]], title: str = "loss curves"):
    """Several runs on one axis (common_axis): thin lines training, dots validation."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = common_axis([log for _, log in named_logs])
    for i, (name, log) in enumerate(named_logs):
        _draw(ax, loss_series(log, x), plt.cm.tab10(i % 10), name, None, name)
    ax.set_xlabel(x)
    ax.set_ylabel("loss (thin: training, dots: validation)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
