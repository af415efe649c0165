"""Squaring a (re)connecting agent's Hello with the plan."""

from orchestrator.policy.adoption import Account, AgentRuns, JobOnNode, account
from orchestrator.policy.lifecycle import JobState


def on_node(
    state=JobState.RUNNING,
    generation=2,
    on=True,
    first=False,
    rendezvous=True,
    planned=(2, 3),
    exited=(),
    vanished=False,
    job="j",
):
    return JobOnNode(
        job=job,
        state=state,
        generation=generation,
        on_node=on,
        first_node=first,
        rendezvous_known=rendezvous,
        planned_ranks=planned,
        exited_ranks=frozenset(exited),
        vanished=vanished,
    )


def actions(runs, *jobs):
    return [(d.action, d.job, d.generation, d.ranks, d.reason) for d in account(runs, jobs)]


def test_ranks_of_the_running_generation_are_adopted():
    runs = AgentRuns("b", 77, "j", 2, (2, 3))
    assert actions(runs, on_node()) == [
        (Account.ADOPT, "j", 2, (2, 3), "the job's running generation")
    ]


def test_an_older_generation_is_stopped_cleanly():
    runs = AgentRuns("b", 77, "j", 1, (2, 3))
    assert actions(runs, on_node(on=False)) == [
        (Account.STOP_STALE, "j", 1, (), "not the job's running generation")
    ]
    # So is a job that is no longer known, or no longer running.
    assert actions(AgentRuns("b", 77, "gone", 4), on_node(on=False))[-1][0] is Account.STOP_STALE
    assert (
        actions(AgentRuns("b", 77, "j", 2), on_node(state=JobState.STOPPING))[-1][0]
        is Account.STOP_STALE
    )


def test_an_agent_back_without_its_ranks_ends_their_generation():
    fresh = AgentRuns("b", 78)
    assert actions(fresh, on_node(exited=(3,))) == [
        (
            Account.VANISHED,
            "j",
            2,
            (2,),
            "the agent of b (pid 78) came back without rank(s) 2 of generation 2: they died with "
            "its previous incarnation",
        )
    ]
    # Counted once; and ranks that had all exited before are no loss.
    assert actions(fresh, on_node(vanished=True)) == []
    assert actions(fresh, on_node(exited=(2, 3))) == []


def test_a_stopping_generation_counts_the_node_stopped_and_a_starting_one_asks_again():
    fresh = AgentRuns("b", 78)
    assert actions(fresh, on_node(state=JobState.STOPPING, exited=(2, 3))) == [
        (Account.STOPPED, "j", 2, (), "b runs nothing of generation 2")
    ]
    # A new incarnation without ranks that never exited: they died with its
    # predecessor, though a peer's crash stopped the generation first.
    assert actions(fresh, on_node(state=JobState.STOPPING, exited=(2,))) == [
        (Account.STOPPED, "j", 2, (), "b runs nothing of generation 2"),
        (
            Account.VANISHED,
            "j",
            2,
            (3,),
            "the agent of b (pid 78) came back without rank(s) 3 of generation 2: they "
            "died with its previous incarnation",
        ),
    ]
    assert actions(fresh, on_node(state=JobState.STARTING, first=True, rendezvous=False)) == [
        (
            Account.RESEND_RENDEZVOUS,
            "j",
            2,
            (),
            "the request may have been lost with the previous stream",
        )
    ]
    # Only rank 0's node is asked, and only while the port is unknown.
    assert actions(fresh, on_node(state=JobState.STARTING, first=False, rendezvous=False)) == []
    assert actions(fresh, on_node(state=JobState.STARTING, first=True, rendezvous=True)) == []


def test_jobs_elsewhere_are_not_its_business():
    assert actions(AgentRuns("b", 78), on_node(on=False)) == []
