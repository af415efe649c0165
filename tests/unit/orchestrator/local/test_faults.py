import pytest
from google.protobuf import json_format

from orchestrator.local.faults import BadFault, parse_fault, parse_schedule
from orchestrator.local.options import UpOptions, job_spec
from protos import keel_pb2


def test_parse_each_rank_fault():
    crash = parse_fault("crash:rank=1,step=12")
    assert (crash.kind, crash.rank, crash.step) == (keel_pb2.FAULT_KIND_CRASH, 1, 12)
    kill = parse_fault("kill:step=3,rank=0")
    assert (kill.kind, kill.rank, kill.step) == (keel_pb2.FAULT_KIND_KILL, 0, 3)
    assert parse_fault("hang:rank=2,step=5").kind == keel_pb2.FAULT_KIND_HANG
    bad_node = parse_fault("crash:node=2,step=3")
    assert (bad_node.kind, bad_node.node, bad_node.HasField("rank")) == (
        keel_pb2.FAULT_KIND_CRASH,
        2,
        False,
    )
    slow = parse_fault("slow:rank=3,step=10,factor=1.5")
    assert slow.factor == pytest.approx(1.5)
    lose = parse_fault("lose_node:node=1,step=20")
    assert (lose.kind, lose.node, lose.step, lose.HasField("rank")) == (
        keel_pb2.FAULT_KIND_LOSE_NODE,
        1,
        20,
        False,
    )
    assert parse_fault("restart_etcd:step=4").down_s == 0.0  # keel up's default
    assert parse_fault("restart_etcd:step=4,down=7.5").down_s == pytest.approx(7.5)


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "explode:rank=1,step=2",
            "kind must be one of crash, hang, kill, kill_agent, kill_leader, "
            "lose_node, partition_node, restart_etcd, slow, stall_agent, "
            "stall_leader, stall_node",
        ),
        ("stall_node:node=1,step=2", "missing for"),
        ("stall_agent:node=1,step=2,for=0", "down and for seconds in (0, 600]"),
        ("crash", "write it as crash:rank=...,step=..."),
        ("crash:rank=1", "missing step"),
        ("crash:rank=1,step=2,step=3", "each once"),
        ("crash:rank=x,step=2", "rank and node are integers"),
        ("lose_node:rank=1,step=2", "is not one of node, step"),
        ("crash:rank=1,step=0", "step an integer >= 1"),
        ("slow:rank=1,step=2,factor=0.5", "factor a number in (1, 100]"),
        ("slow:rank=1,step=2,factor=inf", "factor a number in (1, 100]"),
        ("kill:rank=1,step=2,factor=2", "is not one of"),
        ("restart_etcd:step=2,down=0", "down and for seconds in (0, 600]"),
        ("restart_etcd:step=2,down=soon", "down and for seconds in (0, 600]"),
        ("crash:rank=1,step=2,down=3", "is not one of node, rank, step"),
        ("crash:step=2", "missing rank (or node"),
        ("crash:node=1,rank=0,step=2", "give rank or node, not both"),
        ("kill:node=1,step=2", "is not one of rank, step"),
        ("restart_etcd:down=3", "missing step"),
    ],
)
def test_bad_faults_say_what_to_fix(text, message):
    with pytest.raises(
        BadFault, match=message.replace(".", r"\.").replace("(", r"\(").replace("[", r"\[")
    ):
        parse_fault(text)


def test_schedule_rejects_ranks_outside_the_world_and_round_trips_as_json():
    with pytest.raises(BadFault, match="rank 4 does not exist at world size 4"):
        parse_schedule(["crash:rank=4,step=1"], world_size=4, nodes=2)
    with pytest.raises(BadFault, match="node 2 does not exist in a cluster of 2 nodes"):
        parse_schedule(["lose_node:node=2,step=1"], world_size=4, nodes=2)
    with pytest.raises(BadFault, match="node 2 does not exist in a cluster of 2 nodes"):
        parse_schedule(["crash:node=2,step=1"], world_size=4, nodes=2)
    schedule = parse_schedule(
        ["crash:rank=1,step=12", "kill:rank=0,step=20", "lose_node:node=1,step=30"], 4, 2
    )
    text = json_format.MessageToJson(schedule, indent=None)
    again = json_format.Parse(text, keel_pb2.FaultSchedule())
    assert again == schedule and len(again.faults) == 3
    assert (again.faults[2].node, again.faults[2].step) == (1, 30)
    assert not again.faults[2].HasField("rank")


@pytest.mark.parametrize(
    "options,message",
    [
        (
            dict(steps=40, inject=("crash:rank=1,step=41",)),
            "crash at step 41 would never fire: the job runs --steps 40",
        ),
        (
            dict(inject=("kill_leader:step=5",)),
            "1 kill_leader/term_leader fault(s) need as many standbys: give --controllers 2",
        ),
        (
            dict(controllers=2, inject=("kill_leader:step=5", "term_leader:step=9")),
            "need as many standbys: give --controllers 3",
        ),
        (
            dict(controllers=2, inject=("kill_leader:step=5", "kill_leader:step=9")),
            "need as many standbys: give --controllers 3",
        ),
        (
            dict(inject=("lose_node:node=1,step=5", "lose_node:node=1,step=9")),
            "node 1 is lost twice",
        ),
        (
            dict(inject=("lose_node:node=1,step=5", "kill_agent:node=1,step=9")),
            "node 1 is lost by lose_node or term_agent; kill_agent cannot also act on it",
        ),
        (
            dict(inject=("term_agent:node=1,step=5", "lose_node:node=1,step=9")),
            "node 1 is lost twice",
        ),
        (
            dict(etcd_endpoints=("127.0.0.1:2379",), inject=("restart_etcd:step=5",)),
            "drop --etcd-endpoints (and unset KEEL_ETCD_ENDPOINTS)",
        ),
    ],
)
def test_keel_up_refuses_faults_its_cluster_could_never_fire(tmp_path, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        job_spec(UpOptions(**options), tmp_path)


def test_faults_its_cluster_can_fire_are_accepted(tmp_path):
    spec = job_spec(
        UpOptions(
            controllers=2,
            steps=40,
            inject=(
                "kill_leader:step=5",
                "kill_agent:node=0,step=9",
                "kill_agent:node=0,step=20",
                "lose_node:node=1,step=30",
                "restart_etcd:step=40,down=3",
            ),
        ),
        tmp_path,
    )
    schedule = json_format.Parse(spec.env["KEEL_FAULTS"], keel_pb2.FaultSchedule())
    assert [f.kind for f in schedule.faults] == [
        keel_pb2.FAULT_KIND_KILL_LEADER,
        keel_pb2.FAULT_KIND_KILL_AGENT,
        keel_pb2.FAULT_KIND_KILL_AGENT,
        keel_pb2.FAULT_KIND_LOSE_NODE,
        keel_pb2.FAULT_KIND_RESTART_ETCD,
    ]


def test_keel_up_knows_how_to_fire_every_cluster_fault_once():
    from orchestrator.local.faults import CLUSTER_FAULTS
    from orchestrator.local.firing import FIRING, OF_THE_LEADER

    assert set(FIRING) | OF_THE_LEADER == CLUSTER_FAULTS
    assert not set(FIRING) & OF_THE_LEADER
