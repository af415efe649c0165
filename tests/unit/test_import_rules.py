"""The package rules of DESIGN.md, checked on every import statement (those inside
functions too): agent and orchestrator never import each other; common imports only
protos and third-party libraries; protos imports nothing of ours; the trainer knows
nothing of agent or orchestrator, and reaches common only through trainer.runtime."""

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
