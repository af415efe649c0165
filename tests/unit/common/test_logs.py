"""common.logs: one structlog pipeline for our loggers and the stdlib's, JSON or console."""

import io
import json
import logging
import threading

import pytest
import structlog

from common import logs


@pytest.fixture
def logged(monkeypatch):
    """``configure`` onto a buffer; returns (configure, the lines written so far).
    structlog's and the root logger's state is put back afterwards."""
    monkeypatch.delenv("KEEL_LOG_FORMAT", raising=False)
    monkeypatch.delenv("KEEL_LOG_LEVEL", raising=False)
    stream = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level

    def configure(component, **kwargs):
        logs.configure(component, stream=stream, **kwargs)

    yield configure, lambda: stream.getvalue().splitlines()
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_timestamp_level_component_and_context_from_every_thread(logged):
    configure, lines = logged
    configure("agent", node="node-3")
    structlog.get_logger().info("rank started", job="demo", generation=2, rank=1, pid=42)
    worker = threading.Thread(target=structlog.get_logger().warning, args=("from a thread",))
    worker.start()
    worker.join()
    first, second = (json.loads(line) for line in lines())
    assert first["timestamp"].endswith("Z") and "T" in first["timestamp"]
    assert {k: v for k, v in first.items() if k != "timestamp"} == {
        "event": "rank started",
        "level": "info",
        "component": "agent",
        "node": "node-3",
        "job": "demo",
        "generation": 2,
        "rank": 1,
        "pid": 42,
    }
    assert (second["event"], second["level"], second["component"], second["node"]) == (
        "from a thread",
        "warning",
        "agent",
        "node-3",
    )


def test_the_stdlib_loggers_of_grpc_and_etcd3_come_out_through_the_same_pipeline(logged):
    configure, lines = logged
    configure("controller", job="demo")
    logging.getLogger("grpc._channel").warning("channel to %s is down", "10.0.0.7:7070")
    logging.getLogger("etcd3.client").info("reconnected")
    grpc_line, etcd_line = (json.loads(line) for line in lines())
    assert (grpc_line["event"], grpc_line["level"], grpc_line["logger"]) == (
        "channel to 10.0.0.7:7070 is down",
        "warning",
        "grpc._channel",
    )
    assert (grpc_line["component"], grpc_line["job"]) == ("controller", "demo")
    assert grpc_line["timestamp"].endswith("Z")
    assert (etcd_line["event"], etcd_line["level"]) == ("reconnected", "info")


def test_configuring_again_replaces_the_earlier_setup(logged):
    configure, lines = logged
    configure("agent")
    configure("trainer", rank=0)
    structlog.get_logger().info("step", step=1)
    logging.getLogger("grpc").warning("once")
    assert [json.loads(line)["component"] for line in lines()] == ["trainer", "trainer"]


def test_a_level_drops_what_is_below_it(logged):
    configure, lines = logged
    configure("agent", level="warning")
    log = structlog.get_logger()
    log.info("dropped")
    logging.getLogger("grpc").info("dropped too")
    log.warning("kept")
    logging.getLogger("grpc").error("kept too")
    assert [json.loads(line)["event"] for line in lines()] == ["kept", "kept too"]
    configure("agent", level="debug")
    log.debug("now shown")
    assert json.loads(lines()[-1])["event"] == "now shown"


def test_console_format_renders_text_for_a_person(logged):
    configure, lines = logged
    configure("agent", fmt="console", node="node-0")
    structlog.get_logger().info("rank started", rank=1)
    logging.getLogger("grpc").warning("channel down")
    ours, theirs = lines()
    with pytest.raises(json.JSONDecodeError):
        json.loads(ours)
    assert "rank started" in ours and "rank=1" in ours and "node=node-0" in ours
    assert "\x1b[" not in ours, "no colours when the stream is not a terminal"
    assert "channel down" in theirs and "warning" in theirs


def test_the_environment_is_the_default_and_a_flag_wins(logged, monkeypatch):
    configure, lines = logged
    monkeypatch.setenv("KEEL_LOG_FORMAT", "console")
    monkeypatch.setenv("KEEL_LOG_LEVEL", "error")
    assert logs.settings(tty=False) == ("console", "error")
    assert logs.settings("json", "info", tty=True) == ("json", "info")
    configure("agent", fmt="json")
    structlog.get_logger().warning("dropped by the level from the environment")
    structlog.get_logger().error("kept")
    assert [json.loads(line)["event"] for line in lines()] == ["kept"]
    monkeypatch.delenv("KEEL_LOG_FORMAT")
    monkeypatch.delenv("KEEL_LOG_LEVEL")
    assert logs.settings(tty=True) == ("console", "info")
    assert logs.settings(tty=False) == ("json", "info")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"fmt": "xml"},
            "log format 'xml': give --log-format (or KEEL_LOG_FORMAT) json or console",
        ),
        (
            {"level": "loud"},
            "log level 'loud': give --log-level (or KEEL_LOG_LEVEL) one of debug, "
            "info, warning, error",
        ),
    ],
)
def test_a_bad_format_or_level_is_refused_naming_the_choices(logged, kwargs, message):
    configure, _ = logged
    with pytest.raises(ValueError) as refused:
        configure("agent", **kwargs)
    assert str(refused.value) == message


def test_a_bad_value_in_the_environment_is_refused_too(logged, monkeypatch):
    monkeypatch.setenv("KEEL_LOG_FORMAT", "yaml")
    with pytest.raises(ValueError, match="KEEL_LOG_FORMAT"):
        logs.settings(tty=False)
