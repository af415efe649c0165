"""The PromQL in deploy/: every expression of a Grafana dashboard or a Prometheus rule
file, and the metric names an expression reads, from promql_parser's AST."""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import yaml

# Grafana's global variables, by what a valid query may put in their place: the
# interval ones stand where PromQL wants a duration, the numeric ones a number.
GRAFANA_GLOBALS = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "__interval_ms": "60000",
    "__range_ms": "3600000",
    "__range_s": "3600",
}
# $name, ${name}, ${name:format} and [[name]], the forms Grafana substitutes.
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
PLACEHOLDER = "placeholder"  # a dashboard variable's value: an identifier, valid in a label value


def metric_names(expr: str) -> set[str]:
    """The metric names that ``expr`` selects, in a vector or range selector, by name or
    as ``{__name__="..."}``. Raises ValueError if ``expr`` does not parse, or if a
    selector picks its metrics by a regular expression or a negative matcher (which no
    list of names can be checked against)."""
    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.update(_selector_names(node, expr))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def label_names(expr: str) -> set[str]:
    """The label names that ``expr`` reads: in its selectors' matchers (``__name__``
    aside), its aggregations' ``by``/``without``, and its binary operators'
    ``on``/``ignoring`` and ``group_left``/``group_right``. Raises ValueError if ``expr``
    does not parse."""
    labels: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            for group in [node.matchers.matchers, *node.matchers.or_matchers]:
                labels.update(matcher.name for matcher in group if matcher.name != "__name__")
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                labels.update(node.modifier.matching.labels)
            labels.update(node.modifier.group_labels or ())

    promql_parser.walk(promql_parser.parse(expr), visit)
    return labels


def _selector_names(selector, expr: str) -> set[str]:
    if selector.name:
        return {selector.name}
    groups = [selector.matchers.matchers, *selector.matchers.or_matchers]
    found = set()
    for group in groups:
        for matcher in group:
            if matcher.name != "__name__":
                continue
            if matcher.op != promql_parser.MatchOp.Equal:
                raise ValueError(
                    f"{expr!r}: selector {selector} picks metrics by "
                    f'{matcher}; name them with __name__="..."'
                )
            found.add(matcher.value)
    return found


def substitute_variables(expr: str) -> str:
    """``expr`` with Grafana's variables replaced by valid PromQL: its interval and range
    globals by durations (numbers for the _ms and _s forms), any other variable by
    ``placeholder``."""

    def replace(match: re.Match) -> str:
        name = next(group for group in match.groups() if group is not None)
        return GRAFANA_GLOBALS.get(name, PLACEHOLDER)

    return VARIABLE.sub(replace, expr)


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel of ``dashboard``, rows included, and the panels that collapsed rows
    hold."""
    panels = []
    for panel in dashboard.get("panels", []):
        panels.append(panel)
        panels.extend(dashboard_panels(panel))
    return panels


def dashboard_exprs(path: Path | str) -> list[str]:
    """Every PromQL expression of the Grafana dashboard at ``path`` (its panels' targets,
    nested rows' panels included, and its annotation queries), with Grafana's variables
    substituted (``substitute_variables``)."""
    dashboard = json.loads(Path(path).read_text())
    exprs = [
        target["expr"]
        for panel in dashboard_panels(dashboard)
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    exprs += [
        annotation["expr"]
        for annotation in dashboard.get("annotations", {}).get("list", [])
        if "expr" in annotation
    ]
    return [substitute_variables(expr) for expr in exprs]


def rule_exprs(path: Path | str) -> list[tuple[str, str]]:
    """(name, expression) for every rule of the Prometheus rule file at ``path``: a
    recording rule by the series it records, an alerting rule by its alert name."""
    groups = yaml.safe_load(Path(path).read_text())["groups"]
    return [
        (rule.get("record") or rule["alert"], rule["expr"])
        for group in groups
        for rule in group["rules"]
    ]
