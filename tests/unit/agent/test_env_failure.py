import json

from agent.env import rank_env
from agent.failure import error_file_traceback, stderr_traceback, tail
from common.deadlines import resolve
from protos import keel_pb2

CHAIN = resolve(hang_floor_s=90)


def start_message(**env):
    return keel_pb2.StartGeneration(
        job="j",
        generation=3,
        world_size=4,
        local_world_size=2,
        master_addr="10.0.0.1",
        master_port=29511,
        command=["python", "x.py"],
        env=env,
        restart_count=2,
        checkpoint_dir="/ck",
        restore_from="/ck/step_00000010",
        mesh="dp_shard=4",
    )


def test_rank_env_has_torchrun_and_keel_variables():
    env = rank_env(
        {"PATH": "/bin", "RANK": "99"},
        start_message(FOO="bar"),
        keel_pb2.RankAssignment(rank=3, local_rank=1),
        "/tmp/a.sock",
        "/tmp/e.json",
        CHAIN,
    )
    assert env["PATH"] == "/bin" and env["FOO"] == "bar"
    assert {
        k: env[k]
        for k in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_ERROR_FILE",
        )
    } == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_ERROR_FILE": "/tmp/e.json",
    }
    assert {
        k: env[k]
        for k in (
            "KEEL_JOB",
            "KEEL_GENERATION",
            "KEEL_MESH",
            "KEEL_CHECKPOINT_DIR",
            "KEEL_RESTORE_FROM",
            "KEEL_AGENT_SOCKET",
        )
    } == {
        "KEEL_JOB": "j",
        "KEEL_GENERATION": "3",
        "KEEL_MESH": "dp_shard=4",
        "KEEL_CHECKPOINT_DIR": "/ck",
        "KEEL_RESTORE_FROM": "/ck/step_00000010",
        "KEEL_AGENT_SOCKET": "/tmp/a.sock",
    }
    # The job's deadlines, with the collective timeout derived to fit the 90 s floor.
    assert {
        k: env[k]
        for k in (
            "KEEL_HANG_FLOOR_S",
            "KEEL_STOP_GRACE_S",
            "KEEL_COLLECTIVE_TIMEOUT_S",
            "KEEL_STARTUP_TIMEOUT_S",
        )
    } == {
        "KEEL_HANG_FLOOR_S": "90",
        "KEEL_STOP_GRACE_S": "5",
        "KEEL_COLLECTIVE_TIMEOUT_S": "114",
        "KEEL_STARTUP_TIMEOUT_S": "366",
    }
    assert env["OMP_NUM_THREADS"] == "1"


def test_job_env_cannot_override_the_rendezvous_but_can_set_threads():
    env = rank_env(
        {},
        start_message(MASTER_PORT="1", OMP_NUM_THREADS="4"),
        keel_pb2.RankAssignment(rank=0, local_rank=0),
        "s",
        "e",
        CHAIN,
    )
    assert env["MASTER_PORT"] == "29511" and env["OMP_NUM_THREADS"] == "4"


def test_ranks_get_none_of_the_agents_secrets_or_keel_settings():
    agent = {
        "PATH": "/bin",
        "HOME": "/root",
        "KEEL_TOKEN": "join-secret",
        "KEEL_ETCD_PASSWORD": "etcd-secret",
        "KEEL_ETCD_ENDPOINTS": "10.0.0.9:2379",
        "KEEL_CONTROLLER": "10.0.0.8:50051",
        "KEEL_GENERATION": "1",
    }
    env = rank_env(
        agent,
        start_message(KEEL_FAULTS="{}"),
        keel_pb2.RankAssignment(rank=0, local_rank=0),
        "s",
        "e",
        CHAIN,
    )
    assert env["PATH"] == "/bin" and env["HOME"] == "/root"
    for secret in ("KEEL_TOKEN", "KEEL_ETCD_PASSWORD", "KEEL_ETCD_ENDPOINTS", "KEEL_CONTROLLER"):
        assert secret not in env
    assert "join-secret" not in env.values() and "etcd-secret" not in env.values()
    # Keel's variables come from the plan (and the job's own env), not the agent's.
    assert env["KEEL_GENERATION"] == "3" and env["KEEL_FAULTS"] == "{}"


def test_error_file_traceback_reads_torchelastic_format(tmp_path):
    path = tmp_path / "error.json"
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: boom",
                    "extraInfo": {
                        "py_callstack": (
                            "Traceback (most recent call last):\n  ...\nRuntimeError: boom"
                        ),
                        "timestamp": "1",
                    },
                }
            }
        )
    )
    assert error_file_traceback(path).endswith("RuntimeError: boom")
    assert error_file_traceback(tmp_path / "missing.json") == ""
    (tmp_path / "torn.json").write_text('{"message": {')
    assert error_file_traceback(tmp_path / "torn.json") == ""


def test_stderr_traceback_takes_the_last_one(tmp_path):
    text = (
        "noise\nTraceback (most recent call last):\n  old\nValueError: first\n"
        "more noise\nTraceback (most recent call last):\n  File x\nKeyError: 'k'\n"
    )
    assert stderr_traceback(text) == "Traceback (most recent call last):\n  File x\nKeyError: 'k'"
    assert stderr_traceback("no traceback here") == ""
    path = tmp_path / "err"
    path.write_text("x" * 10000 + "END")
    assert tail(path, 100).endswith("END") and len(tail(path, 100)) == 100


def test_gloo_binds_the_interface_of_the_advertised_host_unless_told_otherwise():
    one = keel_pb2.RankAssignment(rank=0, local_rank=0)
    env = rank_env({}, start_message(), one, "s", "e", CHAIN, interface="ib0")
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert (
        rank_env(
            {}, start_message(GLOO_SOCKET_IFNAME="eth1"), one, "s", "e", CHAIN, interface="ib0"
        )["GLOO_SOCKET_IFNAME"]
        == "eth1"
    )
    assert (
        rank_env(
            {"GLOO_SOCKET_IFNAME": "eth2"}, start_message(), one, "s", "e", CHAIN, interface="ib0"
        )["GLOO_SOCKET_IFNAME"]
        == "eth2"
    )
    assert "GLOO_SOCKET_IFNAME" not in rank_env({}, start_message(), one, "s", "e", CHAIN)
