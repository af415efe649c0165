"""deploy/: the Grafana dashboard and the Prometheus rules read only what
docs/metrics.md says the daemons export, every expression parses, every alert tells
the operator how bad it is and what to do, and the dashboard imports as it is."""

from __future__ import annotations

import json
import re

import promql_parser
import pytest
import yaml

from tests.conftest import REPO
from tests.promql import (
    dashboard_exprs,
    dashboard_panels,
    label_names,
    metric_names,
    rule_exprs,
    substitute_variables,
)

DASHBOARD = REPO / "deploy" / "grafana" / "keel.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
METRICS_DOC = REPO / "docs" / "metrics.md"
SEVERITIES = {"critical", "warning", "info"}
# A recording rule's name is level:metric:operations (Prometheus' naming practice).
RECORDED_NAME = re.compile(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+")
# Labels a query may read besides the documented ones: a histogram bucket's bound, and
# the target's address, which Prometheus adds. Not `job`: that is the scrape
# configuration's; Keel's job is `job_name`.
SCRAPE_LABELS = {"le", "instance"}
ANNOTATION_LABEL = re.compile(r"\$labels\.(\w+)")


def _contract_rows() -> list[dict[str, str]]:
    """The rows of docs/metrics.md's tables whose first column is `metric`, as column
    name -> cell."""
    rows = []
    header = None
    for line in METRICS_DOC.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif header[0] == "metric" and not set(cells[0]) <= set("-: "):
            rows.append(dict(zip(header, cells)))
    return rows


def contract() -> dict[str, str]:
    """metric name -> type, from the tables of docs/metrics.md whose first column is
    `metric`."""
    return {row["metric"].strip("`"): row["type"] for row in _contract_rows()}


def contract_labels() -> dict[str, set[str]]:
    """metric name -> its labels, from the same tables' `labels` column."""
    return {
        row["metric"].strip("`"): {
            label.strip() for label in row["labels"].split(",") if label.strip()
        }
        for row in _contract_rows()
    }


def documented_labels() -> set[str]:
    return set().union(*contract_labels().values())


def exported_names() -> set[str]:
    """The series names the contract's metrics appear under in Prometheus: a histogram
    as its _bucket, _sum and _count series."""
    names = set()
    for name, kind in contract().items():
        if kind == "histogram":
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return names


def rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def recorded() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


ALL_EXPRS = [
    pytest.param(expr, id=f"dashboard-{i}") for i, expr in enumerate(dashboard_exprs(DASHBOARD))
] + [pytest.param(expr, id=name) for name, expr in rule_exprs(RULES)]


def test_the_contract_is_read_from_the_tables():
    metrics = contract()
    assert metrics["keel_job_state"] == "gauge"
    assert metrics["keel_step_seconds"] == "histogram"
    assert metrics["keel_grpc_server_handled_total"] == "counter"
    assert "waiting" not in metrics  # the goodput causes' table is not a metric table
    assert len(metrics) > 40
    labels = contract_labels()
    assert labels["keel_job_state"] == {"job_name", "state"}
    assert labels["keel_controller_leader"] == set()
    assert "job" not in documented_labels()


@pytest.mark.parametrize("expr", ALL_EXPRS)
def test_every_expression_parses_returns_a_vector_and_reads_only_contract_metrics(expr):
    try:
        names = metric_names(expr)
    except ValueError as exc:
        pytest.fail(f"{expr!r} is not valid PromQL: {exc}")
    top = promql_parser.parse(expr)
    while isinstance(top, promql_parser.ParenExpr):
        top = top.expr
    assert not isinstance(
        top, (promql_parser.MatrixSelector, promql_parser.SubqueryExpr, promql_parser.StringLiteral)
    ), f"{expr!r}: a panel or a rule needs an instant vector or a number, not a range or a string"
    unknown = names - recorded() - exported_names()
    assert not unknown, (
        f"{sorted(unknown)} not in docs/metrics.md (a histogram is read as "
        f"NAME_bucket, _sum, _count) nor recorded in rules.yml: {expr}"
    )


@pytest.mark.parametrize("expr", ALL_EXPRS)
def test_every_expression_reads_only_documented_labels(expr):
    unknown = label_names(expr) - documented_labels() - SCRAPE_LABELS
    assert "job" not in unknown, (
        f"{expr!r} reads the label `job`, which is the scrape "
        f"configuration's: a Keel job's series carry `job_name`"
    )
    assert not unknown, (
        f"{expr!r} reads labels {sorted(unknown)} that docs/metrics.md does not name"
    )


def test_every_alert_annotation_names_documented_labels():
    for rule in rules():
        for key, text in rule.get("annotations", {}).items():
            unknown = set(ANNOTATION_LABEL.findall(text)) - documented_labels() - SCRAPE_LABELS
            assert not unknown, f"{rule['alert']}: annotations.{key} uses $labels.{sorted(unknown)}"


def test_every_contract_metric_is_on_the_dashboard_or_in_a_rule():
    used = set().union(
        *(metric_names(expr) for expr in dashboard_exprs(DASHBOARD)),
        *(metric_names(expr) for _, expr in rule_exprs(RULES)),
    )
    unused = {
        name
        for name, kind in contract().items()
        if not (
            {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
        )
        & used
    }
    assert not unused, f"docs/metrics.md exports {sorted(unused)}, which no panel or rule shows"


def test_every_alert_says_how_long_how_bad_and_what_to_do():
    alerts = [rule for rule in rules() if "alert" in rule]
    assert len(alerts) >= 9
    assert len({rule["alert"] for rule in alerts}) == len(alerts)
    for rule in alerts:
        name = rule["alert"]
        assert "for" in rule and promql_parser.parse_duration(rule["for"]).total_seconds() > 0, (
            f"{name}: give it a `for:` so that one bad scrape does not page"
        )
        assert rule.get("labels", {}).get("severity") in SEVERITIES, (
            f"{name}: labels.severity must be one of {sorted(SEVERITIES)}"
        )
        annotations = rule.get("annotations", {})
        for key in ("summary", "description"):
            assert annotations.get(key, "").strip(), f"{name}: annotations.{key} is missing"


def test_recording_rules_are_named_level_metric_operation_once():
    names = [rule["record"] for rule in rules() if "record" in rule]
    assert len(set(names)) == len(names)
    assert all(RECORDED_NAME.fullmatch(name) for name in names), names


def test_dashboard_imports_as_it_is():
    board = dashboard()
    assert board["schemaVersion"] >= 36
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert {"datasource", "job"} <= variables.keys(), "the dashboard needs $datasource and $job"
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    job = variables["job"]
    query = job["query"]["query"] if isinstance(job["query"], dict) else job["query"]
    assert (
        job["type"] == "query"
        and re.sub(r"\s", "", query) == "label_values(keel_job_state,job_name)"
    )
    for panel in dashboard_panels(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_panel_ids_are_unique():
    ids = [panel["id"] for panel in dashboard_panels(dashboard())]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"panel ids used twice: {duplicates}"


def test_dashboard_variables_read_contract_metrics():
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = (
            variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        )
        selector, label = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query).groups()
        assert metric_names(substitute_variables(selector)) <= exported_names(), query
        assert label in documented_labels(), query
        assert label_names(substitute_variables(selector)) <= documented_labels() | SCRAPE_LABELS, (
            query
        )


def test_metric_names_walks_every_selector():
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{job_name="x"}[5m])))'
        ' / on (job_name) group_left max_over_time(b[1h:1m]) + -{__name__="c"} offset 5m'
        " or absent(d) and topk(3, e)"
    )
    assert metric_names(expr) == {"a_bucket", "b", "c", "d", "e"}
    assert metric_names("1 + 2") == set()


def test_label_names_walks_matchers_groupings_and_vector_matching():
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{job_name="x", node!=""}[5m])))'
        " / on (job_name) group_left (cause) max without (phase) (max_over_time(b[1h:1m]) > 0)"
        ' or ignoring (instance) {__name__="c", kind=~"h.*"}'
    )
    assert label_names(expr) == {"le", "job_name", "node", "cause", "phase", "instance", "kind"}
    assert label_names("sum(a) / b") == set()


@pytest.mark.parametrize("expr", ["rate(a[5m]", "sum by (job (a)", "a{job=}", "$job"])
def test_metric_names_raises_on_what_does_not_parse(expr):
    with pytest.raises(ValueError):
        metric_names(expr)


def test_metric_names_refuses_names_it_cannot_check():
    with pytest.raises(ValueError, match="picks metrics by"):
        metric_names('{__name__=~"keel_.*"}')


def test_dashboard_variables_become_valid_promql():
    expr = substitute_variables(
        'rate(a{job="$job", node=~"${node:regex}"}[$__rate_interval]) '
        "+ increase(b[$__range]) * $__range_s"
    )
    assert expr == ('rate(a{job="placeholder", node=~"placeholder"}[5m]) + increase(b[1h]) * 3600')
    promql_parser.parse(expr)
