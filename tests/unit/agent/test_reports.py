"""What the agent buffers of its ranks' reports and replays after every Hello."""

from agent.reports import Reports
from common.steps import MAX_BATCH_REPORTS
from protos import keel_pb2


def step(rank, number, seconds=0.1):
    return keel_pb2.StepReport(rank=rank, step=number, step_time_s=seconds, loss=1.0 / number)


def test_reports_of_the_running_generation_are_batched_and_others_dropped():
    reports = Reports()
    assert reports.add_steps(1, [step(0, 1)]) is None and reports.take_batch() is None
    reports.begin("j", 2)
    assert reports.add_steps(1, [step(0, 1)]) is None  # a straggler from generation 1
    reports.add_steps(2, [step(0, 1), step(1, 1)])
    reports.add_steps(2, [step(0, 2)])
    batch = reports.take_batch()
    assert (batch.job, batch.generation) == ("j", 2)
    assert [(s.step, list(s.ranks)) for s in batch.node_steps] == [(1, [0, 1]), (2, [0])]
    assert reports.take_batch() is None
    assert reports.last_steps() == {0: 2, 1: 1}
    reports.end()
    assert reports.add_steps(2, [step(0, 3)]) is None and reports.take_batch() is None


def test_a_checkpoint_request_is_passed_on_once_and_only_to_its_generation():
    reports = Reports()
    reports.begin("j", 2)
    assert reports.want_checkpoint(1, 0) is False
    assert reports.want_checkpoint(2, 7) is True
    assert reports.want_checkpoint(2, 5) is True  # the later request is the one kept
    assert reports.add_steps(2, [step(0, 1)]) == 7
    assert reports.add_steps(2, [step(0, 2)]) is None


def test_the_replay_holds_each_ranks_latest_step_the_exits_and_only_the_newest_commits():
    reports = Reports()
    reports.begin("j", 2)
    reports.add_steps(2, [step(1, 4), step(0, 4), step(0, 5)])
    reports.remember(keel_pb2.AgentMessage(checkpoint_saved=keel_pb2.CheckpointSaved(step=3)))
    reports.remember(keel_pb2.AgentMessage(rank_exited=keel_pb2.RankExited(rank=1)))
    reports.remember(keel_pb2.AgentMessage(checkpoint_saved=keel_pb2.CheckpointSaved(step=4)))
    memory = keel_pb2.AgentMessage(
        memory_snapshot_saved=keel_pb2.MemorySnapshotSaved(job="j", generation=2, step=5)
    )
    reports.remember(memory)
    reports.remember(
        keel_pb2.AgentMessage(
            memory_snapshot_saved=keel_pb2.MemorySnapshotSaved(job="j", generation=2, step=6)
        )
    )
    copied = [
        keel_pb2.AgentMessage(
            memory_snapshot_saved=keel_pb2.MemorySnapshotSaved(
                job="j", generation=2, step=step, replicated_to="b"
            )
        )
        for step in (4, 5)
    ]
    for message in copied:
        reports.remember(message)
    # A newer snapshot after its copy: it still goes first (the controller keeps a copy
    # with the snapshot it recorded).
    reports.remember(
        keel_pb2.AgentMessage(
            memory_snapshot_saved=keel_pb2.MemorySnapshotSaved(job="j", generation=2, step=7)
        )
    )
    latest, exited, commit, snapshot, copy = reports.replay()
    # The newest of each kind of commit: a durable one does not push a memory one out,
    # nor a copy's the snapshot's.
    assert snapshot.memory_snapshot_saved.step == 7
    assert copy.memory_snapshot_saved.step == 5
    assert copy.memory_snapshot_saved.replicated_to == "b"
    assert latest.steps.replayed
    assert [(list(s.ranks), s.step, s.loss) for s in latest.steps.node_steps] == [
        ([1], 4, 0.25),
        ([0], 5, 0.2),
    ]
    assert exited.rank_exited.rank == 1 and commit.checkpoint_saved.step == 4
    # A new generation starts from nothing.
    reports.begin("j", 3)
    assert reports.replay() == []


def test_a_backlog_goes_in_batches_the_controller_takes():
    """Reports queued while the stream was down go at most ``MAX_BATCH_REPORTS`` a
    batch, oldest first: the controller refuses a larger one."""
    reports = Reports()
    reports.begin("j", 2)
    backlog = [step(0, n) for n in range(1, MAX_BATCH_REPORTS + 11)]
    for start in range(0, len(backlog), 4096):
        reports.add_steps(2, backlog[start : start + 4096])
    first, second = reports.take_batch(), reports.take_batch()
    assert [s.step for s in first.node_steps] == list(range(1, MAX_BATCH_REPORTS + 1))
    assert [s.step for s in second.node_steps] == list(
        range(MAX_BATCH_REPORTS + 1, MAX_BATCH_REPORTS + 11)
    )
    assert reports.take_batch() is None
