"""The agent and the controller may not import each other (DESIGN), so each has its own
copy of the etcd client; this keeps the two copies the same."""

import ast

from tests.conftest import REPO


def _code(path: str, package: str) -> str:
    """The module's code, docstring dropped and its own package's name neutralized."""
    tree = ast.parse((REPO / path).read_text().replace(f"from {package}.", "from PACKAGE."))
    tree.body = tree.body[1:]  # the docstring
    return ast.dump(tree)


def test_the_agent_and_controller_etcd_clients_are_the_same_code():
    assert _code("agent/etcd_client.py", "agent") == \
        _code("orchestrator/etcd_client.py", "orchestrator")
