"""The scorecard's verdict rule, once (docs/reproduce.md#what-reproduced-means): 95% intervals from Student's t,
Welch's degrees of freedom for a difference of two estimates, the least of k seeds as an order statistic, the rule
that turns an estimate into reproduced, inconclusive or differs, and the seeds that would decide a claim (the power
of a grid). Pure arithmetic: no run, no file."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from statistics import NormalDist

CONFIDENCE = 0.95  # every interval the scorecard states is a two-sided 95% one
POWER = 0.8  # "seeds that would decide it": a true effect of the published size reproduced 4 times in 5
MAX_SEEDS = 100_000  # beyond this a claim counts as undecidable


@functools.cache
def quantile(df: float) -> float:
    """The two-sided CONFIDENCE quantile of Student's t with `df` degrees of freedom (the normal's when infinite)."""
    if math.isinf(df):
        return NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)
    from scipy.stats import t

    return float(t.ppf(0.5 + CONFIDENCE / 2, df))


@functools.cache
def least_of(k: int) -> tuple[float, float]:
    """Mean and variance of the least of k independent standard normal draws (k = 1: 0 and 1; k = 2: −1/√π and
    1 − 1/π): the paper's "best of its seeds" statistic in units of the per-seed spread."""
    if k == 1:
        return 0.0, 1.0
    from scipy import integrate, stats

    def density(x: float) -> float:
        return k * stats.norm.pdf(x) * stats.norm.sf(x) ** (k - 1)

    mean = integrate.quad(lambda x: x * density(x), -math.inf, math.inf)[0]
    second = integrate.quad(lambda x: x * x * density(x), -math.inf, math.inf)[0]
    return mean, second - mean * mean


def welch_df(terms: list[tuple[float, float]]) -> float:
    """Welch–Satterthwaite degrees of freedom of a sum of independent variance terms [(variance, df), ...]: the df
    of the difference of two estimates with their own spreads; infinite when every term is known exactly."""
    total = sum(v for v, _ in terms)
    spread = sum(v * v / df for v, df in terms if not math.isinf(df) and v > 0)
    return math.inf if spread == 0 else total * total / spread


@dataclass(frozen=True)
class Spread:
    """A per-seed standard deviation, its degrees of freedom and its source in words (for the page)."""

    sd: float
    df: float
    source: str


@dataclass(frozen=True)
class Estimate:
    """A number with its standard error and the degrees of freedom of that error."""

    value: float
    se: float
    df: float

    @property
    def half_width(self) -> float:
        """Half the width of its 95% interval."""
        return quantile(self.df) * self.se


@dataclass
class Judgement:
    """A verdict (reproduced, inconclusive, differs), whether a claim's Δ is significant in the other direction
    (reversed), and the words that explain it."""

    verdict: str
    reversed: bool = False
    words: list[str] = field(default_factory=list)


def judge(difference: Estimate, published: float, resolution: float, ours: Estimate | None = None,
          null: float = 0.0) -> Judgement:
    """The rule. `difference`: ours − published (corrected for a known offset of the statistics) with its error;
    `ours`: for a claim (a Δ) our Δ with its own error, whose interval must exclude `null` (0, or what selection
    alone gives) on the published side. A claim is reproduced when our Δ is significant with the published sign and
    consistent with the published Δ (the difference's interval holds 0), differs when inconsistent or significant
    the other way (reversed), else inconclusive. A level, or a claim of no change (published 0), is reproduced when
    consistent and the difference's half-width is at most `resolution` (we could have told a value that far off
    apart), differs when inconsistent, else inconclusive."""
    consistent = abs(difference.value) <= difference.half_width
    if ours is not None and published != 0:
        shift = ours.value - null
        significant = abs(shift) > ours.half_width
        if significant and shift * published < 0:
            return Judgement("differs", reversed=True)
        if not consistent:
            return Judgement("differs")
        return Judgement("reproduced" if significant else "inconclusive")
    if not consistent:
        return Judgement("differs")
    if difference.half_width <= resolution:
        return Judgement("reproduced")
    return Judgement("inconclusive", words=[f"the interval (±{difference.half_width:.3g}) is wider than the "
                                            f"resolution {resolution:g}"])


def power_of(effect: float, se: float, df: float) -> float:
    """The chance that an estimate with standard error `se` (and `df`) is significant on the side of a true
    `effect` (normal approximation of the t test's power)."""
    if se <= 0:
        return 1.0 if effect else 0.0
    return NormalDist().cdf(abs(effect) / se - quantile(df))


def seeds_to_decide(effect: float, sd: float, extra_df: float = 0.0) -> int | None:
    """The fewest seeds n whose mean (spread `sd` per seed, n − 1 + extra_df degrees of freedom) reproduces a true
    `effect` with probability POWER; None when no number up to MAX_SEEDS does (or the effect is 0)."""
    if effect == 0:
        return None

    def enough(n: int) -> bool:
        return power_of(effect, sd / math.sqrt(n), n - 1 + extra_df) >= POWER

    if not enough(MAX_SEEDS):
        return None
    high = 1 if extra_df > 0 else 2  # one seed has no spread of its own
    low = high - 1  # below the answer; `high` at or above it once bracketed
    while not enough(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return high
