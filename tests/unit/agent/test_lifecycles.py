"""A generation's lifecycle on a node: only the transitions in its table are allowed
(each rank's lifecycle is tested with a real process in
tests/integration/test_agent_processes.py)."""

import pytest

from agent.generation import Generation, IllegalTransition, Phase
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
