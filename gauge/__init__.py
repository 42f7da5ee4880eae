"""Gauge research tools for attention heads (docs/gauge.md, docs/structure.md). Nothing is imported here:

    gauge.dynamics     head factors and their dynamics: Noether charges, |J̃|, rotational fraction, weight drift
    gauge.updates      quotient-aware post-processing of an optimizer's update on the heads (--gauge)
    gauge.sensitivity  the gauge-sensitivity diagnostic: one step from two representatives of the same weights
"""
