"""The keepalives of an agent's stream to the controller, against the deadlines and the
pacing they must fit: a cut stream fails before its node counts as lost, and the
agents of a 4,000-node cluster send a step report before they would send a ping."""

from common import rpc
from common.deadlines import resolve
from orchestrator.policy import pacing


def option(options, name):
    return dict(options)[name] / 1000


def test_an_agents_cut_stream_fails_within_the_node_lost_grace():
    keepalive = option(rpc.AGENT_CHANNEL_OPTIONS, "grpc.keepalive_time_ms")
    timeout = option(rpc.AGENT_CHANNEL_OPTIONS, "grpc.keepalive_timeout_ms")
    assert keepalive + timeout < resolve().node_lost_grace_s
    # The controller's side of the same streams pings on the same quiet.
    assert option(rpc.SERVER_OPTIONS, "grpc.keepalive_time_ms") == keepalive


def test_at_4000_agents_a_step_report_comes_before_a_ping_would():
    interval = pacing.report_interval_s(4000, 1000.0, 0.0)
    assert 0 < interval < option(rpc.AGENT_CHANNEL_OPTIONS, "grpc.keepalive_time_ms")


def test_the_controller_takes_the_operators_more_frequent_pings():
    operators = option(rpc.CHANNEL_OPTIONS, "grpc.keepalive_time_ms")
    assert (
        option(rpc.SERVER_OPTIONS, "grpc.http2.min_recv_ping_interval_without_data_ms") <= operators
    )
