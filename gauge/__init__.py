"""Gauge research tools for attention heads (docs/gauge.md, docs/structure.md): head factors and their dynamics,
quotient-aware updates, the gauge-sensitivity diagnostic."""
