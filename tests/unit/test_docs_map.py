"""docs/architecture.md's map names every module: each ``.py`` module of ours appears,
as its backticked stem (`` `records` ``), in the part of the map that belongs to its
package (a heading, or a table row's first cell, that names the package's folder, e.g.
`` `common/` ``), and every module row of the map names a module that exists there.
Package ``__init__``/``__main__`` modules and protoc's generated ``keel_pb2*`` are not
listed."""

from __future__ import annotations

import re

from tests.conftest import REPO

PACKAGES = ("protos", "common", "orchestrator", "agent", "trainer", "benchmarks")
DOC = REPO / "docs" / "architecture.md"
NOT_LISTED = {"__init__", "__main__"}
# A line that starts a package's part: a heading or a table row whose first backticked
# names are folders (`common/`, `orchestrator/policy/`).
PART_START = re.compile(r"^(?:#{2,6}\s|\|\s*`[a-z_/]+/`)")
FOLDER = re.compile(r"`([a-z_]+(?:/[a-z_]+)*)/`")
NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


def map_section(text: str) -> str:
    """The text of the "## The map" section, up to the next second-level heading."""
    found = re.search(r"^## The map\n(.*?)(?=^## )", text, flags=re.MULTILINE | re.DOTALL)
    assert found, f"{DOC.relative_to(REPO)} has no '## The map' section"
    return found.group(1)


def parts(section: str) -> dict[str, str]:
    """Package folder ('common', 'orchestrator/policy') -> the text of its part of the
    map: from the line that names it (a heading, or a row's first cell) to the next
    line that starts a part."""
    found: dict[str, str] = {}
    folders: list[str] = []
    for line in section.splitlines():
        if PART_START.match(line):
            head = line.split("|")[1] if line.startswith("|") else line
            named = FOLDER.findall(head)
            if named or line.startswith("#"):
                folders = named
        for folder in folders:
            found[folder] = found.get(folder, "") + line + "\n"
    return found


def modules() -> dict[str, set[str]]:
    """Package folder -> the stems of the modules the map must name."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.stem in NOT_LISTED or path.stem.startswith("keel_pb2"):
                continue
            folder = str(path.parent.relative_to(REPO))
            found.setdefault(folder, set()).add(path.stem)
    return found


def missing(section: str) -> dict[str, list[str]]:
    """Package folder -> the modules its part of the map does not name."""
    named = {folder: set(NAME.findall(text)) for folder, text in parts(section).items()}
    gone = {folder: sorted(stems - named.get(folder, set())) for folder, stems in modules().items()}
    return {folder: stems for folder, stems in gone.items() if stems}


def rows(section: str) -> dict[str, list[str]]:
    """Package folder -> the first cells of its part's table rows that name one module
    (`` `stem` ``), the module rows."""
    found = {}
    for folder, text in parts(section).items():
        cells = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("|")]
        found[folder] = [cell[1:-1] for cell in cells if NAME.fullmatch(cell)]
    return found


def test_every_module_is_named_in_its_packages_part_of_the_map():
    gone = missing(map_section(DOC.read_text()))
    assert gone == {}, "not in docs/architecture.md's map: " + "; ".join(
        f"{folder}/: {', '.join(stems)}" for folder, stems in gone.items()
    )


def test_every_module_row_of_the_map_names_a_module_that_exists():
    present = modules()
    stale = {
        folder: [name for name in names if name not in present.get(folder, set())]
        for folder, names in rows(map_section(DOC.read_text())).items()
    }
    assert {folder: names for folder, names in stale.items() if names} == {}


def test_parts_are_read_from_headings_and_from_rows():
    section = (
        "intro `keys`\n"
        "### `common/`\n\n| module | its job |\n| --- | --- |\n| `keys` | the layout |\n"
        "### `agent/` and `agent/policy/`\n| `fencing` | self-fencing |\n"
        "| `trainer/` | `runtime/` (`identity`) and `train` |\n"
    )
    found = parts(section)
    assert sorted(found) == ["agent", "agent/policy", "common", "trainer"]
    assert "`keys`" in found["common"] and "`keys`" not in found["agent"]
    assert "`fencing`" in found["agent/policy"]
    assert "`train`" in found["trainer"] and "`keys`" not in found["trainer"]
    assert rows(section)["common"] == ["keys"]
    assert rows(section)["trainer"] == []
