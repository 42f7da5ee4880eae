"""Runs as samples (docs/evaluation.md#comparing-runs): the data a run's losses depend on (runs on other data are
never averaged together), one value per seed (two runs of one seed are one sample, their mean), mean ± sample std
over the seeds, and the difference of two sets of runs with its standard error, paired by seed when both hold the
same seeds (the per-seed differences' spread) and unpaired otherwise."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


def data_identity(config: dict) -> dict[str, object]:
    """What a run's losses were measured on: {"data": the data fingerprint (the shards' contents, docs/data.md), or
    for a run that recorded none the training and validation globs it was given; "val-tokens": the validation
    budget}. Runs whose identities differ are not samples of one thing."""
    train, data = config.get("train", {}), config.get("data") or {}
    files = f"train {train.get('train_files') or '(default)'}, val {train.get('val_files') or '(default)'}"
    return {"data": data.get("fingerprint") or files, "val-tokens": train.get("val_tokens")}


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
