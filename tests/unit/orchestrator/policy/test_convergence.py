"""Desired against actual: what the plan says a node runs against its agent's status."""

from orchestrator.policy.convergence import RESEND_S, Fix, NodeRuns, PlanOnNode, converge
from orchestrator.policy.lifecycle import JobState
from protos import keel_pb2


def runs(job="", generation=0, phase="IDLE", started=("", 0), pid=77, received_at=100.0):
    return NodeRuns(
        node="b",
        pid=pid,
        job=job,
        generation=generation,
        phase=keel_pb2.AgentPhase.Value(f"AGENT_PHASE_{phase}"),
        started_job=started[0],
        started_generation=started[1],
        received_at=received_at,
    )


def plan(
    state=JobState.RUNNING, generation=2, placed=True, agent=77, stopped=False, lost=False, job="j"
):
    return PlanOnNode(
        job=job,
        state=state,
        generation=generation,
        placed=placed,
        placed_agent=agent,
        confirmed_stopped=stopped,
        lost=lost,
    )


def fix(node_runs, *plans, now=100.0, last=0.0):
    found = converge(now, node_runs, list(plans), last)
    return found and (found.fix, found.job, found.generation)


def test_a_node_that_never_got_its_start_is_started_again_but_not_too_often():
    assert fix(runs(), plan()) == (Fix.START, "j", 2)
    assert fix(runs(), plan(), now=100.0, last=100.0 - RESEND_S / 2) is None
    assert fix(runs(), plan(), now=100.0, last=100.0 - RESEND_S) == (Fix.START, "j", 2)


def test_a_fix_is_sent_again_only_once_a_status_sent_after_it_still_shows_it_missing():
    # Told at 90: a status that arrived by 90 + RESEND_S may have been sent before the
    # agent got it (a busy controller reads statuses late), and is no reason to resend.
    told = 90.0
    for received in (80.0, told, told + RESEND_S / 2):
        assert fix(runs(received_at=received), plan(), now=100.0, last=told) is None
    assert fix(runs(received_at=told + RESEND_S), plan(), now=100.0, last=told) == (
        Fix.START,
        "j",
        2,
    )
    # Never told: a status of any age is enough.
    assert fix(runs(received_at=0.0), plan(), now=100.0, last=0.0) == (Fix.START, "j", 2)


def test_a_start_goes_only_to_the_agent_incarnation_it_was_planned_for():
    # A restarted agent's ranks died with its predecessor; adoption ends the generation.
    assert fix(runs(pid=78), plan(agent=77)) is None
    assert fix(runs(), plan(lost=True)) is None
    assert fix(runs(), plan(placed=False)) is None


def test_a_node_that_runs_what_the_plan_says_is_left_alone():
    running = runs("j", 2, "RUNNING", ("j", 2))
    assert fix(running, plan()) is None
    assert fix(runs("j", 2, "STOPPING", ("j", 2)), plan(JobState.STOPPING)) is None
    # Started and since exited (its ranks finished): not started again.
    assert fix(runs(started=("j", 2)), plan()) is None


def test_a_node_that_missed_a_stop_is_told_again():
    still = runs("j", 2, "RUNNING", ("j", 2))
    assert fix(still, plan(JobState.STOPPING)) == (Fix.STOP, "j", 2)
    # Not once it confirmed the stop.
    assert fix(still, plan(JobState.STOPPING, stopped=True)) is None


def test_a_generation_that_is_not_the_jobs_is_stopped():
    stale = runs("j", 1, "RUNNING", ("j", 1))
    assert fix(stale, plan(generation=2)) == (Fix.STOP, "j", 1)
    # A job no controller knows, and a job that has ended.
    assert fix(runs("gone", 3, "RUNNING", ("gone", 3))) == (Fix.STOP, "gone", 3)
    assert fix(runs("j", 2, "RUNNING", ("j", 2)), plan(JobState.SUCCEEDED)) == (Fix.STOP, "j", 2)
    # Or one that no longer places ranks on the node.
    assert fix(runs("j", 2, "RUNNING", ("j", 2)), plan(placed=False)) == (Fix.STOP, "j", 2)
