"""The ``--inject`` fault grammar: ``KIND:key=value,...``, parsed into a FaultSchedule.

Rank faults, applied by the trainer when the step starts:
    crash:rank=R,step=N          the rank raises an exception
    crash:node=I,step=N          every rank on node I raises, in every generation that
                                 runs there: a node that fails whatever runs on it
    kill:rank=R,step=N           the rank SIGKILLs itself
    hang:rank=R,step=N           the rank stops making progress
    slow:rank=R,step=N,factor=F  from step N the rank's steps take F times as long

Cluster faults, applied by `keel up` once rank 0 has reported step N:
    lose_node:node=I,step=N      node I's agent and all its ranks are SIGKILLed at once
    kill_leader:step=N           the leading controller is SIGKILLed (a standby takes over)
    restart_etcd:step=N[,down=S] etcd is SIGKILLed and started again on its data S s
                                 later (default 2; past the 5 s leader lease, the
                                 controller steps down and leads again when etcd is back)
    kill_agent:node=I,step=N     node I's agent is SIGKILLed (its ranks die with it) and
                                 started again on the same node
    term_agent:node=I,step=N     node I's agent is sent SIGTERM, as a scheduler shutting
                                 the node down would: it drains the node (a checkpoint,
                                 then the job moves to a spare or shrinks) and exits
    term_leader:step=N           the leading controller is sent SIGTERM: it hands the
                                 lead over at once instead of letting its lease lapse
    stall_leader:step=N,for=S    the leading controller is SIGSTOPped, and SIGCONTed S s
                                 later (a standby takes over meanwhile; the old leader
                                 wakes superseded)
    stall_agent:node=I,step=N,for=S
                                 node I's agent alone is SIGSTOPped for S s; its ranks
                                 keep running
    stall_node:node=I,step=N,for=S
                                 node I's agent and every process under it (its ranks)
                                 are SIGSTOPped for S s: a frozen host
    partition_node:node=I,step=N,for=S
                                 node I is cut from etcd and the controllers for S s
                                 while it keeps running (keel up then runs each node's
                                 agent behind a TCP proxy of its own, and the proxy
                                 drops every connection and refuses new ones)
"""

from __future__ import annotations

from common.wire_kinds import WIRE_FAULT_KINDS, FaultKind
from protos import keel_pb2

FIELDS = {
    FaultKind.CRASH: {"rank", "step"},
    FaultKind.KILL: {"rank", "step"},
    FaultKind.HANG: {"rank", "step"},
    FaultKind.SLOW: {"rank", "step", "factor"},
    FaultKind.LOSE_NODE: {"node", "step"},
    FaultKind.KILL_LEADER: {"step"},
    FaultKind.RESTART_ETCD: {"step"},
    FaultKind.KILL_AGENT: {"node", "step"},
    FaultKind.TERM_AGENT: {"node", "step"},
    FaultKind.TERM_LEADER: {"step"},
    FaultKind.STALL_LEADER: {"step", "for"},
    FaultKind.STALL_AGENT: {"node", "step", "for"},
    FaultKind.STALL_NODE: {"node", "step", "for"},
    FaultKind.PARTITION_NODE: {"node", "step", "for"},
}
OPTIONAL = {FaultKind.RESTART_ETCD: {"down"}}
# A field that may stand in for a required one (at most one of the two is given).
IN_PLACE_OF = {FaultKind.CRASH: {"node": "rank"}}
# Fired by `keel up` itself rather than by a rank.
CLUSTER_FAULTS = frozenset(
    {
        FaultKind.LOSE_NODE,
        FaultKind.KILL_LEADER,
        FaultKind.RESTART_ETCD,
        FaultKind.KILL_AGENT,
        FaultKind.TERM_AGENT,
        FaultKind.TERM_LEADER,
        FaultKind.STALL_LEADER,
        FaultKind.STALL_AGENT,
        FaultKind.STALL_NODE,
        FaultKind.PARTITION_NODE,
    }
)


class BadFault(ValueError):
    pass


def kind_of(fault: keel_pb2.Fault) -> FaultKind:
    """What ``fault`` (one ``parse_fault`` made) does."""
    return WIRE_FAULT_KINDS.from_wire(fault.kind)


def parse_fault(text: str) -> keel_pb2.Fault:
    name, sep, rest = text.strip().partition(":")
    if name not in FIELDS:
        raise BadFault(
            f"fault {text!r}: kind must be one of {', '.join(sorted(k.value for k in FIELDS))}"
        )
    kind = FaultKind(name)
    stand_ins = IN_PLACE_OF.get(kind, {})
    allowed = FIELDS[kind] | OPTIONAL.get(kind, set()) | stand_ins.keys()
    if not sep or not rest:
        raise BadFault(
            f"fault {text!r}: write it as {kind.value}:"
            + ",".join(f"{f}=..." for f in sorted(FIELDS[kind]))
        )
    values = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed or key in values:
            raise BadFault(
                f"fault {text!r}: {item!r} is not one of {', '.join(sorted(allowed))} (each once)"
            )
        values[key] = value
    replaced = {stand_ins[key] for key in values.keys() & stand_ins.keys()}
    both = replaced & values.keys()
    if both:
        (field,) = both
        other = next(k for k, v in stand_ins.items() if v == field)
        raise BadFault(f"fault {text!r}: give {field} or {other}, not both")
    missing = FIELDS[kind] - replaced - values.keys()
    if missing:
        either = {v: k for k, v in stand_ins.items()}
        named = [f"{m} (or {either[m]})" if m in either else m for m in sorted(missing)]
        raise BadFault(f"fault {text!r}: missing {', '.join(named)}")
    fault = keel_pb2.Fault(kind=WIRE_FAULT_KINDS.to_wire(kind))
    try:
        for key in ("rank", "node", "step"):
            if key not in values:
                continue
            number = int(values[key])
            if number < 0 or (key == "step" and number < 1):
                raise ValueError
            setattr(fault, key, number)
        if "factor" in values:
            fault.factor = float(values["factor"])
            if not 1.0 < fault.factor <= 100.0:
                raise ValueError
        if "down" in values:
            fault.down_s = float(values["down"])
            if not 0 < fault.down_s <= 600:
                raise ValueError
        if "for" in values:
            fault.for_s = float(values["for"])
            if not 0 < fault.for_s <= 600:
                raise ValueError
    except ValueError:
        raise BadFault(
            f"fault {text!r}: rank and node are integers >= 0, step an integer "
            f">= 1, factor a number in (1, 100], down and for seconds in (0, 600]"
        ) from None
    return fault


def parse_schedule(texts: list[str], world_size: int, nodes: int) -> keel_pb2.FaultSchedule:
    """Parse every ``--inject`` value; ranks and nodes must exist in the cluster."""
    schedule = keel_pb2.FaultSchedule()
    for text in texts:
        fault = parse_fault(text)
        if fault.HasField("rank") and fault.rank >= world_size:
            raise BadFault(
                f"fault {text!r}: rank {fault.rank} does not exist at world size {world_size}"
            )
        if fault.HasField("node") and fault.node >= nodes:
            raise BadFault(
                f"fault {text!r}: node {fault.node} does not exist in a cluster of "
                f"{nodes} nodes (they are numbered from 0)"
            )
        schedule.faults.append(fault)
    return schedule
