"""What the controller keeps instead of recomputing, checked against recomputing: the
node tables' version (``CountedDict``), a job's placement index and the reconcile
loop's record of each job's plan, after random sequences of changes."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.reconcile import Reconciler
from orchestrator.controller.state import ControllerState, CountedDict
from orchestrator.controller.store import Store
from orchestrator.policy.lifecycle import JobState
from orchestrator.policy.placement import NodeRanks
from protos import keel_pb2

# The dict methods that only read: every other one can change a dict.
READS = {
    "__class_getitem__",
    "__contains__",
    "__eq__",
    "__ge__",
    "__getattribute__",
    "__getitem__",
    "__gt__",
    "__hash__",
    "__iter__",
    "__le__",
    "__len__",
    "__lt__",
    "__ne__",
    "__new__",
    "__or__",
    "__repr__",
    "__reversed__",
    "__ror__",
    "__sizeof__",
    "copy",
    "fromkeys",
    "get",
    "items",
    "keys",
    "values",
}


def controller_state() -> ControllerState:
    return ControllerState(
        ControllerConfig(etcd_endpoints=("127.0.0.1:2379",), token="t"), Store(client=None)
    )


def test_every_dict_method_that_can_change_it_is_counted():
    """A method a dict has that CountedDict does not override could change a node table
    unseen; each one that is not a read is overridden."""
    assert {name for name in vars(dict) if name not in READS} <= set(vars(CountedDict))


KEYS = st.sampled_from(["a", "b", "c", "d"])
VALUES = st.integers(0, 3).map(lambda n: {"slots": n})
TABLES = st.sampled_from(["sessions", "registered", "cordons"])
OPERATIONS = st.one_of(
    st.tuples(st.just("__setitem__"), KEYS, VALUES),
    st.tuples(st.just("__delitem__"), KEYS),
    st.tuples(st.just("__ior__"), st.dictionaries(KEYS, VALUES, max_size=2)),
    st.tuples(st.just("pop"), KEYS),
    st.tuples(st.just("pop"), KEYS, VALUES),
    st.tuples(st.just("popitem")),
    st.tuples(st.just("clear")),
    st.tuples(st.just("update"), st.dictionaries(KEYS, VALUES, max_size=2)),
    st.tuples(st.just("setdefault"), KEYS, VALUES),
    st.tuples(st.just("replace"), st.dictionaries(KEYS, VALUES, max_size=3)),
    st.tuples(st.just("read"), KEYS),
)


def apply(table, operation):
    """``operation`` on ``table``: what it returned, or the type of what it raised."""
    name, *args = operation
    try:
        if name == "read":
            return table.get(*args)
        return getattr(table, name)(*args)
    except KeyError:
        return KeyError


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(TABLES, OPERATIONS), max_size=40))
def test_a_cache_kept_while_the_nodes_version_stands_is_what_the_tables_hold(steps):
    """After any sequence of changes through any dict method, or a table put in place
    whole, what was built at the current ``nodes_version`` is what building it again
    gives; and each table answers as a plain dict given the same changes."""
    state = controller_state()
    plain = {name: {} for name in ("sessions", "registered", "cordons")}

    def build():
        return {name: dict(getattr(state, name)) for name in plain}

    cache = (state.nodes_version(), build())
    for name, operation in steps:
        if operation[0] == "replace":
            setattr(state, name, dict(operation[1]))
            plain[name] = dict(operation[1])
        else:
            assert apply(getattr(state, name), operation) == apply(plain[name], operation)
        if state.nodes_version() != cache[0]:
            cache = (state.nodes_version(), build())
        assert cache[1] == build() == plain


def job(name: str = "j") -> JobRuntime:
    spec = keel_pb2.JobSpec(name=name, world_size=2, steps=10)
    return JobRuntime.new(spec, JobState.RUNNING, 1, 0.0)


@st.composite
def placements(draw):
    """A placement as a plan gives one: distinct nodes, contiguous ranks from 0."""
    nodes = draw(st.lists(st.sampled_from("abcdef"), unique=True, max_size=4))
    parts, rank = [], 0
    for node in nodes:
        width = draw(st.integers(1, 3))
        parts.append(NodeRanks(node, tuple(range(rank, rank + width))))
        rank += width
    return parts


@settings(max_examples=100, deadline=None)
@given(st.lists(placements(), min_size=1, max_size=6), st.data())
def test_a_jobs_placement_index_is_what_a_search_of_the_placement_gives(plans, data):
    """Each new plan's placement is put in place whole (often in memory a previous list
    was freed from); the index then answers as searching the placement does."""
    runtime = job()
    for placement in plans:
        runtime.placement = placement
        if data.draw(st.booleans()):
            continue  # replaced again before it is read
        assert runtime.nodes == frozenset(part.node for part in placement)
        for node in "abcdefg":
            assert runtime.part_on(node) == next((p for p in placement if p.node == node), None)
            assert runtime.ranks_on_node(node) == frozenset(
                rank for p in placement if p.node == node for rank in p.ranks
            )
        for part in placement:
            assert runtime.group_rank(part) == placement.index(part)
            assert runtime.group_rank(NodeRanks(part.node, part.ranks)) == placement.index(part)


def content(runtime: JobRuntime) -> tuple:
    """Everything a job's plan is made of, by value."""
    return (
        runtime.state,
        runtime.generation,
        tuple(runtime.placement),
        json.dumps(runtime.placed_agents, sort_keys=True),
        frozenset(runtime.lost_nodes),
        frozenset(runtime.stopped_nodes),
        frozenset(runtime.vanished),
    )


CHANGES = st.one_of(
    st.tuples(st.just("placement"), placements()),
    st.tuples(st.just("same placement again"), st.none()),
    st.tuples(st.just("placed agents"), st.dictionaries(st.sampled_from("abc"), st.integers(1, 3))),
    st.tuples(st.just("state"), st.sampled_from([JobState.RUNNING, JobState.STOPPING])),
    st.tuples(st.just("generation"), st.none()),
    st.tuples(st.just("lost"), st.sampled_from("abcdef")),
    st.tuples(st.just("stopped"), st.sampled_from("abcdef")),
    st.tuples(st.just("vanished"), st.sampled_from("abcdef")),
    st.tuples(st.just("ended"), st.none()),
    st.tuples(st.just("submitted"), st.none()),
)


def change(state: ControllerState, name: str, kind: str, value) -> None:
    """One change to job ``name`` as the controller makes it: a plan's placement and
    placed agents are put in place whole; lost, stopped and vanished nodes grow within
    a generation and are emptied when the next one is placed."""
    runtime = state.jobs.get(name)
    if kind == "submitted":
        state.jobs.setdefault(name, job(name))
    elif runtime is None:
        return
    elif kind == "ended":
        del state.jobs[name]
    elif kind == "placement":
        runtime.placement = value
    elif kind == "same placement again":
        runtime.placement = list(runtime.placement)
    elif kind == "placed agents":
        runtime.placed_agents = value
    elif kind == "state":
        runtime.state = value
    elif kind == "generation":
        runtime.generation += 1
        runtime.lost_nodes.clear()
        runtime.stopped_nodes.clear()
        runtime.vanished.clear()
    elif kind == "lost":
        runtime.lost_nodes.add(value)
    elif kind == "stopped":
        runtime.stopped_nodes.add(value)
    else:
        runtime.vanished[value] = [0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from(["j", "k"]), CHANGES), max_size=4), max_size=12))
def test_the_nodes_of_every_job_whose_plan_moved_are_looked_at(ticks):
    """Between ticks, random changes to two jobs; at each tick every node of a job
    whose plan differs by value from the last tick's (its nodes then and now) is looked
    at, and no node is when no job was changed."""
    state = controller_state()
    state.jobs["j"] = job("j")
    reconciler = Reconciler(state, leadership=None, executor=None)
    reconciler._unsettle_moved_jobs()
    seen = {name: (content(runtime), runtime.nodes) for name, runtime in state.jobs.items()}
    for changes in ticks:
        for name, (kind, value) in changes:
            change(state, name, kind, value)
        state.unsettled.clear()
        reconciler._unsettle_moved_jobs()
        now = {name: (content(runtime), runtime.nodes) for name, runtime in state.jobs.items()}
        for name in seen.keys() | now.keys():
            before, after = seen.get(name), now.get(name)
            if before is None or after is None or before[0] != after[0]:
                assert (before[1] if before else set()) <= state.unsettled
                assert (after[1] if after else set()) <= state.unsettled
        if not changes:
            assert state.unsettled == set()
        seen = now
