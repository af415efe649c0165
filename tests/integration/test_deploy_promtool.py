"""deploy/prometheus as Prometheus itself reads it: promtool checks the rule file and
runs its unit tests (rules_test.yml: the alerts fire, and stay quiet, on scripted
series; recording rules give the expected values), and Prometheus' own parser reads
every query of the Grafana dashboard."""

from __future__ import annotations

import subprocess

import yaml

from tests.conftest import REPO
from tests.promql import dashboard_exprs

RULES = REPO / "deploy" / "prometheus" / "rules.yml"
RULES_TEST = REPO / "deploy" / "prometheus" / "rules_test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "keel.json"


def promtool_run(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_promtool_accepts_the_rules(promtool):
    run = promtool_run(promtool, "check", "rules", str(RULES))
    assert run.returncode == 0, f"promtool check rules failed:\n{run.stdout}{run.stderr}"
    assert "SUCCESS" in run.stdout


def test_rules_pass_their_unit_tests(promtool):
    run = promtool_run(promtool, "test", "rules", str(RULES_TEST))
    assert run.returncode == 0, f"promtool test rules failed:\n{run.stdout}{run.stderr}"
    assert "SUCCESS" in run.stdout


def test_prometheus_parses_every_dashboard_query(promtool, tmp_path):
    """promql_parser follows a later Prometheus than the one deployed: each panel's
    query, written as a recording rule, goes through promtool's parser too."""
    rules = [
        {"record": f"dashboard:query:{i}", "expr": expr}
        for i, expr in enumerate(dashboard_exprs(DASHBOARD))
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = promtool_run(promtool, "check", "rules", str(path))
    assert run.returncode == 0, (
        f"Prometheus does not parse a dashboard query:\n{run.stdout}{run.stderr}"
    )
