"""What the paper's run is and how far a run is from it (docs/reproduce.md#what-reproduced-means): a run directory
as the scorecard reads it (with its cell's settings and whether it finished: eval.samples), the numbers the paper
reports as a run keeps them (its metrics), and each way a run differs from the paper's run of Silverstein, Kunin and
Shyam (arXiv:2601.22257): data, tokens, model, precision, configuration (on --resume too), validation."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import config as run_config
import train_gpt
from cli import option
from eval.configuration import read_config
from eval.outputs import EVAL_DIRNAME
from eval.samples import best_val_loss, cell_settings, run_outcome, unused_by_bias_mode
from run.log import read_log

FINEWEB_EDU = re.compile(r"^finewebedu_(train|val)_\d{6}\.bin$")  # the paper's data (docs/data.md#fineweb-edu)
TOKEN_FIELDS = {"steps", "batch_tokens", "seq_len"}  # how long a run trained, in the run's configuration
PAPER_VAL_EVERY = 1000  # the published runs' validation cadence (docs/optimizers.md#paper-parity)


@dataclass(frozen=True)
class Metric:
    """A number a published cell reports and where a run keeps ours: `read` takes a run (ScoredRun) and returns it or
    None, `lower_is_better` says which of two is the best (a cell's `least` statistic, Table 23's best
    configuration), `missing` what computes it."""

    label: str
    fmt: str
    read: Callable[["ScoredRun"], float | None]
    missing: str
    lower_is_better: bool = True


def _logic(key: str, scale: float = 100.0) -> Callable[["ScoredRun"], float | None]:
    def read(run: ScoredRun) -> float | None:
        suite = run.logic_paper
        return None if suite is None else scale * suite["overall"][key]
    return read


def _alignment(path: tuple[str, ...], scale: float = 1.0) -> Callable[["ScoredRun"], float | None]:
    def read(run: ScoredRun) -> float | None:
        value = run.alignment_raw
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return None if value is None else scale * value
    return read


LOGIC = "`python -m eval.report --run RUN` (the paper's suite under the paper's protocol)"
ALIGNMENT = "`python -m eval.report --run RUN` (raw keys)"
METRICS: dict[str, Metric] = {
    "best_val_loss": Metric("best validation loss", ".4f", lambda run: best_val_loss(run.log),
                            "RUN/log.jsonl holds no single-batch validation estimate (one every --val-every steps)"),
    "logic_loss": Metric("logic loss", ".3f", _logic("logic_loss", 1.0), LOGIC),
    "logic_top5": Metric("logic top-5 % (items)", ".1f", _logic("top5"), LOGIC, False),
    "logic_top1": Metric("logic top-1 % (items)", ".1f", _logic("top1"), LOGIC, False),
    "logic_top5_category_mean": Metric("logic top-5 % (category mean)", ".1f", _logic("top5_category_mean"), LOGIC,
                                       False),
    "logic_top1_category_mean": Metric("logic top-1 % (category mean)", ".1f", _logic("top1_category_mean"), LOGIC,
                                       False),
    "alignment_mean_top": Metric("mean top alignment", ".3f", _alignment(("mean_top",)), ALIGNMENT, False),
    "alignment_frac_above_null": Metric("heads above the null threshold %", ".1f",
                                        _alignment(("frac_above_null",), 100.0), ALIGNMENT, False),
    "alignment_max_top": Metric("max top alignment", ".3f", _alignment(("max_top",)), ALIGNMENT, False),
    **{f"enrichment_{c}": Metric(f"{c.replace('_', ' ')} enrichment (log2)", "+.2f",
                                 _alignment(("enrichment", "pooled", c)), ALIGNMENT, False)
       for c in ("sentence_starters", "interrogatives", "punctuation", "function_words", "unicode_noise")},
}

@dataclass
class ScoredRun:
    """A run directory as the scorecard reads it: config.json, log.jsonl and the evaluations it needs, why it is not
    comparable with the paper's run (`problems`, empty when it is), and whether it counts at all (`outcome`:
    finished, diverged or unfinished, with `why`; samples.run_outcome)."""

    path: Path
    config: dict
    log: list[dict]
    problems: list[str] = field(default_factory=list)
    outcome: str = "finished"
    why: str = ""

    @classmethod
    def read(cls, path: Path) -> ScoredRun:
        config, log = read_config(path), read_log(path)
        return cls(path, config, log, paper_differences(config, log), *run_outcome(config, log))

    @functools.cached_property
    def settings(self) -> dict[str, object]:
        """What the runs of one cell must share (samples.cell_settings)."""
        return cell_settings(self.config)

    @property
    def seed(self) -> int | None:
        return self.config.get("train", {}).get("seed")

    def setting(self, key: str) -> object:
        """A configuration value by field name, from whichever section holds it (None when none does)."""
        return next((section[key] for section in self.sections() if key in section), None)

    def sections(self) -> list[dict]:
        return [self.config.get(s, {}) for s in ("model", "train", "research", "optim")]

    def _eval(self, name: str) -> dict | None:
        path = self.path / EVAL_DIRNAME / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    @functools.cached_property
    def logic_paper(self) -> dict | None:
        logic = self._eval("logic_puzzles") or {}
        return next((s for s in logic.get("suites", []) if s["name"] == "paper" and s["protocol"] == "paper"), None)

    @functools.cached_property
    def alignment_raw(self) -> dict:
        return ((self._eval("alignment") or {}).get("modes") or {}).get("raw") or {}


def paper_differences(config: dict, log: list[dict]) -> list[str]:
    """Why a run is not comparable with the paper's run, by cause (data, tokens, model, precision, configuration),
    each naming the values; empty when it is the paper's run. The cell's own settings (bias mode, μ_V, activation,
    optimizer, an SGDM start at rest) are compared by the cell, not here: the reference is the grids' preset for
    the run's activation and optimizer (gpt2-124m or gpt2-124m-gelu) with the run's bias settings. Also: a setting
    that affects results changed on --resume (log.jsonl's `changed` records; config.json holds only the last), and
    more training tokens than the training data holds (the loader wrapped around)."""
    problems = []
    data = config.get("data") or {}
    for split in ("train", "val"):
        files = (data.get(split) or {}).get("files") or []
        if not files or not all(FINEWEB_EDU.match(Path(f["path"]).name) for f in files):
            where = (data.get(split) or {}).get("pattern") or config.get("train", {}).get(f"{split}_files") or "?"
            problems.append(f"data: {'trained' if split == 'train' else 'validated'} on {where} "
                            f"(fingerprint {data.get('fingerprint', 'not recorded')}), not FineWeb-Edu")
    model, train = config.get("model", {}), config.get("train", {})
    consumed = (train.get("steps") or 0) * (train.get("batch_tokens") or 0)
    held = (data.get("train") or {}).get("tokens")
    if held and consumed > held:
        problems.append(f"tokens: the run trains on {consumed:,} tokens, {consumed / held:.2g} times the {held:,} its "
                        "training data holds (the loader wraps around: more than one epoch; the paper's runs read "
                        "500M tokens once)")
    optimizer = train.get("optimizer")
    if optimizer not in run_config.PAPER_OPTIMIZERS:
        return problems + [f"configuration: --optimizer {optimizer} is not one of the paper's"]
    preset = "gpt2-124m-gelu" if model.get("activation") == "gelu" else "gpt2-124m"
    classes = run_config.section_classes(train_gpt.GPTConfig, train_gpt.TrainConfig, optimizer)
    paper = run_config.preset_values(classes, preset, optimizer)
    compared = {f.name: section for section, cls in classes.items() for f in dataclasses.fields(cls)
                if f.metadata.get("affects_results", True)}
    unused = unused_by_bias_mode(model) | {"bias_mode", "mean_v", "activation", "initial_velocity_std"}
    for name, section in compared.items():
        value, published = config.get(section, {}).get(name), paper[section][name]
        if name in unused or value == published:
            continue
        cause = ("tokens" if name in TOKEN_FIELDS else "precision" if "dtype" in name
                 else "model" if section == "model" else "configuration")
        problems.append(f"{cause}: {option(name)} {value} ({preset}: {published})")
    for record in log:
        changed = {key.partition(".")[2]: values for key, values in (record.get("changed") or {}).items()}
        # a constant schedule does not read --steps: a run resumed with more steps is the longer run
        changed = {name: values for name, values in changed.items() if name in compared
                   and not (name == "steps" and train.get("lr_schedule") == "constant")}
        if changed:
            problems.append(f"configuration: changed on --resume at step {record.get('step')}: "
                            + ", ".join(f"{option(name)} {old} -> {new}" for name, (old, new) in changed.items()))
    return problems


def metric_problem(metric: str, run: ScoredRun) -> str | None:
    """Why `metric` of `run` is not the published quantity even where the run is the paper's: the best validation
    loss is the least single-batch estimate every 1000 steps with the last sampled biases, each estimate on a batch
    of its own (the published runs never repeat one)."""
    if metric != "best_val_loss":
        return None
    train = run.config.get("train", {})
    if not (train.get("val_batch_estimate") and train.get("val_every") == PAPER_VAL_EVERY):
        ours = f"every {train.get('val_every')} steps" if train.get("val_batch_estimate") else "off"
        return f"validation: single-batch estimates {ours}, the paper's every {PAPER_VAL_EVERY}"
    if train.get("val_biases", "mean") != "last-sample":
        return (f"validation: single-batch estimates at --val-biases {train.get('val_biases', 'mean')}, the "
                "published trainer's with the last sampled biases (--val-biases last-sample)")
    hp = run_config.config_from_dict(train, train_gpt.TrainConfig)
    estimates = range(hp.val_every, hp.steps + 1, hp.val_every)
    if len({run_config.single_batch_start(step, hp) for step in estimates}) < len(estimates):
        return (f"validation: --val-tokens {hp.val_tokens:,} holds {hp.val_tokens // hp.batch_tokens} batches of "
                f"--batch-tokens, fewer than the run's {len(estimates)} single-batch estimates, so they repeat "
                "(the published runs' never do)")
    return None


def matches(run: ScoredRun, selector: dict, seeds: list[int]) -> bool:
    """Whether `run` is a run of `selector` (config values by field name) with one of `seeds`."""
    return run.seed in seeds and all(_same(run.setting(k), v) for k, v in selector.items())


def _same(a: object, b: object) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b
