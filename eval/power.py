"""What a grid can decide before it runs (docs/reproduce.md#the-power-of-a-grid): per published claim (a Δ) whose
runs the grid trains, the seeds it gives the claim, the chance that the claim is reproduced if the paper's Δ and its
spread are the truth, and the seeds that would reproduce it 4 times in 5. `python -m grid --dry-run` prints it."""
from __future__ import annotations

import math
from pathlib import Path

from eval import verdicts
from eval.paper_data import Cell, load_published
from eval.paper_run import ScoredRun, matches
from eval.scorecard import Context


def seeds_for(cell: Cell, runs: list[ScoredRun]) -> list[int]:
    """The seeds of `cell` for which `runs` hold its configuration and its baseline."""
    def has(selectors: list[dict], seed: int) -> bool:
        return any(matches(r, s, [seed]) for r in runs for s in selectors)
    return [seed for seed in cell.seeds if has(cell.runs, seed) and has([cell.baseline], seed)]


def power_lines(configs: list[dict]) -> list[str]:
    """The claims that the runs of `configs` (config.json dicts, as the grid plans them) feed, each with the seeds
    they give it, its power at the paper's spread (its Std for the claim's configuration, else √2 times the metric's
    reference spread) and the seeds for verdicts.POWER; [] when they feed none."""
    published = load_published()
    runs = [ScoredRun(Path(f"planned-{i}"), config, []) for i, config in enumerate(configs)]
    context = Context.of(published, [])
    lines = []
    for cell in published.cells:
        if cell.baseline is None or cell.value == 0 or not (seeds := seeds_for(cell, runs)):
            continue
        spread = context.spreads(cell.series, [], cell.metric, True)[0]
        n, needed = len(seeds), None
        if cell.statistic == "least":  # the least of n seeds each side
            se, df = spread.sd * math.sqrt(verdicts.least_of(n)[1]), spread.df
        elif len(cell.seeds) == 1:  # one seed's Δ: judged with its configuration's spread
            se, df = spread.sd, spread.df
        else:
            se, df, needed = spread.sd / math.sqrt(n), n - 1, verdicts.seeds_to_decide(cell.value, spread.sd)
        lines.append(f"  {cell.name}: {cell.value:+g} at spread {spread.sd:.3g} ({spread.source}): {n} seed"
                     f"{'s' * (n > 1)} here, power {100 * verdicts.power_of(cell.value, se, df):.0f}%"
                     + (f"; {needed} seeds give {100 * verdicts.POWER:.0f}%" if needed else ""))
    if not lines:
        return []
    return ["claims these runs decide (power: the chance each is reproduced if the paper's Δ and spread are the "
            "truth; docs/reproduce.md#the-power-of-a-grid):"] + lines
