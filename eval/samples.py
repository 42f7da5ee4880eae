"""Runs as samples (docs/evaluation.md#comparing-runs), one definition for eval.compare, the scorecard and the grid's
report: which runs count (finished ones: not interrupted, still training or diverged), which runs are seeds of one
cell (every setting that changes results the same, the data a run's losses depend on included, except the seed and
what the run's bias mode does not use), the validation statistics a log gives (one name each), one value per seed
(two runs of one seed are one sample, their mean), mean ± sample std over the seeds, and the difference of two sets
of runs with its standard error, paired by seed when both hold the same seeds (the per-seed differences' spread) and
unpaired otherwise; and the intervals the evaluations give their own samples (a proportion's Wilson interval, a
mean's normal interval)."""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

import config as run_config
import train_gpt
from eval.curves import current_records, validation_losses
from optim import OPTIMIZERS
from run.log import finished

LOSSES = ("train_loss", "val_loss", "val_loss_batch", "best_val_loss_batch")  # a non-finite one: the run diverged
BIAS_FIELDS = {"none": {"mean_q", "std_q_min", "std_q_max", "mean_v", "std_v_min", "std_v_max", "bias_per_head"},
               "bq": {"mean_v", "std_v_min", "std_v_max"}, "bv": {"mean_q", "std_q_min", "std_q_max"}}
BIAS_SETTINGS = set().union(*BIAS_FIELDS.values()) | {"bias_mode", "key_bias"}  # what a pivot's columns vary


def data_identity(config: dict) -> dict[str, object]:
    """What a run's losses were measured on: {"data": the data fingerprint (the shards' contents, docs/data.md), or
    for a run that recorded none the training and validation globs it was given; "val-tokens": the validation
    budget; "val-biases": the biases of its single-batch estimates}. Runs whose identities differ are not samples of
    one thing."""
    train, data = config.get("train", {}), config.get("data") or {}
    files = f"train {train.get('train_files') or '(default)'}, val {train.get('val_files') or '(default)'}"
    return {"data": data.get("fingerprint") or files, "val-tokens": train.get("val_tokens"),
            "val-biases": train.get("val_biases", "mean")}


def unused_by_bias_mode(model: dict) -> set[str]:
    """The model fields a run's bias mode does not use (a symmetric run's b_V settings change nothing it
    computes)."""
    mode = model.get("bias_mode")
    return BIAS_FIELDS.get(mode, set()) | ({"key_bias"} if mode == "none" else set())


def cell_settings(config: dict) -> dict[str, object]:
    """The one notion of a cell: every setting of a run that affects results (cli.flag's affects_results; the
    optimizer's own included), except the seeds and what its bias mode does not use, plus the data it was trained
    and validated on (data_identity). Runs with equal settings are seeds of one cell; runs of one cell whose settings
    differ are never averaged."""
    model = config.get("model", {})
    unused = unused_by_bias_mode(model)
    optimizer = config.get("train", {}).get("optimizer")
    classes = run_config.section_classes(train_gpt.GPTConfig, train_gpt.TrainConfig, optimizer) \
        if optimizer in OPTIMIZERS else {}
    settings = {f.name: config.get(section, {}).get(f.name) for section, cls in classes.items()
                for f in dataclasses.fields(cls) if f.metadata.get("affects_results", True) and f.name not in unused}
    return {**settings, **data_identity(config)}


def run_outcome(config: dict, log: list[dict]) -> tuple[str, str]:
    """("finished", ""), or ("diverged" | "unfinished", why in words): a run counts as a sample only when its log
    ends with the summary at --steps (run.log.finished); one whose log holds a non-finite loss or the trainer's
    `diverged` record diverged; any other stopped at a step (interrupted, failed or still training)."""
    records = current_records(log)
    for record in records:
        bad = [key for key in LOSSES if isinstance(record.get(key), float) and not math.isfinite(record[key])]
        if "diverged" in record or bad:
            return "diverged", f"diverged at step {record.get('step')} ({record.get('diverged') or bad[0]})"
    train = config.get("train", {})
    last = records[-1] if records else {}
    if finished(last, train.get("steps"), train.get("stop_at_target", False)):
        return "finished", ""
    step = next((r["step"] for r in reversed(records) if r.get("step") is not None), 0)
    return "unfinished", f"did not finish (step {step} of {train.get('steps')}: interrupted, failed or still training)"


def best_val_loss(log: list[dict]) -> float | None:
    """The best validation loss: the least single-batch validation estimate the trainer logged."""
    values = [r["best_val_loss_batch"] for r in current_records(log) if r.get("best_val_loss_batch") is not None]
    return values[-1] if values else None


def least_val_loss(log: list[dict]) -> float | None:
    """The least validation loss: the least fixed-budget validation loss the trainer measured."""
    values = [loss for _, loss in validation_losses(log)]
    return min(values) if values else None


@dataclass(frozen=True)
class Statistic:
    """A number read from a run's log, with the one name every page gives it and what it is."""

    key: str
    label: str
    meaning: str
    read: Callable[[list[dict]], float | None]


STATISTICS = {s.key: s for s in (
    Statistic("best_val_loss", "best validation loss", "the least single-batch validation estimate (the loss on "
              "one batch of --batch-tokens validation tokens every --val-every steps, at the biases --val-biases "
              "names; the paper's statistic)", best_val_loss),
    Statistic("least_val_loss", "least validation loss", "the least fixed-budget validation loss (the same "
              "--val-tokens every --val-every steps, at the mean biases)", least_val_loss),
)}


def data_description(config: dict) -> str:
    """One line naming a run's data: its fingerprint with the training and validation shards and their tokens."""
    data = config.get("data") or {}
    if not data.get("fingerprint"):
        return f"{data_identity(config)['data']} (no data record)"
    splits = [f"{split} {data[split].get('pattern')} ({data[split].get('tokens', 0):,} tokens)"
              for split in ("train", "val") if isinstance(data.get(split), dict)]
    return f"{data['fingerprint']}: " + ", ".join(splits)


def per_seed(pairs: list[tuple[object, float]]) -> dict[object, float]:
    """{seed: value} from (seed, value) pairs of runs: the runs of one seed are one sample, their mean."""
    grouped: dict[object, list[float]] = {}
    for seed, value in pairs:
        grouped.setdefault(seed, []).append(value)
    return {seed: statistics.fmean(values) for seed, values in grouped.items()}


def repeated_seeds(pairs: list[tuple[object, float]]) -> list[object]:
    """The seeds that more than one of the runs has (each counted once by per_seed)."""
    seeds = [seed for seed, _ in pairs]
    return sorted({s for s in seeds if seeds.count(s) > 1}, key=str)


def disagreeing_seeds(runs: list[tuple[object, float, str]], fmt: str) -> list[str]:
    """For each seed whose runs ((seed, value, run name) triples) give different values: the words naming them,
    each value with its run, and that their mean is the seed's value."""
    grouped: dict[object, list[tuple[float, str]]] = {}
    for seed, value, name in runs:
        grouped.setdefault(seed, []).append((value, name))
    return [f"seed {seed}: {len(found)} runs disagree ({', '.join(f'{v:{fmt}} in {name}' for v, name in found)}); "
            "their mean is the seed's value" for seed, found in grouped.items() if len({v for v, _ in found}) > 1]


@dataclass
class Summary:
    """Mean and sample std (None below two seeds) over the seeds of `values` ({seed: value})."""

    values: dict[object, float]
    mean: float | None = field(init=False)
    std: float | None = field(init=False)

    def __post_init__(self) -> None:
        samples = list(self.values.values())
        self.mean = statistics.fmean(samples) if samples else None
        self.std = statistics.stdev(samples) if len(samples) > 1 else None

    @property
    def n(self) -> int:
        return len(self.values)


@dataclass
class Difference:
    """treatment − baseline over seeds: `delta` the difference of the means (the mean per-seed difference when
    paired), `se` its standard error (None where a side has fewer than two seeds), `counts` the seeds of each side,
    and when paired `sd` the per-seed differences' sample std and `per_seed` those differences."""

    delta: float | None
    se: float | None
    paired: bool
    counts: tuple[int, int]
    sd: float | None = None
    per_seed: dict[object, float] = field(default_factory=dict)

    def text(self, fmt: str) -> str:
        """`+0.1234 ± 0.0100 (paired, n = 4)`, `+0.1234 (unpaired, n = 3 and 1)`, or `-` without a difference."""
        if self.delta is None:
            return "-"
        spread = f" ± {self.se:{fmt}}" if self.se is not None else ""
        n = f"paired, n = {self.counts[0]}" if self.paired else f"unpaired, n = {self.counts[0]} and {self.counts[1]}"
        return f"{self.delta:+{fmt}}{spread} ({n})"


def difference(treatment: dict[object, float], baseline: dict[object, float]) -> Difference:
    """treatment − baseline ({seed: value} each): paired by seed when both hold the same seeds (se = sd of the
    per-seed differences / √n), else unpaired (se = √(s_t²/n_t + s_b²/n_b))."""
    if not treatment or not baseline:
        return Difference(None, None, False, (len(treatment), len(baseline)))
    if set(treatment) == set(baseline):
        diffs = {seed: treatment[seed] - baseline[seed] for seed in treatment}
        spread = Summary(diffs)
        se = spread.std / math.sqrt(spread.n) if spread.std is not None else None
        return Difference(spread.mean, se, True, (spread.n, spread.n), spread.std, diffs)
    t, b = Summary(treatment), Summary(baseline)
    se = math.sqrt(t.std ** 2 / t.n + b.std ** 2 / b.n) if t.std is not None and b.std is not None else None
    return Difference(t.mean - b.mean, se, False, (t.n, b.n))


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sensible at 0% and 100%, unlike the normal one).

    (2k + z² ∓ z·√(z² + 4k(n−k)/n)) / (2(n + z²)) for k successes in n trials. The bounds are exact at the
    edges (0 at k = 0, 1 at k = n) and always bracket k/n (rounding could otherwise put the lower bound a hair
    above 0 at k = 0); (nan, nan) for n = 0.
    """
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = 2 * successes + z * z
    spread = z * math.sqrt(z * z + 4 * successes * (n - successes) / n)
    denominator = 2 * (n + z * z)
    low = 0.0 if successes == 0 else min((centre - spread) / denominator, p)
    high = 1.0 if successes == n else max((centre + spread) / denominator, p)
    return (low, high)


def mean_interval(values: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """(mean, low, high) with a normal 95% interval of the mean."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan"), float("nan")
    sem = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean, mean - z * sem, mean + z * sem
