"""The preflight comparison, table by table: a node is slow when it is far below its
peers on most of the figures it was compared on."""

import pytest

from orchestrator.policy.preflight import slow_nodes

AR = "all_reduce"


@pytest.mark.parametrize(
    "figures, slow",
    [
        ({}, set()),
        ({"a": {(AR, 1): 1.0}}, set()),  # nobody to compare with
        ({"a": {(AR, 1): 10.0}, "b": {(AR, 1): 10.0}}, set()),
        # the median of two is their mean: 2 is below half of 6
        ({"a": {(AR, 1): 10.0}, "b": {(AR, 1): 2.0}}, {"b"}),
        # exactly half of the median is not below it
        ({"a": {(AR, 1): 10.0}, "b": {(AR, 1): 10.0}, "c": {(AR, 1): 5.0}}, set()),
        # one noisy figure of four is not most of them; three of four are
        (
            {"a": {(AR, i): 10.0 for i in range(4)}, "b": {(AR, 0): 1, (AR, 1): 9, (AR, 2): 10}},
            set(),
        ),
        (
            {"a": {(AR, i): 10.0 for i in range(4)}, "b": {(AR, i): 1.0 for i in range(3)}},
            {"b"},
        ),
        # a figure only one node has is compared with nothing
        ({"a": {(AR, 1): 10.0, (AR, 2): 10.0}, "b": {(AR, 2): 10.0, (AR, 9): 0.1}}, set()),
    ],
)
def test_a_node_far_below_its_peers_on_most_figures_is_slow(figures, slow):
    assert slow_nodes(figures) == slow
