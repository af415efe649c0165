"""Fault injection in ``trainer.runtime``: which scheduled faults a rank applies, when,
and that crash/kill/hang fire once per checkpoint directory across generations. Runs
in-process: crash raises, and kill/hang are exercised only where their marker already
exists, so they must not fire. Also the runtime's side of the agent channel, against
the agent's real AgentLocal service on a Unix socket: phases, checkpoint requests in
the acks, preflight reports."""

import os
import threading
import time
from dataclasses import dataclass

import pytest
from google.protobuf import json_format

from protos import keel_pb2
from tests.conftest import AgentRecorder, local_agent, wait_for
from trainer import runtime
from trainer.runtime import (
    claim_fault,
    fault_marker_path,
    parse_fault_schedule,
    parse_mesh,
    rank_faults,
    reporting,
)
from trainer.runtime.faults import FaultInjector


def schedule_json(*faults: keel_pb2.Fault) -> str:
    return json_format.MessageToJson(keel_pb2.FaultSchedule(faults=faults))


def rank_env(rank: int, faults: str, checkpoint_dir=None, generation: int = 1) -> dict:
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "KEEL_GENERATION": str(generation),
        "KEEL_JOB": "demo",
        "KEEL_FAULTS": faults,
    }
    if checkpoint_dir is not None:
        env["KEEL_CHECKPOINT_DIR"] = str(checkpoint_dir)
    return env


def test_rank_faults_keeps_only_this_ranks_rank_faults_with_their_schedule_index():
    schedule = parse_fault_schedule(
        schedule_json(
            keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_LOSE_NODE, node=0, step=3),
            keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_CRASH, rank=1, step=7),
            keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_CRASH, rank=0, step=7),
            keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_SLOW, rank=1, step=2, factor=3.0),
            keel_pb2.Fault(
                kind=keel_pb2.FAULT_KIND_HANG, step=4
            ),  # no rank: not for any rank to apply
            keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_KILL, rank=1, step=9),
        )
    )
    selected = rank_faults(schedule, 1)
    assert [(index, fault.kind, fault.step) for index, fault in selected] == [
        (1, keel_pb2.FAULT_KIND_CRASH, 7),
        (3, keel_pb2.FAULT_KIND_SLOW, 2),
        (5, keel_pb2.FAULT_KIND_KILL, 9),
    ]
    assert [index for index, _ in rank_faults(schedule, 0)] == [2]


def test_a_crash_of_a_node_is_every_rank_on_it_and_fires_in_every_generation(tmp_path):
    schedule = parse_fault_schedule(
        schedule_json(
            keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_CRASH, node=1, step=2),
            keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_KILL, node=1, step=2),  # not by node
        )
    )
    assert [i for i, _ in rank_faults(schedule, 0, "node-1")] == [0]
    assert [i for i, _ in rank_faults(schedule, 3, "node-1")] == [0]
    assert rank_faults(schedule, 0, "node-0") == [] and rank_faults(schedule, 0) == []
    for generation in (1, 2, 3):
        injector = FaultInjector(schedule, 0, generation, lambda _: None, node="node-1")
        injector.inject(1, str(tmp_path))
        with pytest.raises(RuntimeError, match="injected crash at step 2 on rank 0"):
            injector.inject(2, str(tmp_path))


def test_rank_zero_is_a_rank_not_a_missing_field():
    schedule = parse_fault_schedule(
        schedule_json(keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_CRASH, rank=0, step=1))
    )
    assert len(rank_faults(schedule, 0)) == 1


def test_slow_needs_a_factor_of_at_least_one():
    with pytest.raises(ValueError, match="factor of at least 1|multiplier of at least 1"):
        parse_fault_schedule(
            schedule_json(keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_SLOW, rank=0, step=1))
        )


def test_no_schedule_means_no_faults():
    rt = runtime.init({"RANK": "0", "WORLD_SIZE": "1"})
    for step in range(1, 5):
        rt.inject_faults(step)
    assert rt.after_step(0.01) == 0.0


def test_crash_fires_at_its_step_on_its_rank_only(tmp_path):
    faults = schedule_json(keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_CRASH, rank=1, step=3))
    other = runtime.init(rank_env(0, faults, tmp_path))
    target = runtime.init(rank_env(1, faults, tmp_path))
    for step in (1, 2, 3, 4):
        other.inject_faults(step)
    target.inject_faults(2)
    with pytest.raises(RuntimeError, match=r"^injected crash at step 3 on rank 1$"):
        target.inject_faults(3)


def test_crash_is_one_shot_across_generations(tmp_path):
    faults = schedule_json(
        keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_LOSE_NODE, node=1, step=1),
        keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_CRASH, rank=0, step=2),
    )
    first = runtime.init(rank_env(0, faults, tmp_path, generation=1))
    with pytest.raises(RuntimeError):
        first.inject_faults(2)
    marker = fault_marker_path(str(tmp_path), 1)
    assert marker == os.path.join(str(tmp_path), ".faults", "1")
    assert "crash step=2 rank=0 generation=1" in open(marker).read()
    # The next generation replays step 2 from an earlier checkpoint; the crash is spent.
    runtime.init(rank_env(0, faults, tmp_path, generation=2)).inject_faults(2)


def test_without_a_checkpoint_dir_a_crash_fires_every_time():
    faults = schedule_json(keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_CRASH, rank=0, step=1))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected crash at step 1 on rank 0"):
            runtime.init(rank_env(0, faults)).inject_faults(1)


@pytest.mark.parametrize("kind", [keel_pb2.FAULT_KIND_KILL, keel_pb2.FAULT_KIND_HANG])
def test_spent_kill_and_hang_do_not_fire_again(tmp_path, kind):
    faults = schedule_json(keel_pb2.Fault(kind=kind, rank=1, step=5))
    assert claim_fault(str(tmp_path), 0, "an earlier generation fired it")
    # Were the marker ignored, this would kill the test process or hang it.
    runtime.init(rank_env(1, faults, tmp_path)).inject_faults(5)


def test_claim_fault_is_exclusive_per_directory(tmp_path):
    assert claim_fault(str(tmp_path / "ckpt"), 4, "first")
    assert not claim_fault(str(tmp_path / "ckpt"), 4, "second")
    assert claim_fault(str(tmp_path / "ckpt"), 5, "another fault")
    assert claim_fault(str(tmp_path / "other-job"), 4, "another job")
    assert claim_fault(None, 4, "no directory")
    assert claim_fault(None, 4, "no directory")


def test_slow_stretches_every_step_from_its_step_on(tmp_path):
    rt = runtime.init(
        rank_env(
            1,
            schedule_json(
                keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_SLOW, rank=1, step=3, factor=3.0)
            ),
            tmp_path,
        )
    )
    rt.inject_faults(2)
    assert rt.after_step(0.02) == 0.0
    rt.inject_faults(3)
    for _ in range(2):
        started = time.monotonic()
        slept = rt.after_step(0.02)
        assert slept == pytest.approx(0.04)
        assert time.monotonic() - started >= 0.04
    # slow is not one-shot: nothing is claimed for it.
    assert not os.path.exists(tmp_path / ".faults")


def test_init_reads_the_environment(tmp_path):
    rt = runtime.init(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "TORCHELASTIC_RESTART_COUNT": "2",
            "KEEL_JOB": "llama",
            "KEEL_GENERATION": "7",
            "KEEL_MESH": "dp_shard=4",
            "KEEL_CHECKPOINT_DIR": str(tmp_path),
            "KEEL_RESTORE_FROM": str(tmp_path / "step_00000010"),
        }
    )
    assert (rt.rank, rt.world_size, rt.local_rank, rt.restart_count) == (3, 4, 1, 2)
    assert (rt.job, rt.generation, rt.mesh) == ("llama", 7, {"dp_shard": 4})
    assert (rt.checkpoint_dir, rt.restore_from) == (str(tmp_path), str(tmp_path / "step_00000010"))
    plain = runtime.init({"KEEL_RESTORE_FROM": ""})
    assert (plain.rank, plain.world_size, plain.generation, plain.job, plain.mesh) == (
        0,
        1,
        0,
        "",
        {"dp_shard": 1},
    )
    assert plain.checkpoint_dir is None and plain.restore_from is None


def test_parse_mesh_checks_the_world_size():
    assert parse_mesh("dp_replicate=2, dp_shard=2", 4) == {"dp_replicate": 2, "dp_shard": 2}
    with pytest.raises(ValueError, match="spans 4 ranks but WORLD_SIZE=2"):
        parse_mesh("dp_shard=4", 2)
    with pytest.raises(ValueError, match="not NAME=SIZE"):
        parse_mesh("fsdp=2", 2)


def test_a_missing_agent_never_fails_training(tmp_path, capsys):
    rt = runtime.init(
        {"RANK": "0", "WORLD_SIZE": "1", "KEEL_AGENT_SOCKET": str(tmp_path / "nobody.sock")}
    )
    for step in range(1, 40):
        rt.report_step(step, loss=1.0, tokens=64, step_time_s=0.01)
    assert rt.report_checkpoint(10, str(tmp_path / "step_00000010"), 160) is False
    rt.close()
    rt.close()
    err = capsys.readouterr().err
    assert err.count("cannot report steps to the agent") == 1
    assert "cannot report checkpoint step=10" in err


class StuckAgent(AgentRecorder):
    """An agent whose ReportSteps handler does not return until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = 0

    def on_steps(self, generation: int, reports: list) -> int | None:
        with self.lock:
            self.entered += 1
        self.release.wait(60)
        return super().on_steps(generation, reports)


def test_reporting_does_not_wait_for_the_agent():
    stuck = StuckAgent()
    with local_agent(stuck) as socket_path:
        rt = runtime.init(agent_env(socket_path, stuck))
        try:
            # A flagged report goes out at once: the reporter's call is now held by the agent.
            rt.report_step(1, loss=2.5, tokens=512, step_time_s=0.5, checkpointing=True)
            wait_for(lambda: stuck.entered, 10, what="the agent to receive the first report")

            def train() -> None:
                for step in range(2, 202):
                    rt.report_step(step, loss=2.5, tokens=512, step_time_s=0.5)

            trainer = threading.Thread(target=train, daemon=True)
            trainer.start()
            # Were report_step a call to the agent, each would wait out its deadline.
            wait_for(
                lambda: not trainer.is_alive(), 10, what="200 step reports while the agent is stuck"
            )
            assert not stuck.release.is_set()
            assert stuck.of("step") == [], "the agent has not answered any call yet"
        finally:
            stuck.release.set()
            rt.close()


def asks_in_ack(call: int):
    """Has the ``agent`` fixture ask for a checkpoint in the ack of its ``call``-th
    ReportSteps call."""
    return pytest.mark.parametrize(
        "agent",
        [{"ask": lambda number, _reports: number == call}],
        indirect=True,
        ids=[f"asks-in-ack-{call}"],
    )


def agent_env(socket: str, recorder: AgentRecorder) -> dict:
    return {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "KEEL_JOB": "demo",
        "KEEL_GENERATION": "4",
        "KEEL_AGENT_SOCKET": socket,
        "KEEL_RANK_TOKEN": recorder.token_for(4, 2),
    }


def test_a_checkpointing_report_goes_out_at_once_with_its_phases(agent, monkeypatch):
    socket_path, recorder = agent
    # Batches would otherwise wait a minute: only the flag can make this one leave.
    monkeypatch.setattr(reporting, "REPORT_INTERVAL_S", 60.0)
    rt = runtime.init(agent_env(socket_path, recorder))
    rt.report_step(
        7,
        loss=2.5,
        tokens=512,
        step_time_s=0.5,
        data_s=0.01,
        compute_s=0.3,
        optimizer_s=0.1,
        checkpoint_s=0.2,
        checkpointing=True,
    )
    (report,) = wait_for(lambda: recorder.of("step"), 5, what="the checkpointing report")
    assert (report.rank, report.step, report.step_time_s, report.checkpointing) == (1, 7, 0.5, True)
    assert (report.data_s, report.compute_s, report.optimizer_s, report.checkpoint_s) == (
        0.01,
        0.3,
        0.1,
        0.2,
    )
    rt.close()


@asks_in_ack(2)
def test_checkpoint_now_in_an_ack_is_taken_once(agent):
    socket_path, recorder = agent
    rt = runtime.init(agent_env(socket_path, recorder))
    assert not rt.take_checkpoint_request()
    rt.report_step(1, loss=2.5, tokens=512, step_time_s=0.5, checkpointing=True)
    wait_for(lambda: len(recorder.calls) == 1, 5, what="the first ack")
    assert not rt.take_checkpoint_request(), "the first ack did not ask"
    rt.report_step(2, loss=2.4, tokens=512, step_time_s=0.5, checkpointing=True)
    wait_for(rt.take_checkpoint_request, 5, what="the request in the second ack")
    assert not rt.take_checkpoint_request(), "a request is taken once"
    rt.close()


class AsksAfter(AgentRecorder):
    """An agent whose ack of each call reporting step ``at`` passes on the controller's
    request for a checkpoint of a step after ``after``."""

    def __init__(self, asks: dict[int, int]) -> None:
        super().__init__()
        self.asks = asks

    def on_steps(self, generation: int, reports: list) -> int | None:
        super().on_steps(generation, reports)
        return next((self.asks[r.step] for r in reports if r.step in self.asks), None)


def test_a_checkpoint_request_a_save_already_begun_meets_is_not_taken():
    """The controller asked both nodes for a checkpoint after step 4. The other node's
    rank heard it first and every rank saved step 5 (the answers are folded); this rank
    hears it only in the ack of step 5: saving again at step 6 would be a second
    checkpoint for one request (seen under load as two committed steps for one stop).
    A request after step 5, heard then, is one the save of step 5 does not meet."""
    recorder = AsksAfter({5: 4, 7: 7})
    with local_agent(recorder) as socket_path:
        rt = runtime.init(agent_env(socket_path, recorder))
        try:
            rt.report_step(5, loss=2.5, tokens=512, step_time_s=0.5, checkpointing=True)
            wait_for(lambda: len(recorder.calls) == 1, 5, what="the ack of step 5")
            assert not rt.take_checkpoint_request(), "the save of step 5 met it"
            rt.report_step(6, loss=2.5, tokens=512, step_time_s=0.5)
            rt.report_step(7, loss=2.5, tokens=512, step_time_s=0.5, checkpointing=True)
            wait_for(lambda: len(recorder.calls) == 2, 5, what="the ack of step 7")
            assert rt.take_checkpoint_request(), "a save of step 7 does not come after step 7"
            assert not rt.take_checkpoint_request(), "a request is taken once"
        finally:
            rt.close()


@dataclass
class Figure:
    collective: str
    size_bytes: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float


def test_preflight_reports_reach_the_agent(agent):
    socket_path, recorder = agent
    rt = runtime.init(agent_env(socket_path, recorder))
    assert rt.report_preflight(
        [Figure("all_reduce", 1 << 20, 0.001, 1.048576, 1.048576)], wall_s=0.7
    )
    (report,) = recorder.of("preflight")
    assert (report.job, report.generation, report.rank, report.world_size, report.wall_s) == (
        "demo",
        4,
        1,
        2,
        0.7,
    )
    assert [
        (r.collective, r.size_bytes, r.time_s, r.algbw_gbps, r.busbw_gbps) for r in report.results
    ] == [(keel_pb2.COLLECTIVE_ALL_REDUCE, 1 << 20, 0.001, 1.048576, 1.048576)]
    rt.close()
    plain = runtime.init({"RANK": "0", "WORLD_SIZE": "2"})
    assert plain.report_preflight([], wall_s=0.1) is False
    assert not plain.take_checkpoint_request()
