"""The published numbers as data (eval/published/arxiv-2601.22257.toml; docs/reproduce.md#the-published-numbers):
every cell with its table, row, column, seeds, the configurations it describes and its source, the per-metric
resolution and reference spread the verdicts use, read and checked entry by entry. A damaged file is refused with
one line that names the file, the entry at fault and what is wrong (PublishedDataError)."""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import config as run_config
import train_gpt
from eval.paper_run import METRICS
from eval.verdicts import Spread
from optim import OPTIMIZERS

PUBLISHED = Path(__file__).resolve().parent / "published" / "arxiv-2601.22257.toml"
GRIDS = Path(__file__).resolve().parent.parent / "grids"  # grids/<grid>.toml: the files that train the cells' runs
STATISTICS = ("mean", "least")
# What each key of the file may hold: a [[table]] entry's, a cell's (in a table's `cells`), a [spread] entry's.
KINDS = {"text": "a string", "number": "a finite number", "spread": "a finite number >= 0",
         "positive": "a finite number > 0", "seeds": "a non-empty list of distinct integers",
         "names": "a key of the table's [table.runs], or a non-empty list of them", "flag": "true or false",
         "metric": f"one of {', '.join(METRICS)}", "statistic": f"one of {', '.join(STATISTICS)}",
         "grid": "the name of a file grids/<name>.toml", "list": "a list of inline tables", "table": "a table",
         "count": "an integer >= 1"}
TABLE_KEYS = {"table": "text", "caption": "text", "grid": "grid", "metric": "metric", "statistic": "statistic",
              "seeds": "seeds", "cells": "list", "runs": "table"}
TABLE_REQUIRED = ("table", "caption", "cells", "runs")
CELL_KEYS = {"row": "text", "column": "text", "value": "number", "runs": "names", "baseline": "text",
             "std": "spread", "seeds": "seeds", "metric": "metric", "statistic": "statistic", "source": "text",
             "pool": "flag"}
CELL_REQUIRED = ("row", "column", "value")
SPREAD_KEYS = {"sd": "positive", "df": "count"}


class PublishedDataError(ValueError):
    """The published-data file is missing or damaged (the message names it, the entry and what is wrong)."""


@dataclass
class Cell:
    """One published number: where it is (table, row, column, source), what it is (metric, value, the published
    spread `std` over its seeds when the paper gives one), which runs it describes (`runs`: selectors of config
    values, several when the cell is the best of those configurations per seed; `baseline`: for a Δ, the runs it
    is taken against; `pool`: a Δ that is the mean of the other Δ cells of its column) and over which seeds
    (`statistic` mean or least)."""

    table: str
    row: str
    column: str
    metric: str
    value: float
    seeds: list[int]
    statistic: str
    runs: list[dict]
    source: str
    grids: list[str]
    baseline: dict | None = None
    std: float | None = None
    pool: bool = False

    @property
    def claim(self) -> bool:
        return self.baseline is not None or self.pool

    @property
    def name(self) -> str:
        return f"Table {self.table}, {self.row}, {self.column}"

    @property
    def series(self) -> str:
        """The configuration and metric the cell measures, whatever its seeds (series_key)."""
        return series_key(self.metric, self.runs, self.baseline)


def series_key(metric: str, runs: list[dict], baseline: dict | None = None) -> str:
    """A configuration (its selectors, and a Δ's baseline) and a metric, whatever the seeds: the cells of one series
    (Table 2's per-seed rows and its Mean row, Table 23's PReLU columns) describe one per-seed distribution."""
    return json.dumps([metric, runs, baseline], sort_keys=True)


@dataclass
class Published:
    """The published-data file: its path, per metric the resolution a cell must reach and the reference per-seed
    spread (where neither we nor the paper have one), the tables' captions and the cells."""

    path: Path
    resolution: dict[str, float]
    spread: dict[str, Spread]
    captions: dict[str, str]
    cells: list[Cell]


def load_published(path: Path | None = None) -> Published:
    """The published-data file at `path` (default: the shipped one, PUBLISHED), every entry checked;
    PublishedDataError (one line naming the file and the entry) when it is missing, not TOML or not as
    docs/reproduce.md#the-published-numbers describes."""
    path = Path(path or PUBLISHED)
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise PublishedDataError(f"{path}: reading TOML needs Python 3.11 or newer, or the tomli package") from None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PublishedDataError(f"{path}: cannot read the published numbers ({exc.strerror}); the repository ships "
                                 f"them in {PUBLISHED}") from None
    except (ValueError, UnicodeDecodeError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise PublishedDataError(f"{path}: not a valid published-data file ({exc})") from None
    try:
        return _parse(path, data)
    except _Damage as exc:
        raise PublishedDataError(f"{path}: {exc} (docs/reproduce.md#the-published-numbers)") from None


class _Damage(ValueError):
    """An entry that is not as the format says: the message names it."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


CHECKS = {  # kind -> whether a value is of that kind (KINDS says it in words)
    "text": lambda v: isinstance(v, str) and bool(v.strip()),
    "number": _number, "spread": lambda v: _number(v) and v >= 0, "positive": lambda v: _number(v) and v > 0,
    "count": lambda v: _integer(v) and v >= 1,
    "seeds": lambda v: isinstance(v, list) and bool(v) and all(map(_integer, v)) and len(set(v)) == len(v),
    "names": lambda v: (isinstance(v, str) and bool(v)) or (isinstance(v, list) and bool(v)
                                                            and all(isinstance(n, str) and n for n in v)),
    "flag": lambda v: isinstance(v, bool), "metric": lambda v: isinstance(v, str) and v in METRICS,
    "statistic": lambda v: isinstance(v, str) and v in STATISTICS, "grid": lambda v: isinstance(v, str) and bool(v),
    "list": lambda v: isinstance(v, list), "table": lambda v: isinstance(v, dict),
}


def _entry(where: str, entry: object, keys: dict[str, str], required: tuple[str, ...]) -> dict:
    """`entry` checked against `keys` (name -> kind): a table, no unknown key, every required one, each value of
    its kind; _Damage naming `where` otherwise."""
    if not isinstance(entry, dict):
        raise _Damage(f"{where}: {entry!r} is not a table")
    for key in entry:
        if key not in keys:
            close = difflib.get_close_matches(key, list(keys), n=1)
            raise _Damage(f"{where}: unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else
                                                             f"; the keys are {', '.join(keys)}"))
    for key in required:
        if key not in entry:
            raise _Damage(f"{where}: lacks its {key!r}")
    for key, value in entry.items():
        if not CHECKS[keys[key]](value):
            raise _Damage(f"{where}: {key} = {value!r} is not {KINDS[keys[key]]}")
    return entry


def _grid(where: str, name: str) -> str:
    """A grid name whose file exists (checked where the repository's grids/ is there: not in an installed
    package)."""
    if GRIDS.is_dir() and not (GRIDS / f"{name}.toml").is_file():
        close = difflib.get_close_matches(name, [g.stem for g in GRIDS.glob("*.toml")], n=1)
        raise _Damage(f"{where}: grid = {name!r} names no grid file (no grids/{name}.toml"
                      + (f"; did you mean {close[0]!r}?)" if close else ")"))
    return name


def config_fields() -> set[str]:
    """Every config.json field a selector may name: the trainer's, the research tools' and every optimizer's."""
    names = set()
    for optimizer in OPTIMIZERS:
        for cls in run_config.section_classes(train_gpt.GPTConfig, train_gpt.TrainConfig, optimizer).values():
            names |= {f.name for f in dataclasses.fields(cls)}
    return names


def _selector(where: str, selector: object, fields: set[str]) -> dict:
    if not isinstance(selector, dict) or not selector:
        raise _Damage(f"{where}: {selector!r} is not a table of config.json values (field = value)")
    for key, value in selector.items():
        if key != "grid" and key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            raise _Damage(f"{where}: {key!r} is no field of config.json" + (f" (did you mean {close[0]!r}?)"
                                                                               if close else ""))
        if not isinstance(value, (str, int, float, bool)):
            raise _Damage(f"{where}: {key} = {value!r} is not a string, number or boolean")
    return selector


def _per_metric(data: dict, section: str, check) -> dict:
    table = data.get(section)
    if not isinstance(table, dict):
        raise _Damage(f"[{section}] is missing: it gives every metric once ({', '.join(METRICS)})")
    if set(table) != set(METRICS):
        missing, unknown = sorted(set(METRICS) - set(table)), sorted(set(table) - set(METRICS))
        raise _Damage(f"[{section}] must give every metric once: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(unknown)}"]
                                                                       if unknown else [])))
    return {name: check(f"[{section}] {name}", value) for name, value in table.items()}


def _resolution(where: str, value: object) -> float:
    if not CHECKS["positive"](value):
        raise _Damage(f"{where} = {value!r} is not {KINDS['positive']}")
    return float(value)


def _spread(where: str, value: object) -> Spread:
    entry = _entry(where, value, SPREAD_KEYS, tuple(SPREAD_KEYS))
    return Spread(float(entry["sd"]), entry["df"], "the reference spread (published-data file)")


def _parse(path: Path, data: dict) -> Published:
    resolution = _per_metric(data, "resolution", _resolution)
    spread = _per_metric(data, "spread", _spread)
    unknown = sorted(set(data) - {"resolution", "spread", "table"})
    if unknown:
        raise _Damage(f"unknown top-level keys {', '.join(unknown)} (the file holds [resolution], [spread] and "
                      "[[table]] entries)")
    if not isinstance(data.get("table"), list) or not data["table"]:
        raise _Damage("no [[table]] entries")
    fields, captions, cells, seen = config_fields(), {}, [], set()
    for index, table in enumerate(data["table"], 1):
        named = isinstance(table, dict) and isinstance(table.get("table"), str)
        table = _entry(f"table {table['table']}" if named else f"[[table]] number {index}", table, TABLE_KEYS,
                       TABLE_REQUIRED)
        name = table["table"]
        where = f"table {name}"
        if name in captions:
            raise _Damage(f"{where}: a second [[table]] with this name")
        captions[name] = table["caption"]
        default_grid = _grid(where, table["grid"]) if "grid" in table else None
        selectors = {}
        for key, selector in table["runs"].items():
            selectors[key] = _selector(f"{where}, runs {key}", selector, fields)
            grid = selectors[key].get("grid", default_grid)
            if not isinstance(grid, str):
                raise _Damage(f"{where}, runs {key}: names no grid file (grid = \"...\" here or in the table)")
            _grid(f"{where}, runs {key}", grid)
        for entry in table["cells"]:
            label = (f"{where}, row {entry.get('row')!r}, column {entry.get('column')!r}" if isinstance(entry, dict)
                     else f"{where}, a cell")
            cells.append(_cell(label, _entry(label, entry, CELL_KEYS, CELL_REQUIRED), table, selectors, seen))
    for cell in cells:
        if cell.pool and not any(c.claim and not c.pool and (c.table, c.column) == (cell.table, cell.column)
                                 for c in cells):
            raise _Damage(f"{cell.name}: pool = true, but its column holds no Δ cell to pool")
    return Published(path, resolution, spread, captions, cells)


def _cell(where: str, entry: dict, table: dict, selectors: dict, seen: set) -> Cell:
    name = table["table"]
    key = (name, entry["row"], entry["column"])
    if key in seen:
        raise _Damage(f"{where}: a second cell at this row and column")
    seen.add(key)
    metric, statistic = entry.get("metric", table.get("metric")), entry.get("statistic", table.get("statistic", "mean"))
    seeds = entry.get("seeds", table.get("seeds"))
    if metric is None or seeds is None:
        raise _Damage(f"{where}: gives no {'metric' if metric is None else 'seeds'} (here or in the table)")
    names = entry.get("runs", [])
    names = [names] if isinstance(names, str) else names
    baseline = entry.get("baseline")
    if entry.get("pool") and (names or baseline):
        raise _Damage(f"{where}: a pooled cell (pool = true) names no runs or baseline: it pools its column's Δ cells")
    if not names and not entry.get("pool"):
        raise _Damage(f"{where}: names no runs (runs = \"...\", a key of the table's [table.runs])")
    missing = [n for n in names + ([baseline] if baseline else []) if n not in selectors]
    if missing:
        raise _Damage(f"{where}: runs {', '.join(missing)} not in the table's [table.runs] "
                      f"({', '.join(selectors)})")
    if baseline in names:
        raise _Damage(f"{where}: baseline {baseline!r} is also one of its runs (a Δ against itself)")
    chosen = [selectors[n] for n in names] + ([selectors[baseline]] if baseline else [])
    return Cell(name, entry["row"], entry["column"], metric, float(entry["value"]), seeds, statistic,
                [_config_keys(selectors[n]) for n in names], entry.get("source", table["caption"]),
                sorted({s.get("grid", table.get("grid")) for s in chosen}),
                _config_keys(selectors[baseline]) if baseline else None,
                float(entry["std"]) if "std" in entry else None, entry.get("pool", False))


def _config_keys(selector: dict) -> dict:
    return {k: v for k, v in selector.items() if k != "grid"}
