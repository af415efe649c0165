"""The etcd key layout: every key Keel reads or writes, spelled once.

    /keel/controller/leader                the leading controller: {"address", "id", "epoch"},
                                           on its lease
    /keel/epoch                            the restores of etcd from a snapshot, counted
                                           (``keel restore-epoch``; ``common.epoch``)
    /keel/nodes/<node>                     a node's registration, on its agent's lease
    /keel/cordons/<node>                   a cordoned (or draining) node: why, by whom, since when
    /keel/certificates/<node>              the node's own certificate (TLS bootstrapping):
                                           requested, approved, issued or revoked
    /keel/jobs/<job>/spec                  the submitted job spec
    /keel/jobs/<job>/state                 lifecycle state, generation, restarts, the
                                           operator's stop
    /keel/jobs/<job>/generations/<g>       the plan of generation g
    /keel/jobs/<job>/checkpoints/<step>    committed checkpoint records
    /keel/jobs/<job>/memory_snapshot       the newest complete memory snapshot, and the
                                           nodes that hold it
    /keel/jobs/<job>/events/<seq>          detections and actions, numbered per job
    /keel/jobs/<job>/operation             the checkpoint-then-stop under way (replace, drain, ...)
    /keel/jobs/<job>/checkpoint_request    an operator's "checkpoint now" not yet satisfied

Numbers in keys are zero-padded so that a key range lists them in order. Each key's
value is its record of ``common.records`` (JSON), read and written as that type only.
"""

from __future__ import annotations

import re

PREFIX = "/keel"
# What a node may be called: in its key, in Hello and in its agent's certificate.
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
NODE_NAME_RULE = "use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
# What a job may be called: in its keys and in its ranks' log directories on every node.
JOB_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
JOB_NAME_RULE = (
    "use 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"
)
LEADER = f"{PREFIX}/controller/leader"
EPOCH = f"{PREFIX}/epoch"
NODES = f"{PREFIX}/nodes/"
CORDONS = f"{PREFIX}/cordons/"
CERTIFICATES = f"{PREFIX}/certificates/"
JOBS = f"{PREFIX}/jobs/"


def local_node(index: int) -> str:
    """The name ``keel up`` gives its node ``index`` (from 0, as ``--inject`` counts)."""
    return f"node-{index}"


def node(name: str) -> str:
    return NODES + name


def cordon(name: str) -> str:
    return CORDONS + name


def certificate(name: str) -> str:
    return CERTIFICATES + name


def job(name: str) -> str:
    """The prefix of every key of job ``name``."""
    return f"{JOBS}{name}/"


def job_spec(name: str) -> str:
    return job(name) + "spec"


def job_state(name: str) -> str:
    return job(name) + "state"


def plans(name: str) -> str:
    """The prefix of every generation's plan of job ``name`` (and their parts)."""
    return job(name) + "generations/"


def plan(name: str, generation: int) -> str:
    return plans(name) + f"{generation}"


def plan_parts(name: str, generation: int, digest: str = "") -> str:
    """The prefix of the parts of generation ``generation``'s plan too large for one
    value (``common.records.PlanPartsRecord``); with ``digest``, of that plan's."""
    return plan(name, generation) + "/parts/" + (f"{digest}/" if digest else "")


def checkpoints(name: str) -> str:
    return job(name) + "checkpoints/"


def checkpoint(name: str, step: int) -> str:
    return checkpoints(name) + f"{step:012d}"


def memory_snapshot(name: str) -> str:
    return job(name) + "memory_snapshot"


def events(name: str) -> str:
    return job(name) + "events/"


def event(name: str, seq: int) -> str:
    return events(name) + f"{seq:012d}"


def operation(name: str) -> str:
    return job(name) + "operation"


def checkpoint_request(name: str) -> str:
    return job(name) + "checkpoint_request"


# What each key holds, as a bounded label (``kind_of``).
KINDS = (
    "leader",
    "epoch",
    "node",
    "cordon",
    "certificate",
    "job_spec",
    "job_state",
    "plan",
    "checkpoint",
    "memory_snapshot",
    "event",
    "operation",
    "checkpoint_request",
    "other",
)


def kind_of(key: str) -> str:
    """Which of ``KINDS`` ``key`` is."""
    if key == LEADER:
        return "leader"
    if key == EPOCH:
        return "epoch"
    if key.startswith(NODES):
        return "node"
    if key.startswith(CORDONS):
        return "cordon"
    if key.startswith(CERTIFICATES):
        return "certificate"
    job = job_of(key)
    if job is None:
        return "other"
    rest = key[len(JOBS) + len(job) + 1 :]
    part = rest.split("/", 1)[0]
    named = {"spec": "job_spec", "state": "job_state", "generations": "plan"}
    found = named.get(part, part.removesuffix("s"))
    return found if found in KINDS else "other"


def last_part(key: str) -> str:
    """The node name of a node or cordon key; the last part of any key."""
    return key.rsplit("/", 1)[1]


def job_of(key: str) -> str | None:
    """The job a key under ``JOBS`` belongs to, or None for other keys."""
    if not key.startswith(JOBS):
        return None
    return key[len(JOBS) :].split("/", 1)[0]
