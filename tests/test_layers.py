"""The README's layer diagram as a checked claim (README.md#layout): every import of every module of the repository,
at the top of a module or inside a function, goes to a layer left of the importer's or stays in its own package;
kernels imports nothing else of the project; only train_gpt imports hooks; nothing but grid imports eval; no module
imports itself through a chain of others. The diagram is read from the README, so the page and the code cannot
drift apart. Each package's docstring maps its modules, and the map is checked against the tree; no test module
imports another.

What is read: every .py file at any depth but the tests, build outputs, runs and hidden folders
(tests.helpers.repository_modules), its import statements and its calls of importlib.import_module / __import__
with a literal name (run.directory.imported_names). What is not: a name computed at run time
(`import_module(f"optim.{name}")`, a variable), an alias of import_module, and code run by other means (runpy, exec,
importlib.util.spec_from_file_location)."""
from __future__ import annotations

import ast
import re

import pytest

from run.directory import imported_names, module_file, trainer_sources
from tests.helpers import ROOT, repository_modules

MODULES = repository_modules()
# A chain of layers: `a`, `b` ← `c` ← ... (a backticked name per top-level module or package, layers split by ←).
LAYER_CHAIN = re.compile(r"`[\w.]+`(?:,\s*`[\w.]+`)*(?:\s*←\s*`[\w.]+`(?:,\s*`[\w.]+`)*)+")


def readme_layers() -> dict[str, int]:
    """{top-level module or package: its layer, 0 at the left} from the longest chain in README.md's Layout."""
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):text.index("\n## ", text.index("## Layout") + 1)]
    chain = max(LAYER_CHAIN.findall(layout), key=len)
    return {name: layer for layer, group in enumerate(chain.split("←")) for name in re.findall(r"`([\w.]+)`", group)}


def project_imports() -> dict[str, set[str]]:
    """{module: the repository modules its import statements name}, each name taken to its longest prefix that is a
    module of the repository (`from run import checkpoint` names run and run.checkpoint; `import torch` none)."""
    def resolve(name: str) -> str | None:
        parts = name.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in MODULES), None)

    return {module: {target for name in imported_names(module_file(module))
                     if (target := resolve(name)) not in (None, module)} for module in MODULES}


GRAPH = project_imports()
LAYERS = readme_layers()


def top(module: str) -> str:
    return module.split(".")[0]


def package_children() -> dict[str, set[str]]:
    """{package: its modules and sub-packages}, every folder of modules at any depth counted as a package."""
    children: dict[str, set[str]] = {}
    for module in MODULES:
        parts = module.split(".")
        for depth in range(1, len(parts)):
            children.setdefault(".".join(parts[:depth]), set()).add(".".join(parts[:depth + 1]))
    return children


def test_every_module_is_in_a_layer_of_the_readme_diagram():
    missing = sorted({top(m) for m in MODULES} - set(LAYERS))
    assert not missing, f"not in README.md's layer diagram (## Layout): {missing}"
    unknown = sorted(set(LAYERS) - {top(m) for m in MODULES})
    assert not unknown, f"README.md's layer diagram names what is no module of the repository: {unknown}"


def test_every_import_goes_to_a_layer_to_the_left_or_stays_in_its_package():
    wrong = [f"{a} (layer {LAYERS[top(a)]}) imports {b} (layer {LAYERS[top(b)]})"
             for a, targets in GRAPH.items() for b in sorted(targets)
             if top(a) != top(b) and LAYERS[top(b)] >= LAYERS[top(a)]]
    assert not wrong, "imports against README.md's layer diagram:\n" + "\n".join(wrong)


def test_kernels_import_nothing_of_the_project():
    """Each kernel travels and is tested on its own, beside its reference."""
    reached = sorted(f"{a} imports {b}" for a, targets in GRAPH.items() if top(a) == "kernels"
                     for b in targets if top(b) != "kernels")
    assert not reached, reached


@pytest.mark.parametrize("imported, allowed", [
    ("eval", {"eval", "grid"}),  # the evaluations are a tool: only grid, the top layer, calls them
    ("hooks", {"train_gpt"}),  # the gauge mathematics stays out of the configuration and the checkpoint readers
])
def test_only_the_modules_allowed_import_these(imported, allowed):
    importers = sorted({a for a, targets in GRAPH.items() for b in targets
                        if top(b) == imported and top(a) not in allowed})
    assert not importers, f"{imported} is imported by {importers}; only {sorted(allowed)} may"


def test_no_module_imports_itself_through_others():
    """Depth-first search for a cycle; the failure names one."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def cycle_from(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [module, target] if target in path else [module, target]
            if target not in state and (found := cycle_from(target, path + [module])):
                return found
        state[module] = "done"
        return None

    for module in sorted(GRAPH):
        if module not in state:
            found = cycle_from(module, [])
            assert found is None, "import cycle: " + " -> ".join(found)


def test_every_package_docstring_maps_its_modules():
    """A package's docstring is its map: one indented row per module or sub-package, the dotted name first
    (`    run.checkpoint   the checkpoint format: ...`), as a newcomer reads it. A module without its row, a row naming
    what is no module of the package, a path `folder/name.py` that is no file, or a folder of modules without an
    __init__.py whose docstring maps them, fails. The prose around the rows is not read."""
    problems = []
    for package, children in sorted(package_children().items()):
        source = module_file(package)
        if source is None or source.name != "__init__.py":
            problems.append(f"{package.replace('.', '/')}/ holds modules but no __init__.py; add one whose docstring "
                            "maps them")
            continue
        doc = ast.get_docstring(ast.parse(source.read_text(encoding="utf-8")), clean=False) or ""
        rows = set(re.findall(rf"^ +({re.escape(package)}\.\w+)(?: |$)", doc, re.MULTILINE))
        where = source.relative_to(ROOT)
        problems += [f"{where}: no row for {name}" for name in sorted(children - rows)]
        problems += [f"{where}: a row for {name}, which is no module" for name in sorted(rows - children)]
        problems += [f"{where}: names {path}, which is no file"
                     for path in re.findall(r"[\w/]+/\w+\.py\b", doc) if not (ROOT / path).is_file()]
    assert not problems, "package docstrings (their module maps):\n" + "\n".join(problems)


def test_no_test_module_imports_another():
    """What test modules share lives in tests/helpers.py, their shared fixtures in conftest.py: pytest imports a test
    module under its file's name (`test_grid`), so another module's `from tests.test_grid import ...` runs it a second
    time, as another module."""
    tests = {path.stem for path in (ROOT / "tests").glob("test_*.py")}
    found = sorted({f"{path.relative_to(ROOT)} imports {module}" for path in (ROOT / "tests").rglob("*.py")
                    for name in imported_names(path) if (module := name.removeprefix("tests.").split(".")[0]) in tests})
    assert not found, "test modules importing test modules (move what they share to tests/helpers.py):\n" + \
        "\n".join(found)


def test_the_run_directory_keeps_the_trainers_modules_derived_from_its_imports():
    """<run>/code keeps what train_gpt's imports reach: the kernel imported inside a function too, no tool above the
    trainer."""
    kept = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in trainer_sources()}
    reached, todo = set(), ["train_gpt"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(GRAPH[module] | {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)})
    assert kept == reached
    assert {"kernels.attention", "hooks", "gauge.updates", "run.checkpoint"} <= kept
    assert not {top(m) for m in kept} & {"eval", "grid", "bench", "sample", "export", "tests"}


def test_imported_names_reads_a_file_again_once_it_changed(tmp_path):
    """Parsed once per version of a file: an edit (another size or modification time) is seen by the next call."""
    source = tmp_path / "module.py"
    source.write_text("import fileio\n")
    assert imported_names(source) == {"fileio"}
    source.write_text("import fileio\n\ndef late():\n    from run import log\n")
    assert imported_names(source) == {"fileio", "run", "run.log"}


def test_imported_names_reads_the_dynamic_imports_with_a_literal_name(tmp_path):
    """importlib.import_module and __import__ with a literal name count as imports; a computed name cannot be read,
    and a relative name is refused as a relative import statement is."""
    source = tmp_path / "module.py"
    source.write_text("import importlib\nfrom importlib import import_module\n\n"
                      "def late(name):\n"
                      "    importlib.import_module('eval.report')\n    import_module('grid.plan')\n"
                      "    __import__('bench.e2e')\n    importlib.import_module(f'optim.{name}')\n")
    assert imported_names(source) == {"importlib", "importlib.import_module", "eval.report", "grid.plan", "bench.e2e"}
    source.write_text("import importlib\nimportlib.import_module('.log', 'run')\n")
    with pytest.raises(ValueError, match=r"module.py:2: a relative import; write it absolute"):
        imported_names(source)
