"""One meaning per name (README.md#layout), read from the source of every module of the repository but the tests
(tests.helpers.repository_modules). Three kinds of clash fail:

(a) a top-level function or class defined in more than one module (one meaning: one definition, called; two
    meanings: two names that say what each is);
(b) a name that a file's import binds to a module or package of the project (`import config`, `from eval import
    report`, `import kernels.attention_paths as paths`) bound again in that file: a function's parameter, a local
    (assigned, a loop, `with` or `except` target, an inner function or class) or a top-level definition or
    assignment (`def parse(config)` in a file that does `import config`);
(c) a top-level function or class named, letter case aside, like a module that a reader finds beside it: a
    top-level module or package of the project (`class Run` beside the package `run`) or a module of its own package
    (`def report` in eval.structure beside eval.report). A module named for what it defines holds that one thing
    (`sample.sample`, `optim.ecd.ECD`): the name of its own module is allowed.

A class's own names, its methods and attributes, are not read: they are named through its objects
(`page.take_outputs`, `run.config`). A finding passes only where the allowlist below names it, with the reason; an
entry that matches no finding fails too, so that the list only shrinks.
"""
from __future__ import annotations

import ast
from collections import defaultdict

from run.directory import module_file
from tests.helpers import repository_modules

MODULES = repository_modules()
TREES = {module: ast.parse(module_file(module).read_text(encoding="utf-8")) for module in MODULES}


def commands() -> set[str]:
    """The modules that run as a command: `python -m MODULE` reaches their `if __name__ == "__main__":`."""
    def is_main_guard(node: ast.stmt) -> bool:
        return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")
    return {m for m, tree in TREES.items() if m.endswith("__main__") or any(map(is_main_guard, tree.body))}


# (a): one role under one name in parallel modules, each module's own: {name: the modules that may define it}.
PARALLEL_ROLES = {
    "main": commands(),  # each command's entry point, run by its `if __name__ == "__main__":` (python -m MODULE)
    # each evaluation's Markdown page (<out>/NAME.md), written by its own main:
    "markdown_summary": {"eval.alignment", "eval.gauge", "eval.logic_puzzles", "eval.structure"},
    # one class, two texts: modeling_symgpt.py is written beside exported weights and loads without this repository,
    # so it cannot import train_gpt's; tests/test_export.py keeps the two texts equal
    "FeaturePReLU": {"train_gpt", "modeling_symgpt"},
}


def top_level_definitions(body: list[ast.stmt]) -> list[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]:
    """The functions and classes a module body defines, also under a top-level `if` or `try`."""
    found = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append(node)
        elif isinstance(node, (ast.If, ast.Try)):
            found += top_level_definitions(node.body + node.orelse + getattr(node, "finalbody", []))
    return found


def definitions() -> dict[str, set[str]]:
    """{name: the modules that define a top-level function or class of that name}."""
    where: dict[str, set[str]] = defaultdict(set)
    for module, tree in TREES.items():
        for node in top_level_definitions(tree.body):
            where[node.name].add(module)
    return where


def defined_in_several_modules() -> dict[str, str]:
    """(a): {finding: what it is} for each name defined in more than one module, unless a parallel role."""
    return {f"(a) {name}": f"{name} is defined in {', '.join(sorted(modules))}" for name, modules in
            definitions().items() if len(modules) > 1 and not modules <= PARALLEL_ROLES.get(name, set())}


def module_bindings(tree: ast.Module) -> dict[str, str]:
    """{name: project module} for every name the file's imports (anywhere in it) bind to a module or package of the
    project."""
    tops = {m.split(".")[0] for m in MODULES}
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]  # `import a.b` binds a, `import a.b as c` binds c to a.b
                if top in tops:
                    bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def other_bindings(tree: ast.Module) -> list[tuple[str, int, str]]:
    """(name, line, kind) for every binding of a name in the file that is no import: parameters, assignment, loop,
    `with` and `except` targets, inner and top-level functions and classes, top-level assignments. A class's own
    names (its attributes and methods) are read through its objects and left out."""
    attributes = set()  # the nodes that bind a class's own names
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for statement in cls.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                attributes.add(id(statement))
            elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                attributes.update(id(node) for target in targets for node in ast.walk(target))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            found += [(a.arg, node.lineno, "parameter") for a in [*arguments.posonlyargs, *arguments.args,
                                                                   *arguments.kwonlyargs, arguments.vararg,
                                                                   arguments.kwarg] if a is not None]
        if id(node) in attributes:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.name, node.lineno, "definition"))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.append((node.id, node.lineno, "local"))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            found.append((node.name, node.lineno, "local"))
    return found


def modules_rebound() -> dict[str, str]:
    """(b): {finding: where} for each file that binds a name to a project module and binds it again otherwise."""
    findings = {}
    for module, tree in TREES.items():
        bound = module_bindings(tree)
        clashes: dict[str, list[str]] = defaultdict(list)
        for name, line, kind in other_bindings(tree):
            if name in bound:
                clashes[name].append(f"{kind} at line {line}")
        for name, places in clashes.items():
            findings[f"(b) {module}: {name}"] = (f"{module} imports the module {bound[name]} as `{name}` and binds "
                                                 f"`{name}` again: {', '.join(sorted(set(places)))}")
    return findings


def named_like_a_module() -> dict[str, str]:
    """(c): {finding: why} for each top-level function or class named like a top-level module or package, or like
    a module of its own package, other than its own module."""
    siblings: dict[str, set[str]] = defaultdict(set)  # package ("" at the top): the names of its modules
    for module in MODULES:
        parts = module.split(".")
        siblings[".".join(parts[:-1])].add(parts[-1])
    findings = {}
    for module, tree in TREES.items():
        parts = module.split(".")
        own, package = parts[-1], ".".join(parts[:-1])
        beside = {f"{package}.{name}" if package else name for name in siblings[package]}
        beside |= siblings[""]
        for node in top_level_definitions(tree.body):
            clash = sorted(m for m in beside if m.split(".")[-1] == node.name.lower() and m.split(".")[-1] != own)
            if clash:
                findings[f"(c) {module}.{node.name}"] = f"{module}.{node.name} is named like the module {clash[0]}"
    return findings


def test_each_name_has_one_meaning():
    findings = {**defined_in_several_modules(), **modules_rebound(), **named_like_a_module()}
    unexplained = [f"{key}: {why}" for key, why in sorted(findings.items())]
    assert not unexplained, ("names with two meanings (one definition if they mean the same, else names that say "
                             "what each is; see this file's docstring):\n" + "\n".join(unexplained))


def test_each_parallel_role_is_defined_where_its_allowlist_says():
    """An allowed name no module defines any more, or defined in one module only, is no parallel role: delete it."""
    defined = definitions()
    single = {name: sorted(defined[name]) for name in PARALLEL_ROLES if len(defined[name]) < 2}
    assert not single, f"PARALLEL_ROLES entries that name no role shared by several modules: {single}"
