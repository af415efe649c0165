"""The agent's lifecycles: a generation's on the node, and each rank's; only the
transitions in their tables are allowed."""

import subprocess
import sys

import pytest

from agent.generation import Generation, IllegalTransition, Phase
from agent.supervisor import RANK_TRANSITIONS, IllegalRankTransition, RankPhase, RankProcess
from protos import keel_pb2


def start(generation, job="j"):
    return keel_pb2.StartGeneration(job=job, generation=generation)


def test_a_generation_runs_is_stopped_and_is_forgotten_once_reaped():
    state = Generation()
    state.begin(start(1))
    assert (state.phase, state.running("j", 1)) == (Phase.RUNNING, True)
    state.hang_reported = True
    state.stop("j", 1, "hang")
    assert (state.phase, state.stopping) == (Phase.STOPPING, ("j", 1))
    assert state.running("j", 1), "a Hello still names it while it is being stopped"
    assert state.stopped() == ("j", 1)
    assert (state.phase, state.start, state.stopping) == (Phase.IDLE, None, None)
    state.begin(start(2))
    assert state.hang_reported is False, "one hang report per generation"


def test_confirming_a_stale_stop_leaves_the_running_generation_running():
    state = Generation()
    state.begin(start(3))
    state.stop("j", 2, "not the job's running generation")
    assert state.stopped() == ("j", 2)
    assert (state.phase, state.running("j", 3)) == (Phase.RUNNING, True)


def test_a_stop_of_a_generation_that_never_ran_here_is_confirmed():
    state = Generation()
    state.stop("j", 5, "the controller ends it everywhere")
    assert state.stopped() == ("j", 5) and state.phase is Phase.IDLE


def test_an_idle_agent_has_nothing_to_confirm():
    with pytest.raises(IllegalTransition, match="cannot go from IDLE to IDLE"):
        Generation()._move(Phase.IDLE, "nothing", "j", 1)


@pytest.fixture
def rank():
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    popen.wait()
    return RankProcess(job="j", generation=1, rank=0, local_rank=0, popen=popen, log_dir=None)


def test_a_rank_moves_only_along_its_table(rank):
    rank.move(RankPhase.STOPPING, "SIGTERM")
    rank.move(RankPhase.KILLED, "grace over")
    rank.move(RankPhase.EXITED, "reaped")
    with pytest.raises(IllegalRankTransition, match="cannot go from EXITED to RUNNING"):
        rank.move(RankPhase.RUNNING, "back from the dead")
    rank.move(RankPhase.REAPED, "group empty")
    assert RANK_TRANSITIONS[RankPhase.REAPED] == frozenset()
    # Every phase has its row in the table.
    assert set(RANK_TRANSITIONS) == set(RankPhase)
