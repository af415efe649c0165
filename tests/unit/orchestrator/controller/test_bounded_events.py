"""A job's events stay within a count and a byte bound, in memory and in etcd."""

import pytest

from orchestrator.controller import job_health
from orchestrator.controller.job_health import JobHealth
from orchestrator.policy.event_kind import EventKind
from orchestrator.policy.lifecycle import JobState, past_retention
from orchestrator.policy.retention import EVENT_TEXT_BYTES, cut_text
from orchestrator.spec.health import resolve
from protos import keel_pb2


def health() -> JobHealth:
    return JobHealth("j", resolve(keel_pb2.HealthSpec()))


def test_the_oldest_events_go_past_the_count_bound(monkeypatch):
    monkeypatch.setattr(job_health, "MAX_EVENTS", 5)
    h = health()
    for i in range(8):
        h.event(EventKind.ALERT, f"number {i}")
    assert [e.seq for e in h.events] == [4, 5, 6, 7, 8]
    # Each dropped one is deleted from etcd next; the unsaved ones are just the kept.
    assert h.dropped == [1, 2, 3] and sorted(h.unsaved) == [4, 5, 6, 7, 8]


def test_the_oldest_events_go_past_the_byte_bound(monkeypatch):
    monkeypatch.setattr(job_health, "MAX_EVENT_BYTES", 10_000)
    h = health()
    for _ in range(10):
        h.event(EventKind.ALERT, "x" * 3000)
    kept = sum(e.ByteSize() for e in h.events)
    assert len(h.events) == 3 and kept <= 10_000
    assert h.dropped == list(range(1, 8))
    # An event that grows (a hang's stacks arriving) pushes older ones out too.
    hang = h.event(EventKind.HANG, "rank 1 hung")
    hang.stacks[0] = "y" * 6000
    h.changed(hang)
    assert [e.kind for e in h.events] == [keel_pb2.EVENT_KIND_ALERT, keel_pb2.EVENT_KIND_HANG]
    # Even an event past the bound by itself is kept: the newest always is.
    hang.stacks[1] = "z" * 20_000
    h.changed(hang)
    assert [e.seq for e in h.events] == [hang.seq]


def test_restored_events_past_the_bounds_are_dropped_from_etcd_too(monkeypatch):
    monkeypatch.setattr(job_health, "MAX_EVENTS", 100)
    saved = [
        keel_pb2.Event(kind=keel_pb2.EVENT_KIND_ALERT, reason="r", seq=i) for i in range(1, 10_001)
    ]
    h = health()
    h.restore(saved)
    assert [e.seq for e in h.events] == list(range(9901, 10_001))
    assert h.dropped == list(range(1, 9901)) and h.unsaved == {}
    assert h.event(EventKind.ALERT, "next").seq == 10_001


def test_an_ended_job_is_kept_for_its_retention_then_deleted():
    ended = 1_000.0
    assert not past_retention(JobState.SUCCEEDED, ended, ended + 59, 60)
    assert past_retention(JobState.FAILED, ended, ended + 60, 60)
    assert not past_retention(JobState.RUNNING, ended, ended + 600, 60)
    # 0 keeps ended jobs until an operator deletes them.
    assert not past_retention(JobState.CANCELLED, ended, ended + 10**9, 0)


def test_a_reason_of_megabytes_is_cut_not_the_history():
    """An agent-supplied reason of 5 MB: before, it filled the byte bound alone and
    evicted every older event, then failed to save in etcd (past its 1.5 MiB request
    limit) every tick. Cut to ``EVENT_TEXT_BYTES``, the history stays."""
    h = health()
    for i in range(20):
        h.event(EventKind.ALERT, f"number {i}")
    huge = h.event(EventKind.CRASH, "é" + "x" * (5 << 20), root_cause="y" * (1 << 20))
    assert len(h.events) == 21 and h.dropped == []
    for text in (huge.reason, huge.root_cause):
        assert len(text.encode()) <= EVENT_TEXT_BYTES
        assert text.endswith(" more bytes cut]")
    assert huge.reason.startswith("éxxx")
    assert h.unsaved[huge.seq].ByteSize() < 3 * EVENT_TEXT_BYTES


@pytest.mark.parametrize(
    "text, limit, expected",
    [
        ("short", 100, "short"),
        ("a" * 100, 100, "a" * 100),  # exactly the limit: whole
        ("a" * 101, 100, "a" * 36 + "... [65 more bytes cut]"),
        ("é" * 60, 100, "é" * 18 + "... [84 more bytes cut]"),  # cut at a character
    ],
)
def test_a_text_past_its_limit_is_cut_at_a_character_saying_how_much(text, limit, expected):
    assert cut_text(text, limit) == expected
    assert len(cut_text(text, limit).encode()) <= limit
