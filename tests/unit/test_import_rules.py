"""The package rules of DESIGN.md, checked on every import statement (those inside
functions too): agent and orchestrator never import each other; common imports only
protos and third-party libraries; protos imports nothing of ours; the trainer knows
nothing of agent or orchestrator, and reaches common only through trainer.runtime.
And no module of ours imports itself through others: the module graph has no cycle."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

OURS = {"agent", "orchestrator", "trainer", "common", "protos", "benchmarks", "tests"}
# package -> the packages of ours it may import (itself always)
ALLOWED = {
    "protos": set(),
    "common": {"protos"},
    "agent": {"common", "protos"},
    "orchestrator": {"common", "protos"},
    "trainer": {"common", "protos"},
}


def imports(path) -> set[str]:
    """The top-level packages of ours that the module at ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & OURS
    return found


def modules(package: str):
    return sorted(p for p in (REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_what_it_may(package):
    wrong = {
        str(path.relative_to(REPO)): sorted(imports(path) - ALLOWED[package] - {package})
        for path in modules(package)
    }
    assert {path: found for path, found in wrong.items() if found} == {}


def test_only_the_trainer_runtime_imports_common():
    runtime = REPO / "trainer" / "runtime"
    reaching = [
        str(path.relative_to(REPO))
        for path in modules("trainer")
        if "common" in imports(path) and runtime not in path.parents
    ]
    assert reaching == []


def test_the_rule_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from orchestrator.controller import daemon\n")
    assert imports(module) == {"orchestrator"}


def module_name(path, root=REPO) -> str:
    """The dotted name of the module at ``path`` under ``root``; a package's
    ``__init__`` is the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path, known: set[str], root=REPO) -> set[str]:
    """The modules of ours, among ``known``, that the module at ``path`` imports: every
    import statement, those inside functions and under ``TYPE_CHECKING`` too (either
    would hide a cycle that a later refactor turns into an import-time failure).
    ``from a.b import c`` is module ``a.b.c`` when that is a module, else ``a.b``."""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            base = ".".join(part for part in (base, node.module or "") if part)
            names = [f"{base}.{alias.name}" for alias in node.names]
            names = [name if name in known else base for name in names]
        else:
            continue
        for name in names:
            # A name that is no module of ours (an attribute, a third-party module):
            # its longest prefix that is one, if any.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    found.discard(module_name(path, root))
    return found


def import_graph(paths, root=REPO) -> dict[str, set[str]]:
    """Module name -> the modules of ours it imports, over the files ``paths`` under
    ``root``."""
    named = {module_name(path, root): path for path in paths}
    return {name: imported_modules(path, set(named), root) for name, path in named.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module, each
    sorted (Tarjan's algorithm, iterative so that deep chains do not hit the recursion
    limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def test_no_module_of_ours_imports_itself_through_others():
    graph = import_graph(path for package in sorted(OURS) for path in modules(package))
    found = cycles(graph)
    described = [
        f"cycle of {len(component)} modules:\n"
        + "\n".join(
            f"  {name} -> {', '.join(sorted(graph[name] & set(component)))}" for name in component
        )
        for component in found
    ]
    assert not found, "\n".join(described)


def test_the_cycle_rule_resolves_names_and_sees_every_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import thing\n")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
    )
    (package / "c.py").write_text("import pkg.a.thing\nimport os\n")
    (package / "d.py").write_text("from pkg import a\n")
    graph = import_graph(sorted(package.glob("*.py")), tmp_path)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
        "pkg.d": {"pkg.a"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert cycles({"x": {"y"}, "y": set()}) == []
