from pathlib import Path

import pytest

from agent.config import AgentConfig
from orchestrator.config import ControllerConfig
from orchestrator.jobspec import InvalidSpec, validate
from protos import keel_pb2


def good_spec(**kw):
    fields = dict(name="llama-7b", world_size=4, command=["python", "-m", "trainer.train"],
                  max_restarts=3, checkpoint_dir="/ck")
    fields.update(kw)
    return keel_pb2.JobSpec(**fields)


def test_a_good_spec_passes():
    validate(good_spec())


@pytest.mark.parametrize("kw,message", [
    (dict(name="Bad_Name"), "name 'Bad_Name': use 1-63 lowercase"),
    (dict(world_size=0), "world_size: must be at least 1"),
    (dict(command=[]), "command: give the argv"),
    (dict(checkpoint_dir="relative/dir"), "must be an absolute path"),
    (dict(env={"RANK": "1"}), "env 'RANK': set by Keel"),
    (dict(env={"1X": "1"}), "not a valid environment variable name"),
    (dict(max_restarts=5000), "a job failing that often needs a person"),
])
def test_bad_specs_name_the_field_and_the_fix(kw, message):
    with pytest.raises(InvalidSpec, match=message):
        validate(good_spec(**kw))


def test_controller_config_checks_its_deadline_hierarchy():
    ControllerConfig(etcd_endpoints=("127.0.0.1:2379",), token="t")
    with pytest.raises(ValueError, match="write it as host:port"):
        ControllerConfig(etcd_endpoints=("localhost",), token="t")
    with pytest.raises(ValueError, match="etcd_timeout_s=20 must be below node_lost_grace_s"):
        ControllerConfig(etcd_endpoints=("h:1",), token="t", etcd_timeout_s=20)
    with pytest.raises(ValueError, match="needs one"):
        ControllerConfig(etcd_endpoints=("h:1",), token="")


def test_agent_config_checks_its_deadline_hierarchy():
    base = dict(node="n0", slots=2, etcd_endpoints=("h:1",), token="t", run_dir=Path("/tmp"))
    AgentConfig(**base)
    with pytest.raises(ValueError, match="must be below lease_ttl_s/2"):
        AgentConfig(**base, lease_ttl_s=4, etcd_timeout_s=2.5)
    with pytest.raises(ValueError, match="slots=0"):
        AgentConfig(**{**base, "slots": 0})
    with pytest.raises(ValueError, match="node 'a b'"):
        AgentConfig(**{**base, "node": "a b"})
