"""The published-data file (eval/published/arxiv-2601.22257.toml, docs/reproduce.md#the-published-numbers): the
shipped file loads; every shape of damage is refused with one line that names the file, the entry at fault and what
is wrong, before anything is compared (`eval.compare --against-paper` exits 2 and writes nothing)."""
from __future__ import annotations

import re

import pytest

from eval import compare, paper_data
from tests.helpers import finished_run

SHIPPED = paper_data.PUBLISHED.read_text(encoding="utf-8")
TABLE1_ECD = '{ row = "ECD", column = "Symmetric", value = 3.93, runs = "ecd-sym" }'
ECD_SYM = 'ecd-sym = { optimizer = "ecd", activation = "prelu", bias_mode = "none" }'
GRID1 = 'grid = "table1"\nmetric = "best_val_loss"'
MEAN_SYM = '{ row = "Mean", column = "Symmetric", value = 3.88, std = 0.07, runs = "sym", seeds = [42, 83, 123, 789] }'


def test_the_shipped_file_loads_with_every_metrics_resolution_and_spread():
    published = paper_data.load_published()
    assert set(published.resolution) == set(published.spread) == set(paper_data.METRICS)
    assert published.spread["best_val_loss"].sd == 0.07 and published.spread["best_val_loss"].df == 3
    assert len({(c.table, c.row, c.column) for c in published.cells}) == len(published.cells)


@pytest.mark.parametrize("old, new, where, problem", [
    (GRID1, 'grid = "tabel1"\nmetric = "best_val_loss"', "table 1",
     "grid = 'tabel1' names no grid file (no grids/tabel1.toml; did you mean 'table1'?)"),
    (ECD_SYM, ECD_SYM.replace("bias_mode", "bias_mod"), "table 1, runs ecd-sym",
     "'bias_mod' is no field of config.json (did you mean 'bias_mode'?)"),
    (ECD_SYM, ECD_SYM.replace('"none" }', '"none", grid = "tabel2" }'), "table 1, runs ecd-sym",
     "grid = 'tabel2' names no grid file"),
    (ECD_SYM, ECD_SYM.replace('"prelu"', '["prelu"]'), "table 1, runs ecd-sym",
     "activation = ['prelu'] is not a string, number or boolean"),
    (MEAN_SYM, MEAN_SYM.replace("std = 0.07", "std = -0.07"), "table 2, row 'Mean', column 'Symmetric'",
     "std = -0.07 is not a finite number >= 0"),
    (MEAN_SYM, MEAN_SYM.replace("std = 0.07", 'std = "0.07"'), "table 2, row 'Mean', column 'Symmetric'",
     "std = '0.07' is not a finite number >= 0"),
    (MEAN_SYM, MEAN_SYM.replace("std = 0.07", "sdt = 0.07"), "table 2, row 'Mean', column 'Symmetric'",
     "unknown key 'sdt' (did you mean 'std'?)"),
    (MEAN_SYM, MEAN_SYM.replace("seeds = [42, 83, 123, 789]", "seeds = [42, 42]"),
     "table 2, row 'Mean', column 'Symmetric'", "seeds = [42, 42] is not a non-empty list of distinct integers"),
    (MEAN_SYM, MEAN_SYM.replace("value = 3.88, ", ""), "table 2, row 'Mean', column 'Symmetric'", "lacks its 'value'"),
    (MEAN_SYM, MEAN_SYM.replace("value = 3.88", "value = nan"), "table 2, row 'Mean', column 'Symmetric'",
     "value = nan is not a finite number"),
    (TABLE1_ECD, TABLE1_ECD.replace('"ecd-sym"', '"ecd-symmetric"'), "table 1, row 'ECD', column 'Symmetric'",
     "runs ecd-symmetric not in the table's [table.runs]"),
    (TABLE1_ECD, TABLE1_ECD.replace('runs = "ecd-sym"', 'runs = "ecd-sym", baseline = "ecd-sym"'),
     "table 1, row 'ECD', column 'Symmetric'", "baseline 'ecd-sym' is also one of its runs"),
    (TABLE1_ECD, TABLE1_ECD.replace('runs = "ecd-sym"', 'runs = "ecd-sym", metric = "val_loss"'),
     "table 1, row 'ECD', column 'Symmetric'", "metric = 'val_loss' is not one of best_val_loss"),
    (TABLE1_ECD, TABLE1_ECD + ",\n    " + TABLE1_ECD, "table 1, row 'ECD', column 'Symmetric'",
     "a second cell at this row and column"),
    (TABLE1_ECD, TABLE1_ECD.replace('runs = "ecd-sym"', "pool = true"), "Table 1, ECD, Symmetric",
     "pool = true, but its column holds no Δ cell to pool"),
    (TABLE1_ECD, TABLE1_ECD.replace(', runs = "ecd-sym"', ""), "table 1, row 'ECD', column 'Symmetric'",
     "names no runs"),
    ('table = "1"\ncaption', 'table = "1"\ncaptoin', "table 1", "unknown key 'captoin' (did you mean 'caption'?)"),
    ('table = "2"\n', 'table = "1"\n', "table 1", "a second [[table]] with this name"),
    ("best_val_loss = 0.15", "best_val_loss = -0.15", "[resolution] best_val_loss",
     "= -0.15 is not a finite number > 0"),
    ("logic_loss = 0.1 ", "", "[resolution]", "must give every metric once: missing logic_loss"),
    ("best_val_loss = { sd = 0.07, df = 3 }", "best_val_loss = { sd = 0.07, df = 0 }", "[spread] best_val_loss",
     "df = 0 is not an integer >= 1"),
    ("best_val_loss = { sd = 0.07, df = 3 }", "best_val_loss = 0.07", "[spread] best_val_loss", "is not a table"),
    ("[resolution]", "[tolerance]", "[resolution] is missing", ""),
])
def test_every_shape_of_damage_is_one_line_naming_the_entry(tmp_path, capsys, old, new, where, problem):
    assert SHIPPED.count(old) >= 1, old
    path = tmp_path / "published.toml"
    path.write_text(SHIPPED.replace(old, new, 1), encoding="utf-8")
    with pytest.raises(paper_data.PublishedDataError) as error:
        paper_data.load_published(path)
    message = str(error.value)
    assert message.startswith(f"{path}: {where}") and problem in message and "\n" not in message, message
    run = finished_run(tmp_path, "run", "ecd", "none", 42, 3.93)
    with pytest.raises(SystemExit) as stopped:
        compare.main([str(run), "--out", str(tmp_path / "cmp"), "--against-paper", str(path)])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1 and where in err
    assert not (tmp_path / "cmp").exists()  # nothing written


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read the published numbers"),
    ("[[table]\nbroken", "not a valid published-data file"),
    ("[resolution]\nbest_val_loss = 0.05\n", "[resolution] must give every metric once"),
    ("", "[resolution] is missing"),
])
def test_a_missing_or_unreadable_file_is_one_line_naming_it(tmp_path, content, expected):
    path = tmp_path / "published.toml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(paper_data.PublishedDataError, match=re.escape(expected)) as error:
        paper_data.load_published(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
