"""The memory an agent holds for its jobs' snapshots (``agent.memory``) and how its
ranks are told of it."""

import stat
from pathlib import Path

from agent.env import rank_env
from agent.memory import JobMemory, default_root, held_bytes
from common import env as keel_env
from protos import keel_pb2
from tests.unit.agent.test_env_failure import CHAIN, start_message


def test_a_job_gets_its_own_directory_and_another_jobs_memory_is_released(tmp_path: Path):
    memory = JobMemory(tmp_path / "root", budget_bytes=2**30)
    told = memory.hold("job-a")
    path = Path(told[keel_env.MEMORY_DIR])
    assert path == tmp_path / "root" / "job-a" and path.is_dir()
    assert told[keel_env.MEMORY_BUDGET_BYTES] == str(2**30)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "root").stat().st_mode) == 0o711
    (path / "mem_00000003").mkdir()
    (path / "mem_00000003" / "__0_0.distcp").write_bytes(b"x" * 1000)
    # Held again (the job's next generation): what is there stays.
    assert memory.hold("job-a") == told and (path / "mem_00000003").is_dir()
    assert memory.jobs() == ["job-a"]
    # A node runs one job at a time: the next job's start releases the last one's.
    memory.hold("job-b")
    assert memory.jobs() == ["job-b"] and not path.exists()


def test_release_says_what_it_gave_back_and_close_leaves_held_memory(tmp_path: Path):
    memory = JobMemory(tmp_path / "root", budget_bytes=1)
    path = Path(memory.hold("job")[keel_env.MEMORY_DIR])
    (path / "a").write_bytes(b"y" * 300)
    assert held_bytes(path) == 300
    memory.close()  # the job's next generation may restore what is held
    assert path.is_dir()
    assert memory.release("job", "finished") == 300 and not path.exists()
    assert memory.release("job", "again") == 0
    memory.close()
    assert not (tmp_path / "root").exists()


def test_no_budget_or_no_job_id_holds_nothing(tmp_path: Path):
    assert JobMemory(tmp_path / "root", budget_bytes=0).hold("job") == {}
    assert JobMemory(tmp_path / "root", budget_bytes=10).hold("") == {}
    assert not (tmp_path / "root").exists()


def test_each_run_directory_has_its_own_root_under_dev_shm(tmp_path: Path):
    one, other = default_root(tmp_path / "a"), default_root(tmp_path / "b")
    assert one.parent == Path("/dev/shm") and one != other
    assert default_root(tmp_path / "a") == one


def test_ranks_are_told_the_memory_and_nothing_of_it_without_one():
    one = keel_pb2.RankAssignment(rank=0, local_rank=0)
    told = {keel_env.MEMORY_DIR: "/dev/shm/k/j", keel_env.MEMORY_BUDGET_BYTES: "5"}
    env = rank_env({}, start_message(), one, "s", "e", CHAIN, memory=told)
    assert (env[keel_env.MEMORY_DIR], env[keel_env.MEMORY_BUDGET_BYTES]) == ("/dev/shm/k/j", "5")
    # The agent's own environment (or a stale one) never points a rank at memory.
    base = {keel_env.MEMORY_DIR: "/elsewhere"}
    env = rank_env(base, start_message(), one, "s", "e", CHAIN)
    assert (env[keel_env.MEMORY_DIR], env[keel_env.MEMORY_BUDGET_BYTES]) == ("", "0")
