"""A grid at another scale (docs/reproduce.md#cpu-scale): `--scale cpu` keeps a grid's axes and flags and adds, after
its file's flags and before those after `--`, flags that shrink every run to seconds on a CPU (2 layers of width 64,
8 sequences of 64 tokens per step, 20 steps, the default data); its runs go to <name>-cpu/, and the scorecard calls
every one of them not comparable with the paper."""
from __future__ import annotations

import dataclasses

from grid.plan import GridSpec

SCALES: dict[str, list[str]] = {
    "paper": [],
    "cpu": ["--device=cpu", "--no-compile", "--n-layer=2", "--n-head=2", "--n-embd=64", "--block-size=64",
            "--seq-len=64", "--batch-tokens=512", "--micro-batch=8", "--steps=20", "--val-every=10",
            "--val-tokens=4096", "--log-every=10", "--checkpoint-every=0"],
}


def scaled(spec: GridSpec, scale: str, given_flags: int) -> GridSpec:
    """`spec` at `scale`: its flags with the scale's inserted before the last `given_flags` (those given after
    `--`, which win), and `-<scale>` after its name; unchanged at the paper's scale."""
    if not SCALES[scale]:
        return spec
    cut = len(spec.flags) - given_flags
    return dataclasses.replace(spec, name=f"{spec.name}-{scale}",
                               flags=spec.flags[:cut] + SCALES[scale] + spec.flags[cut:])
