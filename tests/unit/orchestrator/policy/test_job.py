"""The controller's decisions, from observed states built by hand."""

from orchestrator.policy.job import (
    PARKED_CAUSE_GRACE_S,
    Action,
    Decision,
    Observed,
    RankExit,
    Spec,
    decide,
    root_cause,
)
from orchestrator.policy.lifecycle import JobState

SPEC = Spec(world_size=4, max_restarts=2, rendezvous_timeout_s=30.0)
NODES = frozenset({"a", "b"})


def exit_(rank, code=0, sig=0, at=100.0, stopped=False, node="a", tb="", parked=False, heard=0.0):
    return RankExit(
        parked=parked,
        heard_at=heard,
        node=node,
        rank=rank,
        pid=1000 + rank,
        exit_code=code,
        signal=sig,
        exited_at=at,
        stopped_by_agent=stopped,
        traceback=tb,
        last_step=7,
    )


def running(**kw):
    kw.setdefault("generation_world_size", 4)
    return Observed(
        state=JobState.RUNNING, state_since=0.0, restarts=0, generation_nodes=NODES, **kw
    )


def test_pending_waits_for_enough_slots_and_says_how_many():
    d = decide(10.0, Observed(JobState.PENDING, 0.0, 0, free_slots={"a": 2, "b": 0}), SPEC)
    assert d.action is Action.WAIT
    assert d.reason == "2/4 slots free on 1 nodes, need 4"


def test_pending_prepares_when_slots_suffice():
    d = decide(10.0, Observed(JobState.PENDING, 0.0, 0, free_slots={"a": 2, "b": 2}), SPEC)
    assert d.action is Action.PREPARE


def test_a_job_that_lost_capacity_shrinks_to_min_nodes_but_never_at_first_start():
    spec = Spec(world_size=4, max_restarts=2, rendezvous_timeout_s=30.0, min_nodes=1)
    first = Observed(JobState.PENDING, 0.0, 0, generation=0, free_slots={"a": 2})
    assert decide(1.0, first, spec).action is Action.WAIT
    after_loss = Observed(JobState.PENDING, 0.0, 1, generation=1, free_slots={"a": 2})
    d = decide(1.0, after_loss, spec)
    assert d.action is Action.PREPARE and d.shrink
    assert d.reason == (
        "capacity lost and no spare: 2/4 slots free on 1 nodes; re-planning smaller (min_nodes 1)"
    )
    # Without min_nodes the job waits for capacity, and says what it waits for.
    d = decide(1.0, after_loss, SPEC)
    assert d.action is Action.WAIT and d.reason == "2/4 slots free on 1 nodes, need 4"
    spec2 = Spec(world_size=4, max_restarts=2, rendezvous_timeout_s=30.0, min_nodes=2)
    d = decide(1.0, after_loss, spec2)
    assert d.action is Action.WAIT
    assert d.reason == "2/4 slots free on 1 nodes, need 4, or 2 nodes to shrink to"


def test_starting_times_out_without_rendezvous():
    obs = Observed(JobState.STARTING, 0.0, 0, generation_nodes=NODES)
    assert decide(29.0, obs, SPEC).action is Action.WAIT
    d = decide(31.0, obs, SPEC)
    assert d.action is Action.STOP and "no rendezvous endpoint after 31s" in d.reason


def test_starting_starts_once_rendezvous_is_ready():
    obs = Observed(JobState.STARTING, 0.0, 0, generation_nodes=NODES, rendezvous_ready=True)
    assert decide(1.0, obs, SPEC).action is Action.START


def test_root_cause_is_the_earliest_failure_not_the_peers_that_followed():
    exits = (
        exit_(0, code=1, at=101.0, tb="Traceback\nRuntimeError: Connection reset"),
        exit_(1, code=1, at=100.0, tb="Traceback\nRuntimeError: injected crash"),
        exit_(2, code=0, sig=15, at=99.0, stopped=True),
    )
    d = decide(102.0, running(exits=exits), SPEC)
    assert d.action is Action.STOP
    assert d.root_cause.rank == 1
    assert d.reason == (
        "rank 1 (pid 1001) on node a exited with code 1 after step 7: RuntimeError: injected crash"
    )


def test_a_ranks_own_failure_is_the_root_cause_before_a_parked_peer_dated_earlier():
    # The peer parked (dated when it parked) before the SIGKILLed rank was reaped (dated
    # by the last poll that saw it running): the killed rank is still the cause.
    exits = (
        exit_(3, code=1, at=100.0, tb="RuntimeError: Connection closed by peer", parked=True),
        exit_(2, code=-1, sig=9, at=100.3),
    )
    d = decide(102.0, running(exits=exits), SPEC)
    assert d.action is Action.STOP and d.root_cause.rank == 2
    assert d.reason == "rank 2 (pid 1002) on node a killed by signal 9 after step 7"


def test_a_parked_rank_alone_waits_a_moment_for_the_rank_that_failed_then_is_named():
    parked = exit_(3, code=1, tb="RuntimeError: Connection closed by peer", parked=True, heard=50.0)
    waiting = decide(50.0 + PARKED_CAUSE_GRACE_S / 2, running(exits=(parked,)), SPEC)
    assert waiting.action is Action.WAIT
    assert "rank 3 on node a left the generation, which failed under it" in waiting.reason
    d = decide(50.0 + PARKED_CAUSE_GRACE_S, running(exits=(parked,)), SPEC)
    assert d.action is Action.STOP and d.root_cause.rank == 3
    assert d.reason.endswith(
        "exited with code 1 after step 7: RuntimeError: Connection closed by peer"
    )


def test_a_parked_rank_with_a_node_gone_names_the_node_at_once():
    parked = exit_(3, code=1, tb="RuntimeError: Connection closed by peer", parked=True, heard=50.0)
    d = decide(50.0, running(exits=(parked,), unreachable_nodes=frozenset({"b"})), SPEC)
    assert d.action is Action.STOP and d.reason.startswith("node b unreachable; then rank 3")


def test_signal_death_is_named():
    d = decide(1.0, running(exits=(exit_(3, code=-1, sig=9, node="b"),)), SPEC)
    assert d.reason == "rank 3 (pid 1003) on node b killed by signal 9 after step 7"


def test_a_vanished_node_is_named_before_the_peers_that_failed_after_it():
    d = decide(
        1.0,
        running(
            exits=(exit_(0, code=1, tb="RuntimeError: Connection reset"),),
            unreachable_nodes=frozenset({"b"}),
        ),
        SPEC,
    )
    assert d.action is Action.STOP
    assert d.reason.startswith("node b unreachable; then rank 0 (pid 1000) on node a")


def test_ranks_stopped_by_the_agent_are_not_failures():
    assert root_cause((exit_(0, code=-1, sig=15, stopped=True),)) is None


def test_running_succeeds_only_when_every_rank_exited_zero():
    three = tuple(exit_(r) for r in range(3))
    assert decide(1.0, running(exits=three), SPEC).action is Action.WAIT
    d = decide(1.0, running(exits=three + (exit_(3),)), SPEC)
    assert d.action is Action.SUCCEED and d.reason == "all 4 ranks exited 0"


def test_a_shrunken_generation_succeeds_when_its_own_ranks_are_done():
    two = tuple(exit_(r) for r in range(2))
    d = decide(1.0, running(exits=two, generation_world_size=2), SPEC)
    assert d.action is Action.SUCCEED and d.reason == "all 2 ranks exited 0"


def test_lost_node_stops_a_running_generation():
    d = decide(1.0, running(lost_nodes=frozenset({"b"})), SPEC)
    assert d.action is Action.STOP and d.reason == "node b lost"


def test_stopping_waits_for_every_live_node_then_restarts():
    obs = Observed(
        JobState.STOPPING, 0.0, 0, generation_nodes=NODES, stopped_nodes=frozenset({"a"})
    )
    d = decide(1.0, obs, SPEC)
    assert d.action is Action.WAIT and d.reason.endswith(": b")
    obs = Observed(
        JobState.STOPPING,
        0.0,
        1,
        generation_nodes=NODES,
        stopped_nodes=frozenset({"a"}),
        lost_nodes=frozenset({"b"}),
    )
    d = decide(1.0, obs, SPEC)
    assert d.action is Action.RESTART and d.reason == "generation stopped; restart 2/2"


def test_stopping_fails_when_restarts_are_used_up():
    obs = Observed(JobState.STOPPING, 0.0, 2, generation_nodes=NODES, stopped_nodes=NODES)
    d = decide(1.0, obs, SPEC)
    assert d.action is Action.FAIL and "all 2 restarts are used up" in d.reason


def test_a_hang_stops_the_generation_and_asks_for_stacks():
    d = decide(1.0, running(hang="rank 1 made no progress for 5.2 s"), SPEC)
    assert d.action is Action.STOP and d.collect_stacks
    assert d.reason == "rank 1 made no progress for 5.2 s"


def test_a_ready_replacement_stops_the_generation_with_its_reason():
    d = decide(1.0, running(replace="replacing straggler node-1"), SPEC)
    assert d.action is Action.STOP and d.replacement and not d.collect_stacks
    assert d.reason == "replacing straggler node-1"


def test_restarts_back_off_before_the_next_generation():
    obs = Observed(
        JobState.PENDING, 10.0, 2, generation=2, free_slots={"a": 2, "b": 2}, backoff_s=1.0
    )
    d = decide(10.5, obs, SPEC)
    assert d.action is Action.WAIT and d.reason == "backing off 1.0s after restart 2"
    assert decide(11.0, obs, SPEC).action is Action.PREPARE


def test_ranks_that_vanished_with_a_restarted_agent_end_the_generation():
    d = decide(1.0, running(vanished_nodes=frozenset({"b"})), SPEC)
    assert d.action is Action.STOP
    assert d.reason == "the agent of b restarted; its ranks died with it"
    # A peer that failed for want of them is not the root cause.
    d = decide(
        1.0,
        running(
            vanished_nodes=frozenset({"b"}),
            exits=(exit_(0, code=1, node="a", tb="ConnectionResetError"),),
        ),
        SPEC,
    )
    assert d.action is Action.STOP and d.reason.startswith("node b unreachable; then rank 0")


def test_an_operator_stop_cancels_at_once_when_nothing_runs_else_after_the_stop():
    why = "stopped by the operator: maintenance"
    pending = Observed(JobState.PENDING, 0.0, 1, free_slots={"a": 2, "b": 2}, stop_requested=why)
    assert decide(1.0, pending, SPEC) == Decision(Action.CANCEL, why)
    starting = Observed(JobState.STARTING, 0.0, 0, stop_requested=why)
    assert decide(1.0, starting, SPEC).action is Action.STOP
    # Running, it waits for its checkpoint-then-stop to be ready (``replace``) ...
    assert decide(1.0, running(stop_requested=why), SPEC).action is Action.WAIT
    ready = decide(1.0, running(stop_requested=why, replace=why + " after checkpoint"), SPEC)
    assert ready.action is Action.STOP and ready.replacement
    # ... and once every node stopped its ranks, the job ends instead of restarting,
    # even with restarts to spare.
    stopping = Observed(
        JobState.STOPPING, 0.0, 0, generation_nodes=NODES, stopped_nodes=NODES, stop_requested=why
    )
    assert decide(1.0, stopping, SPEC) == Decision(Action.CANCEL, why)
    waiting = Observed(
        JobState.STOPPING,
        0.0,
        0,
        generation_nodes=NODES,
        stopped_nodes=frozenset({"a"}),
        stop_requested=why,
    )
    assert decide(1.0, waiting, SPEC).action is Action.WAIT


def test_a_planned_stop_restarts_without_spending_a_restart():
    spent = Spec(world_size=4, max_restarts=0, rendezvous_timeout_s=30.0)
    stopped = dict(generation_nodes=NODES, stopped_nodes=NODES)
    failed = decide(1.0, Observed(JobState.STOPPING, 0.0, 0, **stopped), spent)
    assert failed.action is Action.FAIL
    planned = decide(1.0, Observed(JobState.STOPPING, 0.0, 0, planned_stop=True, **stopped), spent)
    assert planned.action is Action.RESTART and planned.replacement


def test_with_no_spare_the_job_runs_on_a_suspect_node_and_says_so():
    spec = Spec(world_size=4, max_restarts=2, rendezvous_timeout_s=30.0, min_nodes=0)
    suspect = Observed(
        JobState.PENDING, 0.0, 1, generation=1, free_slots={"a": 2}, suspect_slots={"b": 2}
    )
    d = decide(1.0, suspect, spec)
    assert (d.action, d.reason, d.use_suspects) == (
        Action.PREPARE,
        "4 slots free on 2 nodes, need 4",
        ("b",),
    )
    assert d.alert == "no spare to replace b; restarting on it"
    # A spare makes the suspect unneeded; so does a job that may shrink without it.
    spare = Observed(
        JobState.PENDING, 0.0, 1, generation=1, free_slots={"a": 2, "c": 2}, suspect_slots={"b": 2}
    )
    assert decide(1.0, spare, spec).use_suspects == ()
    shrinkable = Spec(world_size=4, max_restarts=2, rendezvous_timeout_s=30.0, min_nodes=1)
    d = decide(1.0, suspect, shrinkable)
    assert d.action is Action.PREPARE and d.shrink and d.use_suspects == ()
    # The back-off after a failure is not cut short for it.
    backing_off = Observed(
        JobState.PENDING,
        0.0,
        1,
        generation=1,
        free_slots={"a": 2},
        suspect_slots={"b": 2},
        backoff_s=5.0,
    )
    assert decide(1.0, backing_off, spec).action is Action.WAIT
    # Not enough even with it: the job waits, and says for what without counting it.
    few = Observed(
        JobState.PENDING, 0.0, 1, generation=1, free_slots={"a": 1}, suspect_slots={"b": 2}
    )
    d = decide(1.0, few, spec)
    assert (d.action, d.reason) == (Action.WAIT, "1/4 slots free on 1 nodes, need 4")


def test_every_stop_names_what_ended_the_generation():
    crash = exit_(1, code=1)
    cases = [
        (running(exits=(crash,)), "crash"),
        (running(hang="rank 1 made no progress"), "hang"),
        (running(lost_nodes=frozenset({"b"})), "node_lost"),
        (running(vanished_nodes=frozenset({"b"})), "agent_restart"),
        # Peers of a vanished node fail at once: the vanished node's restart is the cause.
        (running(exits=(crash,), vanished_nodes=frozenset({"b"})), "agent_restart"),
        (running(exits=(crash,), unreachable_nodes=frozenset({"b"})), "node_lost"),
        (running(replace="replace straggler b", replace_origin="straggler"), "straggler"),
        (running(replace="drain b"), "operator"),
        (Observed(JobState.STARTING, 0.0, 0, lost_nodes=frozenset({"a"})), "node_lost"),
    ]
    for observed, cause in cases:
        d = decide(10.0, observed, SPEC)
        assert (d.action, d.cause) == (Action.STOP, cause), observed


def test_only_a_shortage_of_slots_is_waiting_for_capacity():
    short = decide(10.0, Observed(JobState.PENDING, 0.0, 0, free_slots={"a": 2}), SPEC)
    assert short.action is Action.WAIT and short.awaits_capacity
    backing_off = decide(
        1.0, Observed(JobState.PENDING, 0.0, 1, backoff_s=5.0, free_slots={"a": 2, "b": 2}), SPEC
    )
    assert backing_off.action is Action.WAIT and not backing_off.awaits_capacity


def test_what_no_restart_can_mend_ends_the_job_failed_with_its_reason():
    why = "/c holds checkpoints of job other (id x): ..."
    # Running (its ranks refused before they started): stopped, never restarted.
    d = decide(1.0, running(fatal=why, exits=(exit_(0, code=1),)), SPEC)
    assert d.action is Action.STOP and d.reason == why and d.root_cause.rank == 0
    stopped = Observed(
        JobState.STOPPING, 0.0, 0, generation_nodes=NODES, stopped_nodes=NODES, fatal=why
    )
    assert decide(1.0, stopped, SPEC) == Decision(Action.FAIL, why)
    # Restarts left or not, and even with slots free.
    pending = Observed(JobState.PENDING, 0.0, 0, free_slots={"a": 4}, fatal=why)
    assert decide(1.0, pending, SPEC) == Decision(Action.FAIL, why)
    # An operator's stop still ends it as the operator asked.
    asked = Observed(
        JobState.STOPPING,
        0.0,
        0,
        generation_nodes=NODES,
        stopped_nodes=NODES,
        fatal=why,
        stop_requested="by hand",
    )
    assert decide(1.0, asked, SPEC).action is Action.CANCEL
