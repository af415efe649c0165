from pathlib import Path

import pytest

from agent.config import AgentConfig
from orchestrator.controller.config import ControllerConfig
from orchestrator.planner import Layout
from orchestrator.planner.sizing import size_and_layout
from orchestrator.spec.jobspec import InvalidSpec, validate
from protos import keel_pb2


def good_spec(**kw):
    fields = dict(
        name="llama-7b",
        world_size=4,
        command=["python", "-m", "trainer.train"],
        max_restarts=3,
        checkpoint_dir="/ck",
    )
    fields.update(kw)
    return keel_pb2.JobSpec(**fields)


def test_a_good_spec_passes():
    validate(good_spec())


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(name="Bad_Name"), "name 'Bad_Name': use 1-63 lowercase"),
        (dict(world_size=0), "world_size: must be at least 1"),
        (dict(command=[]), "command: give the argv"),
        (dict(checkpoint_dir="relative/dir"), "must be an absolute path"),
        (dict(env={"RANK": "1"}), "env 'RANK': set by Keel"),
        (dict(env={"1X": "1"}), "not a valid environment variable name"),
        (dict(max_restarts=5000), "a job failing that often needs a person"),
    ],
)
def test_bad_specs_name_the_field_and_the_fix(kw, message):
    with pytest.raises(InvalidSpec, match=message):
        validate(good_spec(**kw))


def test_controller_config_checks_its_deadline_hierarchy():
    ControllerConfig(etcd_endpoints=("127.0.0.1:2379",), token="t")
    for endpoint in ("localhost", "h:port", "h:99999", ":2379"):
        with pytest.raises(ValueError, match=f"etcd endpoint '{endpoint}': write it as host:port"):
            ControllerConfig(etcd_endpoints=(endpoint,), token="t")
    with pytest.raises(ValueError, match="etcd_timeout_s=20 must be below node_lost_grace_s"):
        ControllerConfig(etcd_endpoints=("h:1",), token="t", etcd_timeout_s=20)
    with pytest.raises(ValueError, match="needs one"):
        ControllerConfig(etcd_endpoints=("h:1",), token="")
    for budget in (0.0, -5.0, float("nan")):
        with pytest.raises(ValueError, match="the step messages a second the agents may send"):
            ControllerConfig(etcd_endpoints=("h:1",), token="t", report_messages_per_s=budget)


def test_agent_config_checks_its_deadline_hierarchy():
    base = dict(node="n0", slots=2, etcd_endpoints=("h:1",), token="t", run_dir=Path("/tmp"))
    AgentConfig(**base)
    assert AgentConfig(**base, lease_ttl_s=5).etcd_timeout_s == 1.0  # a fifth of the TTL
    AgentConfig(**base, lease_ttl_s=4, etcd_timeout_s=0.9)
    # A refresh stalled on one member for 1.2 s, and its retry, do not fit in 4 s.
    with pytest.raises(ValueError, match="give etcd calls on the lease path at most 1 s"):
        AgentConfig(**base, lease_ttl_s=4, etcd_timeout_s=1.2)
    with pytest.raises(ValueError, match="slots=0"):
        AgentConfig(**{**base, "slots": 0})
    with pytest.raises(ValueError, match="etcd endpoint 'h': write it as host:port"):
        AgentConfig(**{**base, "etcd_endpoints": ("h",)})
    with pytest.raises(ValueError, match="node 'a b'"):
        AgentConfig(**{**base, "node": "a b"})


def planned_spec(**kw):
    spec = good_spec(mesh="dp_shard=2,tp=2", min_nodes=1, **kw)
    spec.model.CopyFrom(keel_pb2.ModelShape(params=1.2e5, layers=2, hidden=64, heads=4, vocab=256))
    spec.training.CopyFrom(
        keel_pb2.TrainingShape(
            seq_len=64,
            micro_batch=1,
            global_batch=16,
            precision=keel_pb2.PRECISION_FP32,
            gpu_memory_gb=4,
        )
    )
    return spec


def test_the_spec_layout_is_used_when_not_shrinking():
    assert size_and_layout(planned_spec(), {"a": 2, "b": 2}, shrink=False) == (4, "dp_shard=2,tp=2")


def test_shrinking_takes_the_largest_size_the_free_slots_hold_with_a_planned_layout():
    world, mesh = size_and_layout(planned_spec(), {"a": 2}, shrink=True)
    assert world == 2
    assert Layout.parse(mesh).world_size == 2


def test_a_size_no_layout_can_run_is_skipped():
    # On 3 slots: dp=3 does not divide the global batch of 16, 4 heads do not split
    # over tp=3, and 2 layers do not make 3 stages; so the job shrinks to 2.
    world, mesh = size_and_layout(planned_spec(), {"a": 3}, shrink=True)
    assert world == 2 and Layout.parse(mesh).world_size == 2


def test_an_unknown_model_shrinks_to_plain_data_parallel():
    spec = good_spec(min_nodes=1)
    assert size_and_layout(spec, {"a": 3}, shrink=True) == (3, "dp_shard=3")


def test_a_layout_that_does_not_fit_the_model_is_refused_at_submit():
    spec = planned_spec()
    spec.mesh = "pp=4"
    with pytest.raises(InvalidSpec, match="pp=4 is more than layers=2"):
        validate(spec)


def test_excluding_a_node_caps_the_size_even_when_a_spare_is_free():
    # 2 + 2 slots free (a spare among them), but the exclude policy drops a node of 2.
    world, mesh = size_and_layout(planned_spec(), {"a": 2, "c": 2}, shrink=True, max_world_size=2)
    assert world == 2 and Layout.parse(mesh).world_size == 2


def test_health_settings_are_validated_with_the_fix():
    from orchestrator.spec.health import InvalidHealth, resolve

    assert resolve(keel_pb2.HealthSpec()).hang_floor_s == 30.0
    for spec, message in [
        (keel_pb2.HealthSpec(hang_floor_s=float("nan")), "hang_floor_s=nan: must be a finite"),
        (keel_pb2.HealthSpec(straggler_policy=99), "99: use one of replace, exclude, alert"),
        (keel_pb2.HealthSpec(hang_floor_s=0.5), "must be at least 1 s"),
        (keel_pb2.HealthSpec(hang_floor_s=500), "first_step_timeout_s=300.0: must be at least"),
        (keel_pb2.HealthSpec(straggler_slowdown=1.05), "must be above 1.1"),
        (keel_pb2.HealthSpec(straggler_window=5000), "straggler_window=5000: must be at most"),
    ]:
        with pytest.raises(InvalidHealth, match=message):
            resolve(spec)


@pytest.mark.parametrize("mesh", ["", "auto", "dp_shard=2,tp=2"])
@pytest.mark.parametrize(
    "model,training,message",
    [
        (dict(params=float("inf")), {}, "params=inf: give the parameter count"),
        (dict(params=-1.0), {}, "params=-1.0: give the parameter count"),
        (dict(params=1e9), dict(precision=9), "Precision value 9 is no Precision"),
        (dict(params=1e9), dict(gpu_memory_gb=float("nan")), "gpu_memory_gb=nan"),
    ],
)
def test_the_model_and_training_shapes_are_checked_at_submit_whatever_the_mesh(
    mesh, model, training, message
):
    spec = good_spec(mesh=mesh)
    spec.model.CopyFrom(keel_pb2.ModelShape(**model))
    spec.training.CopyFrom(keel_pb2.TrainingShape(**training))
    with pytest.raises(InvalidSpec, match=r"model/training: .*" + message.replace("(", r"\(")):
        validate(spec)


def test_when_no_size_fits_the_reason_names_the_largest_size_and_counts_the_rest():
    spec = planned_spec()
    spec.training.gpu_memory_gb = 1e-6
    with pytest.raises(ValueError) as err:
        size_and_layout(spec, {"a": 4}, shrink=True)
    message = str(err.value)
    assert message.startswith("world size 4: ") and "world size 3" not in message
    assert message.endswith("; no layout at the 3 smaller world size(s) either")
