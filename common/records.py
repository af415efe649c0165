"""What Keel stores in etcd: one frozen record type per key (``common.keys``), each with
its own parse (``from_json``) and print (``to_json``) and a schema version. Nothing else
builds or reads stored values.

A value that does not parse raises ``RecordError``, naming the key and what is wrong
with it ("Expected `int`, got `str` - at `$.generation`"); whoever reads it decides what
setting it aside means (a leader keeps leading). Field types are checked strictly on
parse (msgspec); protobuf messages inside a record are stored as protobuf's JSON.

Clocks are in field names: ``*_unix`` is wall-clock seconds since the epoch. There is
one schema version of every record: a stored ``schema`` other than the type's own is
refused like any other value that does not parse.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgspec
from google.protobuf import json_format
from google.protobuf.message import Message

from protos import keel_pb2

R = TypeVar("R", bound="Record")


class RecordError(ValueError):
    """A stored value that does not parse as its key's record."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


def _encode_hook(value: Any) -> Any:
    if isinstance(value, Message):
        return json_format.MessageToDict(value)
    raise NotImplementedError(f"cannot store a {type(value).__name__}")


def _decode_hook(kind: type, value: Any) -> Any:
    if isinstance(kind, type) and issubclass(kind, Message):
        if not isinstance(value, dict):
            raise TypeError(f"expected a {kind.__name__} object, got {type(value).__name__}")
        try:
            return json_format.ParseDict(value, kind())
        except json_format.ParseError as exc:
            raise ValueError(f"not a {kind.__name__}: {exc}") from None
    raise NotImplementedError(f"no stored form for {kind!r}")


_ENCODER = msgspec.json.Encoder(enc_hook=_encode_hook)
_DECODERS: dict[type, msgspec.json.Decoder] = {}


@dataclass(frozen=True, kw_only=True)
class Record:
    """A stored value. ``schema`` is the version of its type's stored form."""

    schema: int = 1
    SCHEMA: ClassVar[int] = 1

    def to_json(self) -> str:
        return _ENCODER.encode(self).decode()

    @classmethod
    def from_json(cls: type[R], key: str, raw: bytes | str) -> R:
        """The record stored at ``key``; raises RecordError with what is wrong."""
        decoder = _DECODERS.get(cls)
        if decoder is None:
            decoder = _DECODERS[cls] = msgspec.json.Decoder(cls, dec_hook=_decode_hook)
        try:
            record = decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise RecordError(key, f"not a {cls.__name__}: {exc}") from None
        except (TypeError, ValueError) as exc:  # raised by a field's own checks
            raise RecordError(key, f"not a {cls.__name__}: {exc}") from None
        if record.schema != cls.SCHEMA:
            raise RecordError(
                key, f"{cls.__name__} of schema {record.schema}; this version reads {cls.SCHEMA}"
            )
        return record

    def replace(self: R, **changes) -> R:
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------ cluster
@dataclass(frozen=True, kw_only=True)
class LeaderRecord(Record):
    """``/keel/controller/leader``: the leading controller, on its lease. Its term is
    the key's create revision, which etcd keeps, not the value; ``epoch``: the
    ``EpochRecord`` it read when it took the key (0: none), which agents compare before
    the term (``common.epoch``)."""

    address: str
    id: str
    epoch: int = 0


@dataclass(frozen=True, kw_only=True)
class EpochRecord(Record):
    """``/keel/epoch``: how many times this cluster's etcd was restored from a snapshot
    (absent: 0), written by ``keel restore-epoch`` only (``common.epoch``). ``at_unix``:
    when; ``by``: who ran it, where; ``restored_revision``: etcd's revision before the
    write (the snapshot's, give or take the restore's own writes); ``previous``: the
    epoch the snapshot held."""

    epoch: int
    previous: int
    at_unix: float
    by: str
    restored_revision: int

    def __post_init__(self):
        if self.epoch <= self.previous or self.previous < 0:
            raise ValueError(
                f"epoch {self.epoch} does not follow epoch {self.previous}: an epoch "
                f"only grows, from 0"
            )


@dataclass(frozen=True, kw_only=True)
class NodeRecord(Record):
    """``/keel/nodes/<node>``: a node's registration, on its agent's lease."""

    host: str
    slots: int
    pid: int
    lease_id: int


@dataclass(frozen=True, kw_only=True)
class CordonRecord(Record):
    """``/keel/cordons/<node>``: no new generation goes to the node. ``drain``: its
    jobs are moved off it too; ``pid``: the agent process that drained its own node on
    its way out (0 when an operator or a policy cordoned it)."""

    reason: str
    by: str
    drain: bool
    at_unix: float
    pid: int = 0


class CertificateState(enum.StrEnum):
    """Where a node's own certificate stands (``policy.certificates``)."""

    PENDING = "pending"  # requested; an operator's approval is awaited
    APPROVED = "approved"  # approved; signed at the node's next request
    ISSUED = "issued"  # signed: a Hello for the node needs this certificate's key
    REVOKED = "revoked"  # no certificate is signed or accepted for the node


@dataclass(frozen=True, kw_only=True)
class CertificateRecord(Record):
    """``/keel/certificates/<node>``: the node's own certificate, as TLS bootstrapping
    left it. ``key_sha256``: the SHA-256 of the node's public key (DER), the request's
    while PENDING, the certificate's once ISSUED ("" when APPROVED without a request);
    ``serial``: the newest certificate's serial number (hex), ``not_after_unix``: when
    it expires; ``by``: who moved it to this state (the controller, or an operator's
    call)."""

    state: CertificateState
    key_sha256: str
    requested_at_unix: float
    changed_at_unix: float
    by: str
    serial: str = ""
    not_after_unix: float = 0.0
    issued: int = 0  # certificates signed for the node so far (renewals included)


# --------------------------------------------------------------------------- jobs
@dataclass(frozen=True, kw_only=True)
class JobSpecRecord(Record):
    """``/keel/jobs/<job>/spec``: the job as submitted, and ``job_id``, the unique id
    the controller gave it then: the id of the lineage its checkpoints belong to ("" in
    a record written before jobs had ids; the leader that reads one gives it an id)."""

    spec: keel_pb2.JobSpec
    job_id: str = ""


class JobState(str, enum.Enum):
    """A job's lifecycle state (the transitions are ``orchestrator.policy.lifecycle``'s)."""

    PENDING = "PENDING"  # waiting for enough free slots for the next generation
    STARTING = "STARTING"  # nodes chosen, waiting for the rendezvous endpoint
    RUNNING = "RUNNING"  # plan written to etcd, ranks started
    STOPPING = "STOPPING"  # a generation is being torn down after a failure
    SUCCEEDED = "SUCCEEDED"  # every rank of a generation exited 0
    FAILED = "FAILED"  # restarts exhausted or the spec cannot be run
    CANCELLED = "CANCELLED"  # stopped by an operator

    @property
    def holds_nodes(self) -> bool:
        """A generation is placed on nodes: being started, running, or being stopped."""
        return self in (JobState.STARTING, JobState.RUNNING, JobState.STOPPING)

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True, kw_only=True)
class GoodputRecord(Record):
    """Where a job's wall time went, as of the last transition (``controller.goodput``):
    seconds per bucket from ``start_unix`` to ``cursor_unix``, the phase then, and the
    steps whose productive time is at risk until a checkpoint covers them
    (``[last step, seconds]`` each, oldest first)."""

    start_unix: float
    cursor_unix: float
    seconds: dict[str, float]
    phase: str
    ran: bool
    ended: bool
    at_risk: list[tuple[int, float]]
    generation: int
    world_size: int
    last_step: int


@dataclass(frozen=True, kw_only=True)
class JobStateRecord(Record):
    """``/keel/jobs/<job>/state``: lifecycle state, generation, restarts, the
    operator's stop and the job's accounting, written at each transition."""

    state: JobState
    generation: int
    restarts: int
    reason: str
    failures: list[keel_pb2.Failure]
    initial_loss: float | None
    stop_requested: str
    stop_now: bool
    planned_stop: bool
    ended_at_unix: float | None
    goodput: GoodputRecord
    restarts_by_cause: dict[str, int]
    checkpoint_problems: dict[str, int]
    state_seconds: dict[str, float]
    state_entered_at_unix: float
    tokens: int
    step: int


@dataclass(frozen=True, kw_only=True)
class PlanRecord(Record):
    """``/keel/jobs/<job>/generations/<g>``: where generation g's ranks go, written
    with the move to STARTING and again with the rendezvous endpoint (master_port > 0)
    with the move to RUNNING. ``agents``: the agent pid each node's ranks are planned
    for; ``restore_from``: the checkpoint path it restores ("" for a fresh start)."""

    generation: int
    world_size: int
    master_addr: str
    master_port: int
    nodes: dict[str, list[int]]
    restore_from: str
    restore_fallbacks: list[str]
    command: list[str]
    mesh: str
    agents: dict[str, int]
    deadlines: keel_pb2.Deadlines | None = None
    created_at_unix: float


@dataclass(frozen=True, kw_only=True)
class PlanPartsRecord(Record):
    """``/keel/jobs/<job>/generations/<g>`` in place of a PlanRecord too large for one
    etcd request (tens of thousands of nodes): that plan's JSON, ``size`` bytes whose
    SHA-256 is ``sha256``, is stored cut in ``parts`` values at
    ``generations/<g>/parts/<sha256>/<i>``, written before this record, which is
    written with the job's state (``orchestrator.controller.store``)."""

    generation: int
    parts: int
    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class CheckpointRecord(Record):
    """``/keel/jobs/<job>/checkpoints/<step>``: a committed checkpoint. A quarantined
    one failed verification on restore and is never a restore point again."""

    step: int
    path: str
    generation: int
    samples: int
    recorded_at_unix: float
    quarantined: bool = False
    quarantine_reason: str = ""


@dataclass(frozen=True, kw_only=True)
class MemorySnapshotRecord(Record):
    """``/keel/jobs/<job>/memory_snapshot``: the newest memory snapshot
    (``trainer.memory_tier``) every node of its generation committed, and ``nodes``,
    the nodes whose agents hold it. It is restorable while every one of them does; and
    ``replica_step``, the newest of the generation's snapshots whose copy is whole on
    ``replica_node``, a partner (0: none): a generation placed without one of the
    nodes restores that copy, or the durable checkpoint (``policy.memory_snapshots``),
    and the record goes."""

    step: int
    generation: int
    samples: int
    bytes: int
    nodes: tuple[str, ...]
    recorded_at_unix: float
    replica_step: int = 0
    replica_node: str = ""


@dataclass(frozen=True, kw_only=True)
class EventRecord(Record):
    """``/keel/jobs/<job>/events/<seq>``: a detection or an action."""

    event: keel_pb2.Event


@dataclass(frozen=True, kw_only=True)
class OperationRecord(Record):
    """``/keel/jobs/<job>/operation``: the checkpoint-then-stop under way for a
    generation (a replacement, an exclusion, a drain): the intent, not a leader's
    progress on it (``policy.operations.Operation``)."""

    node: str
    reason: str
    policy: str
    generation: int
    with_node: str = ""
    checkpoint: bool = True
    origin: str = "operator"


@dataclass(frozen=True, kw_only=True)
class CheckpointRequestRecord(Record):
    """``/keel/jobs/<job>/checkpoint_request``: an operator's "checkpoint now" of a
    step after ``after_step`` in ``generation``, not yet met."""

    generation: int
    after_step: int
    reason: str


def newest_good(records: list[CheckpointRecord]) -> CheckpointRecord | None:
    """The newest of ``records`` (oldest first) that is not quarantined, or None."""
    return next((r for r in reversed(records) if not r.quarantined), None)
