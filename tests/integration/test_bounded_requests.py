"""Any size in bounded requests (orchestrator/controller/store): a plan of 32,768
nodes with 8 ranks each, under long host names, is written to a real etcd with its
default limits (1.5 MiB a request, 128 operations a transaction) and read back whole by
another controller's store; writing a generation's plan deletes the plans (and parts)
of every other generation; parts that are missing or do not match their digest are a
plan that does not parse, not a wrong plan."""

from __future__ import annotations

import grpc
import pytest

from common import keys
from common.etcd import connect, read_prefix
from common.records import JobSpecRecord, JobStateRecord, PlanPartsRecord, PlanRecord, RecordError
from orchestrator.controller import store as store_module
from orchestrator.controller.store import Store
from protos import keel_pb2
from tests.unit.common.test_records import JOB_STATE

NODES, RANKS = 32_768, 8


def big_plan(generation: int, master_port: int = 0) -> PlanRecord:
    names = [
        f"gpu-{i:05d}.rack-{i // 64:03d}.pod-{i // 4096}.train.example.com" for i in range(NODES)
    ]
    return PlanRecord(
        generation=generation,
        world_size=NODES * RANKS,
        master_addr=names[0],
        master_port=master_port,
        nodes={n: list(range(i * RANKS, (i + 1) * RANKS)) for i, n in enumerate(names)},
        restore_from="/ckpt/step_00001000",
        restore_fallbacks=["/ckpt/step_00000900"],
        command=["python", "train.py"],
        mesh=f"dp_shard={NODES * RANKS}",
        agents={n: 100_000 + i for i, n in enumerate(names)},
        created_at_unix=1.0,
    )


def small_plan(generation: int) -> PlanRecord:
    return PlanRecord(
        generation=generation,
        world_size=2,
        master_addr="a",
        master_port=0,
        nodes={"a": [0], "b": [1]},
        restore_from="",
        restore_fallbacks=[],
        command=["python", "train.py"],
        mesh="dp_shard=2",
        agents={"a": 1, "b": 2},
        created_at_unix=1.0,
    )


def state(generation: int) -> JobStateRecord:
    return JOB_STATE.replace(generation=generation)


def plan_keys(client, name: str) -> list[str]:
    kvs, _, _ = read_prefix(client, keys.plans(name), keys_only=True)
    return [kv.key.decode() for kv in kvs]


def test_a_plan_of_32768_nodes_fits_etcds_default_limits_and_is_read_back_whole(etcd):
    client = connect([etcd.endpoint], 30)
    leader = Store(client)
    assert leader.campaign("a", "a:1", client.lease(30).id)
    name, plan = "big", big_plan(7)
    value = plan.to_json().encode()
    # What the store must avoid: the plan as one value is past etcd's request limit.
    assert len(value) > (3 << 20)
    with pytest.raises(grpc.RpcError, match="request is too large|larger than max"):
        client.put(keys.plan(name, 99), value)

    sizes, transaction = [], client.transaction

    def measured(compare, success, failure):  # each request's operations and bytes
        sizes.append(
            (len(success), sum(len(op.key) + len(getattr(op, "value", b"")) for op in success))
        )
        return transaction(compare=compare, success=success, failure=failure)

    client.transaction = measured
    revision = leader.create_job(name, job_spec(name), state(0))
    revision = leader.update_job_state(name, state(7), revision, plan)
    # No request came near etcd's limits: half its 1.5 MiB, a tenth of its 128 ops.
    assert len(sizes) > 5
    assert max(b for _, b in sizes) <= (3 << 20) // 4 and max(n for n, _ in sizes) <= 12
    raw, _ = client.get(keys.plan(name, 7))
    head = PlanPartsRecord.from_json(keys.plan(name, 7), raw)
    assert head.size == len(value) and head.parts == -(-len(value) // store_module.PART_BYTES)
    # Another controller, on a client of its own, reads the plan back whole.
    reader = Store(connect([etcd.endpoint], 30))
    assert reader.plan(name, 7) == plan

    # Written again with the rendezvous port (the move to RUNNING): the parts of the
    # first write go, and the plan read back is the second.
    running = big_plan(7, master_port=29500)
    revision = leader.update_job_state(name, state(7), revision, running)
    assert reader.plan(name, 7) == running
    digest = PlanPartsRecord.from_json(keys.plan(name, 7), client.get(keys.plan(name, 7))[0]).sha256
    left = plan_keys(client, name)
    assert left == [keys.plan(name, 7)] + [
        store_module.part_key(name, 7, digest, i) for i in range(len(left) - 1)
    ]

    # The next generation's plan deletes generation 7's and all its parts.
    revision = leader.update_job_state(name, state(8), revision, small_plan(8))
    assert plan_keys(client, name) == [keys.plan(name, 8)]
    assert reader.plan(name, 8) == small_plan(8) and reader.plan(name, 7) is None

    # A plan whose part is gone (a torn write, a hand edit) does not parse: it is set
    # aside, never read as a shorter plan.
    revision = leader.update_job_state(name, state(9), revision, running.replace(generation=9))
    parts = [k for k in plan_keys(client, name) if "/parts/" in k]
    client.delete(parts[len(parts) // 2])
    with pytest.raises(RecordError, match="do not make up its digest"):
        reader.plan(name, 9)


def test_writing_a_plan_deletes_every_earlier_generation_however_numbered(etcd):
    """Generations sort as text in etcd ("10" before "9"): writing generation 10's plan
    deletes 9's and 1's, and generation 100's deletes 10's, whatever lay before."""
    client = connect([etcd.endpoint], 10)
    leader = Store(client)
    assert leader.campaign("a", "a:1", client.lease(30).id)
    name = "many"
    revision = leader.create_job(name, job_spec(name), state(0))
    for g in (1, 9):
        client.put(keys.plan(name, g), small_plan(g).to_json())  # left by an older Keel
    client.put(keys.plan_parts(name, 9, "f" * 64) + "000000", b"an orphaned part")
    revision = leader.update_job_state(name, state(10), revision, small_plan(10))
    assert plan_keys(client, name) == [keys.plan(name, 10)]
    leader.update_job_state(name, state(100), revision, small_plan(100))
    assert plan_keys(client, name) == [keys.plan(name, 100)]
    assert client.get(keys.job_state(name))[0] is not None  # nothing else went


def job_spec(name: str) -> JobSpecRecord:
    return JobSpecRecord(spec=keel_pb2.JobSpec(name=name, world_size=2, command=["true"]))
