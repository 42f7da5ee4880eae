"""The verdict rule's arithmetic (eval/verdicts.py, docs/reproduce.md#what-reproduced-means): its edges exactly (a
difference on its interval's edge is consistent, an interval as wide as the resolution resolves, a Δ on its own
interval's edge is not significant), the order statistics of the least of k seeds, Welch's degrees of freedom and
the seeds that would decide a claim."""
from __future__ import annotations

import math
import statistics

import pytest

from eval import verdicts
from eval.verdicts import Estimate


def edge(se: float = 0.05, df: float = 4) -> float:
    """The half-width of an estimate with this error, as the rule computes it."""
    return Estimate(0.0, se, df).half_width


def test_a_difference_on_the_edge_of_its_interval_is_consistent_and_beyond_it_differs():
    h = edge()
    assert verdicts.judge(Estimate(h, 0.05, 4), 3.9, resolution=1.0).verdict == "reproduced"
    assert verdicts.judge(Estimate(-h, 0.05, 4), 3.9, resolution=1.0).verdict == "reproduced"
    assert verdicts.judge(Estimate(math.nextafter(h, 1), 0.05, 4), 3.9, resolution=1.0).verdict == "differs"


def test_an_interval_as_wide_as_the_resolution_resolves_and_a_wider_one_is_inconclusive():
    h = edge()
    assert verdicts.judge(Estimate(0.0, 0.05, 4), 3.9, resolution=h).verdict == "reproduced"
    wider = verdicts.judge(Estimate(0.0, 0.05, 4), 3.9, resolution=math.nextafter(h, 0))
    assert wider.verdict == "inconclusive" and "wider than the resolution" in wider.words[0]


def test_a_delta_on_the_edge_of_its_own_interval_is_not_significant():
    h = edge(0.1, 3)
    gap = Estimate(0.0, 0.2, 3)  # consistent with the published Δ
    assert verdicts.judge(gap, -0.5, 1.0, ours=Estimate(-h, 0.1, 3)).verdict == "inconclusive"
    assert verdicts.judge(gap, -0.5, 1.0, ours=Estimate(math.nextafter(-h, -1), 0.1, 3)).verdict == "reproduced"
    shifted = verdicts.judge(gap, -0.5, 1.0, ours=Estimate(-h - 0.02, 0.1, 3), null=-0.02)  # selection's share
    assert shifted.verdict == "inconclusive"


def test_a_significant_delta_of_the_other_sign_is_reversed_even_when_consistent():
    found = verdicts.judge(Estimate(0.0, 1.0, 3), 0.001, 1.0, ours=Estimate(-0.3, 0.01, 3))
    assert found.verdict == "differs" and found.reversed
    assert not verdicts.judge(Estimate(5.0, 1.0, 3), -0.5, 1.0, ours=Estimate(-0.5, 0.01, 3)).reversed


def test_a_published_delta_of_zero_is_judged_as_a_level():
    assert verdicts.judge(Estimate(0.01, 0.01, 3), 0.0, 0.1, ours=Estimate(0.01, 0.01, 3)).verdict == "reproduced"
    assert verdicts.judge(Estimate(0.01, 0.5, 3), 0.0, 0.1, ours=Estimate(0.01, 0.5, 3)).verdict == "inconclusive"


def test_the_least_of_k_seeds_and_welchs_degrees_of_freedom():
    assert verdicts.least_of(1) == (0.0, 1.0)
    assert verdicts.least_of(2) == pytest.approx((-1 / math.sqrt(math.pi), 1 - 1 / math.pi))
    mean3, var3 = verdicts.least_of(3)
    assert mean3 == pytest.approx(-3 / (2 * math.sqrt(math.pi))) and 0 < var3 < 1 - 1 / math.pi
    assert verdicts.welch_df([(0.01, 3), (0.01, 3)]) == pytest.approx(6)
    assert verdicts.welch_df([(0.01, math.inf), (0.0, 2)]) == math.inf
    assert verdicts.quantile(math.inf) == pytest.approx(statistics.NormalDist().inv_cdf(0.975))
    assert verdicts.quantile(3) == pytest.approx(3.182446, abs=1e-6)


def test_the_seeds_that_would_decide_a_claim_are_the_fewest_with_the_power():
    for effect, sd in ((-0.49, 0.09), (-0.03, 0.018), (7.1, 10.1)):
        n = verdicts.seeds_to_decide(effect, sd)
        assert verdicts.power_of(effect, sd / math.sqrt(n), n - 1) >= verdicts.POWER
        assert n == 2 or verdicts.power_of(effect, sd / math.sqrt(n - 1), n - 2) < verdicts.POWER
    assert verdicts.seeds_to_decide(0.0, 0.1) is None
