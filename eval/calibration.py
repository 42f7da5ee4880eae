"""The scorecard's rule under simulation (docs/reproduce.md#calibration): worlds drawn from the paper's own numbers
(its means and Stds), worlds where the biases do nothing, where the effect is reversed, where the spread is huge;
each draw is a set of fabricated run records scored by the scorecard itself, and each scenario reports, per group of
cells, the share reproduced, inconclusive and differs. Fixed generators (numpy's default_rng(seed)), no clock: the
same table every time.

    python -m eval.calibration                  # every scenario, 400 draws each
    python -m eval.calibration --draws 2000 --scenario table2-null
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import train_gpt
from cli import ArgumentParser
from eval import scorecard
from eval.outputs import markdown_table
from eval.paper_run import ScoredRun

OUTCOMES = ("reproduced", "inconclusive", "differs")
# A world: per configuration (a key of the table's [table.runs]) the mean and the sd of its per-seed values.
World = dict[str, tuple[float, float]]


@dataclass(frozen=True)
class Scenario:
    """A world and the cells it is scored on: `table`'s cells that `keep` selects, grouped by `group`."""

    name: str
    description: str
    table: str
    world: World
    keep: Callable[[object], bool] = lambda cell: True


def group(cell) -> str:
    """Which share a cell counts toward: claims or levels, of the pooled seeds (Mean rows) or of one seed."""
    seeds = ("one seed" if len(cell.seeds) == 1 else "mean over seeds" if cell.statistic == "mean"
             else "least of the seeds")
    return f"{'Δ' if cell.claim else 'levels'}, {seeds}"


GELU = {"g-sym": (3.167, 0.023)}  # Table 23: the symmetric GELU seeds' mean and sd (3.185, 3.141, 3.176)
SCENARIOS = [
    Scenario("table2-paper", "Table 2 as published: symmetric N(3.875, 0.07), b_Q + b_V N(3.385, 0.017) per seed", "2",
             {"sym": (3.875, 0.07), "sb": (3.385, 0.017)}),
    Scenario("table2-null", "Table 2 where the biases do nothing: both sides N(3.875, 0.07)", "2",
             {"sym": (3.875, 0.07), "sb": (3.875, 0.07)}),
    Scenario("table2-huge", "Table 2 at the published means with a huge spread: both sides' sd 1.0", "2",
             {"sym": (3.875, 1.0), "sb": (3.385, 1.0)}),
    Scenario("gelu-null", "Table 23's GELU columns where the biases do nothing: every configuration N(3.167, 0.023) "
             "(Best SB is the best of three per seed)", "23",
             {**GELU, "g-bq": GELU["g-sym"], "g-v00": GELU["g-sym"], "g-v05": GELU["g-sym"]},
             lambda cell: cell.column.startswith("GELU")),
    Scenario("gelu-reversed", "Table 23's GELU columns with the effect reversed: each symmetry-broken configuration "
             "N(3.197, 0.005), 0.03 above the symmetric", "23",
             {**GELU, "g-bq": (3.197, 0.005), "g-v00": (3.197, 0.005), "g-v05": (3.197, 0.005)},
             lambda cell: cell.column.startswith("GELU")),
    Scenario("table26-null", "Table 26's validation-loss Δs where the biases do nothing: every run N(3.2, 0.07)", "26",
             {key: (3.2, 0.07) for key in ("adamw-sym", "adamw-sb", "sgdm-sym", "sgdm-sb", "soap-sym", "soap-sb",
                                           "ecd-sym", "ecd-sb")},
             lambda cell: cell.metric == "best_val_loss"),
    Scenario("table1-paper", "Table 1's ECD row as published: per seed symmetric N(3.969, 0.07), b_Q + b_V "
             "N(3.361, 0.02) (the least of two seeds expected at 3.93 and 3.35)", "1",
             {"ecd-sym": (3.969, 0.07), "ecd-sb": (3.361, 0.02)}, lambda cell: cell.row == "ECD"),
    Scenario("table1-reversed", "Table 1's ECD row with the effect reversed: symmetric N(3.96, 0.07), b_Q + b_V "
             "N(4.31, 0.02) (ours +0.35 against the published −0.58)", "1",
             {"ecd-sym": (3.96, 0.07), "ecd-sb": (4.31, 0.02)}, lambda cell: cell.row == "ECD"),
]


class Simulation:
    """Fabricated runs of one scenario: a config.json per configuration and seed (the paper's preset with the
    configuration's values and the published protocol's validation), FineWeb-Edu data, a finished log whose best
    validation loss is the drawn value."""

    def __init__(self, scenario: Scenario) -> None:
        published = scorecard.load_published()
        self.cells = [c for c in published.cells if c.table == scenario.table and scenario.keep(c)]
        self.published = dataclasses.replace(published, cells=self.cells)
        self.scenario = scenario
        keys = _selector_keys(scenario.table)
        selectors = {json.dumps(s, sort_keys=True): s for c in self.cells for s in c.runs + [c.baseline] if s}
        seeds = sorted({s for c in self.cells for s in c.seeds})
        self.runs = [(keys[name], seed, ScoredRun(Path(f"{keys[name]}-{seed}"), _config(selector, seed), [], []))
                     for name, selector in selectors.items() for seed in seeds]  # (configuration, seed, template)

    def draw(self, rng: np.random.Generator) -> list[ScoredRun]:
        """One world's runs: each configuration's per-seed values drawn from its N(mean, sd)."""
        runs = []
        for key, seed, template in self.runs:
            mean, sd = self.scenario.world[key]
            value = float(rng.normal(mean, sd))
            log = [{"step": 1000, "val_loss_batch": value, "best_val_loss_batch": value},
                   {"summary": True, "step": template.config["train"]["steps"], "best_val_loss_batch": value}]
            run = ScoredRun(template.path, template.config, log, [])
            run.__dict__.update({k: v for k, v in template.__dict__.items() if k == "settings"})  # computed once
            runs.append(run)
        return runs

    def shares(self, draws: int, seed: int = 0) -> dict[str, Counter]:
        """{group: Counter of outcomes} over `draws` worlds from default_rng(seed)."""
        rng, counts = np.random.default_rng(seed), {}
        for _ in range(draws):
            for result in scorecard.score(self.published, self.draw(rng)):
                outcome = result.verdict if result.verdict in OUTCOMES else "other"
                counts.setdefault(group(result.cell), Counter())[outcome] += 1
        return counts


def _selector_keys(table: str) -> dict[str, str]:
    """{selector as JSON: its key in the table's [table.runs]} from the published-data file."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    data = tomllib.loads(scorecard.load_published().path.read_text(encoding="utf-8"))
    runs = next(t for t in data["table"] if t["table"] == table)["runs"]
    return {json.dumps({k: v for k, v in s.items() if k != "grid"}, sort_keys=True): key for key, s in runs.items()}


def _config(selector: dict, seed: int) -> dict:
    """config.json of the paper's run with `selector`'s values and `seed`, validated by the published protocol, on
    FineWeb-Edu shards that hold more than the run reads."""
    preset = "gpt2-124m-gelu" if selector.get("activation") == "gelu" else "gpt2-124m"
    config = copy.deepcopy(_preset_config(preset, selector["optimizer"]))
    for key, value in selector.items():
        section = next(name for name, values in config.items() if isinstance(values, dict) and key in values)
        config[section][key] = value
    config["train"].update(seed=seed, val_biases="last-sample")
    return config


@functools.cache
def _preset_config(preset: str, optimizer: str) -> dict:
    """config.json of `preset` with `optimizer` on FineWeb-Edu (callers copy it before changing it)."""
    config = train_gpt.parse_config(["--preset", preset, "--optimizer", optimizer]).to_dict()
    data = {split: {"pattern": f"/data/finewebedu_{split}_*.bin", "tokens": 800_000_000,
                    "files": [{"path": f"/data/finewebedu_{split}_{i:06d}.bin", "tokens": 100_000_000}
                              for i in range(1, 9)]} for split in ("train", "val")}
    return {**config, "data": {**data, "fingerprint": "f" * 16}}


def calibration_table(scenarios: list[Scenario], draws: int, seed: int = 0) -> str:
    """The calibration table in Markdown: per scenario and group of cells, the shares of each outcome."""
    rows = []
    for scenario in scenarios:
        for name, counts in sorted(Simulation(scenario).shares(draws, seed).items()):
            total = sum(counts.values())
            rows.append([scenario.name, name, *(f"{100 * counts[o] / total:.1f}%" for o in OUTCOMES + ("other",))])
    return markdown_table(["scenario", "cells", *OUTCOMES, "other"], rows)


def main(argv: list[str] | None = None) -> str:
    parser = ArgumentParser(module="eval.calibration", description=__doc__)
    parser.add_argument("--draws", type=int, default=400, help="worlds per scenario (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the generators' seed (default: %(default)s)")
    parser.add_argument("--scenario", action="append", choices=[s.name for s in SCENARIOS],
                        help="only this scenario (repeatable; default: every one)")
    args = parser.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.scenario or s.name in args.scenario]
    text = ("\n".join(f"- {s.name}: {s.description}" for s in chosen) + "\n\n"
            + calibration_table(chosen, args.draws, args.seed))
    print(text)
    return text


if __name__ == "__main__":
    main()
