"""Every `keel` command line the README and docs/ show — in shell blocks and in inline
code — uses only commands and options the real click commands define (the same check
as the deploy recipes get, tests/unit/deploy/test_recipes.py)."""

from __future__ import annotations

import re

from tests.conftest import REPO
from tests.unit.deploy.test_recipes import (
    Invocation,
    _tokens,
    check_options,
    invocations_in_tokens,
    markdown_blocks,
    resolve,
    shell_invocations,
)

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def inline_invocations(text: str, where: str):
    """`keel ...` in inline code spans (which may wrap lines), outside shell blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    found = []
    for span in re.findall(r"`([^`]+)`", prose):
        line = " ".join(span.split())
        if re.match(r"([A-Z_]+=\S*\s+)*keel\s", line):  # a command, not a name
            found += invocations_in_tokens(_tokens(line), where)
    return found


def all_doc_invocations():
    """(invocation, complete): shell blocks hold whole command lines; inline code may
    only mention a command or an option."""
    found = []
    for path in DOCS:
        where, text = str(path.relative_to(REPO)), path.read_text()
        found += [
            (i, True)
            for block in markdown_blocks(text, ("bash", "sh"))  # unmarked: diagrams
            for i in shell_invocations(block, where)
        ]
        found += [(i, False) for i in inline_invocations(text, where)]
    return found


def test_the_extractor_reads_wrapped_inline_code():
    found = inline_invocations(
        "run `KEEL_X=1 keel run --nnodes 3\n   --nproc-per-node 8 t.py` "
        "and `keel logs J -f`, not `keel`'s own\n```\nkeel nope\n```\n",
        "here",
    )
    assert [i.words for i in found] == [
        ("run", "--nnodes", "3", "--nproc-per-node", "8", "t.py"),
        ("logs", "J", "-f"),
    ]


def test_every_command_line_in_the_docs_uses_only_real_options():
    found = all_doc_invocations()
    problems = [
        problem for invocation, complete in found for problem in check_options(invocation, complete)
    ]
    assert not problems, "\n".join(problems)
    names = {resolve(i.words)[2] for i, _ in found}
    assert {
        ("keel", "up"),
        ("keel", "run"),
        ("keel", "logs"),
        ("keel", "controller"),
        ("keel", "agent"),
        ("keel", "drain"),
        ("keel", "certs", "init"),
    } <= names, names


def test_what_follows_the_target_of_keel_run_or_a_double_dash_is_not_checked():
    assert check_options(Invocation("here", ("run", "--nnodes", "2", "t.py", "--mine"))) == []
    assert check_options(Invocation("here", ("up", "--steps", "4", "--", "--dim", "8"))) == []
    assert check_options(Invocation("here", ("run", "--mine", "t.py"))) == [
        "here: `keel run` has no option --mine"
    ]
    # A mention in prose need not be a whole command line.
    assert check_options(Invocation("here", ("plan", "--gpus")), complete=False) == []
    assert check_options(Invocation("here", ("plan", "--gpus"))) != []


def test_the_readmes_test_command_is_the_one_ci_runs():
    """The README's "Set up and run the tests" block is, word for word, a line `.ci/run`
    runs, and it lints and checks the formatting before the tests."""
    section = (REPO / "README.md").read_text().split("Set up and run the tests", 1)[1]
    command = markdown_blocks(section, ("bash",))[0].strip()
    assert command in (REPO / ".ci" / "run").read_text().splitlines()
    assert command.split(" && ")[-3:] == [
        ".venv/bin/ruff check .",
        ".venv/bin/ruff format --check .",
        ".venv/bin/python -m pytest",
    ]
