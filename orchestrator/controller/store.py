"""The controller's view of etcd: the only state that must survive a controller.

Every key is in ``common.keys``; every value is its key's record of ``common.records``,
read and written as that type only. Writes happen on membership and generation changes
only, never per step.

A value that does not parse is reported to ``set_aside`` (the controller logs and counts
it); a read of one key then raises ``RecordError``, a read of a prefix passes over it
and returns the rest, so one bad value never keeps a controller from reading the
others, or from leading.

Fencing: a leader's term is the create revision of its leader key, fixed when the key
is created and larger for every later leader. Every write of a leader is a transaction
that also compares the leader key's create revision with its term, so a write of a
controller that has been superseded (it stalled, and another took over) fails, and
raises ``Deposed``; the controller then steps down at once. Writes that decide
something compare the revision they read as well (``StaleRevision`` when it moved).

No request passes a set fraction of etcd's limits (``--max-request-bytes``, 1.5 MiB,
and ``--max-txn-ops``, 128, by default), however many nodes a job has: a plan larger
than ``PART_BYTES`` is stored in parts, written ``PARTS_PER_WRITE`` a transaction
before the small record naming them (``PlanPartsRecord``) is written with the job's
state; a plan is read back whole, checked against its digest. Writing a generation's
plan deletes every other generation's (in the same transaction: a few range deletes),
so a job's plans do not grow with its generations.

The epoch (``/keel/epoch``, ``common.epoch``) is read when the lead is taken and named
in the leader record: agents compare (epoch, term), and the generations this controller
starts are numbered from the epoch's first, so that after a restore of etcd from a
snapshot both are above anything seen before it.

Reads of a prefix are paginated (``common.etcd.read_prefix``: ``PAGE`` keys a call,
fewer if a page of large values would pass the message limit) at one revision, so
however much a prefix holds, a new leader can read it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import structlog

from common import keys
from common.etcd import EtcdClient, prefix_end, read_prefix
from common.leader import Leader, parse_leader
from common.records import (
    CertificateRecord,
    CheckpointRecord,
    CheckpointRequestRecord,
    CordonRecord,
    EpochRecord,
    EventRecord,
    JobSpecRecord,
    JobStateRecord,
    LeaderRecord,
    MemorySnapshotRecord,
    NodeRecord,
    OperationRecord,
    PlanPartsRecord,
    PlanRecord,
    Record,
    RecordError,
)

log = structlog.get_logger()

R = TypeVar("R", bound=Record)

TXN_OPS = 100  # etcd refuses transactions of more than 128 operations by default
TXN_BYTES = 1 << 20  # and requests over 1.5 MiB
PART_BYTES = 256 * 1024  # a plan over this is stored in parts of this size,
PARTS_PER_WRITE = 2  # written this many a transaction (a third of etcd's request limit)


class StaleRevision(Exception):
    """A guarded write lost: the key changed since it was read."""


class Deposed(Exception):
    """This controller no longer holds the leader key it led with: another leads."""


@dataclass(frozen=True)
class Versioned(Generic[R]):
    """A record with the mod revision it was read at (None and 0: absent)."""

    value: R | None
    mod_revision: int


def part_key(name: str, generation: int, digest: str, index: int) -> str:
    return keys.plan_parts(name, generation, digest) + f"{index:06d}"


def parts_record(key: str, raw: bytes) -> PlanPartsRecord | None:
    """The value at a plan's key as the record naming its parts, or None if it is not
    one (it is the plan itself)."""
    if len(raw) > 1024 or b'"sha256"' not in raw:
        return None
    try:
        return PlanPartsRecord.from_json(key, raw)
    except RecordError:
        return None  # a small plan that happens to say "sha256"


def log_set_aside(error: RecordError) -> None:
    log.error("set aside a stored value that does not parse", key=error.key, error=error.problem)


class Store:
    def __init__(
        self, client: EtcdClient, set_aside: Callable[[RecordError], None] = log_set_aside
    ):
        """``set_aside``: told of each value a prefix read passes over."""
        self.client = client
        self.set_aside = set_aside
        self.term: int | None = None  # while leading: the create revision of our leader key
        self.epoch = 0  # the epoch of the last campaign won (``common.epoch``)
        self._epoch_seen: Versioned[EpochRecord] = Versioned(None, 0)  # none written yet

    # ------------------------------------------------------------------ helpers
    def _get(self, key: str, kind: type[R]) -> Versioned[R]:
        """The record at ``key``; one that does not parse is reported to ``set_aside``
        and raises RecordError."""
        raw, meta = self.client.get(key)
        return self._parse(key, kind, [] if raw is None else [(raw, meta)])

    def _parse(self, key: str, kind: type[R], found: list) -> Versioned[R]:
        """The record in ``found`` (a range read's ``(value, meta)`` pairs, none if the
        key is absent); one that does not parse is reported to ``set_aside`` and raises
        RecordError."""
        if not found:
            return Versioned(None, 0)
        raw, meta = found[0]
        try:
            return Versioned(kind.from_json(key, raw), meta.mod_revision)
        except RecordError as error:
            self.set_aside(error)
            raise

    def _prefix(
        self,
        prefix: str,
        kind: type[R],
        instead: Callable[[str, RecordError], R | None] = lambda key, error: None,
    ) -> dict[str, R]:
        """Every record under ``prefix`` by key, in key order, read page by page at
        the revision of the first page. A value that does not parse is set aside, and
        ``instead(key, error)`` stands for it, unless that is None."""
        kvs, _, _ = read_prefix(self.client, prefix)
        found = {}
        for kv in kvs:
            key = kv.key.decode()
            try:
                found[key] = kind.from_json(key, kv.value)
            except RecordError as error:
                self.set_aside(error)
                standing = instead(key, error)
                if standing is not None:
                    found[key] = standing
        return found

    def _keys(self, prefix: str) -> list[str]:
        kvs, _, _ = read_prefix(self.client, prefix, keys_only=True)
        return [kv.key.decode() for kv in kvs]

    def _write(self, success: list, compare: tuple = ()) -> tuple[bool, list]:
        """Apply ``success`` if this controller still leads (and ``compare`` holds);
        raise Deposed if it does not lead; (whether ``compare`` held, responses)."""
        if self.term is None:
            raise Deposed("this controller does not lead")
        tx = self.client.transactions
        ok, responses = self.client.transaction(
            compare=[tx.create(keys.LEADER) == self.term, *compare],
            success=success,
            failure=[tx.get(keys.LEADER)],
        )
        if not ok:
            leader = responses[0]
            if not leader or leader[0][1].create_revision != self.term:
                held = leader[0][0].decode(errors="replace") if leader else "gone"
                raise Deposed(f"the leader key is now {held}; our term {self.term} is over")
        return ok, responses

    def _put(self, key: str, record: Record, **kwargs):
        return self.client.transactions.put(key, record.to_json(), **kwargs)

    # -------------------------------------------------------------------- nodes
    def put_node(self, node: str, record: NodeRecord, lease_id: int) -> None:
        """Write a node record on the agent's lease, so it vanishes with the agent."""
        self._write([self._put(keys.node(node), record, lease=lease_id)])

    def probe(self) -> None:
        """One small read (the leader key), raising if etcd does not answer it."""
        self.client.get(keys.LEADER)

    def nodes(self) -> dict[str, NodeRecord]:
        """Registered nodes by name (records whose lease is still alive)."""
        return {keys.last_part(k): v for k, v in self._prefix(keys.NODES, NodeRecord).items()}

    def lease_alive(self, lease_id: int) -> bool:
        info = self.client.get_lease_info(lease_id)
        return info.TTL > 0

    def cordon(self, node: str, record: CordonRecord) -> None:
        """Keep new generations off ``node``."""
        self._write([self._put(keys.cordon(node), record)])

    def uncordon(self, node: str) -> None:
        """Lift a cordon."""
        self._write([self.client.transactions.delete(keys.cordon(node))])

    # ------------------------------------------------------ nodes' certificates
    def certificate(self, node: str) -> Versioned[CertificateRecord]:
        """Node ``node``'s certificate record (value None: none), with its revision;
        raises RecordError for one that does not parse."""
        return self._get(keys.certificate(node), CertificateRecord)

    def put_certificate(self, node: str, record: CertificateRecord, seen_revision: int) -> bool:
        """Store ``record`` if the node's record is still at ``seen_revision`` (0: none
        was); False if another write came first."""
        tx = self.client.transactions
        ok, _ = self._write(
            [self._put(keys.certificate(node), record)],
            compare=(tx.mod(keys.certificate(node)) == seen_revision,),
        )
        return ok

    def certificates(self) -> dict[str, CertificateRecord]:
        """Every node's certificate record by node; one that does not parse is set
        aside (logged) and left out."""
        found = self._prefix(keys.CERTIFICATES, CertificateRecord)
        return {keys.last_part(key): record for key, record in found.items()}

    def cordons(self) -> dict[str, CordonRecord]:
        """Every cordon by node. A cordon whose value does not parse still keeps its
        node cordoned (the key says an operator or a policy wanted it off), with a
        reason that says so; ``keel uncordon`` deletes it."""

        def still_cordoned(key: str, error: RecordError) -> CordonRecord:
            return CordonRecord(
                reason=f"its cordon record does not parse ({error.problem}); "
                f"`keel uncordon {keys.last_part(key)}` lifts it",
                by="unreadable record",
                drain=False,
                at_unix=0.0,
            )

        found = self._prefix(keys.CORDONS, CordonRecord, still_cordoned)
        return {keys.last_part(key): record for key, record in found.items()}

    # ------------------------------------------------------------------- leader
    def campaign(self, controller_id: str, address: str, lease_id: int) -> int | None:
        """Take the leader key on ``lease_id`` if nobody holds it, or if it is still
        ours (we stepped down while etcd was out of reach, and nobody led since: the
        term is then unchanged). Returns the term we lead with, or None. The epoch is
        named in the leader record and kept in ``epoch``: the key is taken only if the
        epoch record is the one this store last saw. A transaction that fails returns
        the epoch record as it is, and one that moved is tried once more with it, so a
        standby campaigning while another leads costs etcd one transaction and no read.
        An epoch record that does not parse is set aside and nobody leads (a guessed
        epoch could be refused by every agent): ``keel restore-epoch --epoch N`` writes
        a good one."""
        key = keys.LEADER
        tx = self.client.transactions
        for _ in range(2):
            seen = self._epoch_seen
            epoch = seen.value.epoch if seen.value else 0
            value = LeaderRecord(address=address, id=controller_id, epoch=epoch).to_json()
            for held in (tx.version(key) == 0, tx.value(key) == value):
                ok, responses = self.client.transaction(
                    compare=[held, tx.mod(keys.EPOCH) == seen.mod_revision],
                    success=[tx.put(key, value, lease=lease_id), tx.get(key)],
                    failure=[tx.get(keys.EPOCH)],
                )
                if ok:
                    self.term, self.epoch = responses[1][0][1].create_revision, epoch
                    return self.term
                try:
                    self._epoch_seen = self._parse(keys.EPOCH, EpochRecord, responses[0])
                except RecordError:
                    return None
                if self._epoch_seen.mod_revision != seen.mod_revision:
                    break  # the epoch moved: tried again with it
            else:
                return None  # another holds the key
        return None

    def leader(self) -> Leader | None:
        """The leading controller, or None (none leads, or its key does not parse)."""
        raw, meta = self.client.get(keys.LEADER)
        if raw is None:
            return None
        return parse_leader(
            raw, meta.create_revision, meta.response_header.cluster_id, self.set_aside
        )

    def controller_address(self) -> str | None:
        value = self.leader()
        return value.address if value else None

    # --------------------------------------------------------------------- jobs
    def create_job(self, name: str, spec: JobSpecRecord, state: JobStateRecord) -> int:
        """Create a job's spec and state together; return the state's revision, or 0
        if the job already exists."""
        spec_key = keys.job_spec(name)
        tx = self.client.transactions
        ok, responses = self._write(
            [self._put(spec_key, spec), self._put(keys.job_state(name), state)],
            (tx.version(spec_key) == 0,),
        )
        return responses[1].response_put.header.revision if ok else 0

    def put_job_spec(self, name: str, spec: JobSpecRecord) -> None:
        """Rewrite a job's spec record (a job read without an id gets one)."""
        self._write([self._put(keys.job_spec(name), spec)])

    def job_spec(self, name: str) -> JobSpecRecord | None:
        return self._get(keys.job_spec(name), JobSpecRecord).value

    def job_state(self, name: str) -> Versioned[JobStateRecord]:
        return self._get(keys.job_state(name), JobStateRecord)

    def job_names(self) -> list[str]:
        # Keys only: the values under a job (plans, checkpoints, events) can be large.
        return sorted({keys.job_of(k) for k in self._keys(keys.JOBS) if k.endswith("/spec")})

    def update_job_state(
        self, name: str, state: JobStateRecord, read_revision: int, plan: PlanRecord | None = None
    ) -> int:
        """Write a new job state (and a generation plan) if the state is unchanged
        since ``read_revision``; return the new revision, raise StaleRevision otherwise."""
        state_key = keys.job_state(name)
        tx = self.client.transactions
        puts = [self._put(state_key, state)]
        if plan is not None:
            puts.extend(self._plan_ops(name, plan))
        ok, responses = self._write(puts, (tx.mod(state_key) == read_revision,))
        if not ok:
            raise StaleRevision(f"job {name}: state changed since revision {read_revision}")
        return responses[0].response_put.header.revision

    def _plan_ops(self, name: str, plan: PlanRecord) -> list:
        """The operations that, with the job's state, store ``plan``: the plan, or the
        record naming its parts (those written first, here); and the deletes of every
        other generation's plan and of this generation's earlier parts. A write that
        fails after its parts leaves them to the next plan's deletes."""
        tx, g = self.client.transactions, plan.generation
        key, value = keys.plan(name, g), plan.to_json().encode()
        mine, plans = (key + "/").encode(), keys.plans(name).encode()
        # Every plan key but generation g's own: those before "<g>" and those after
        # "<g>/..." (later generations do not exist yet; "10" sorts before "9").
        others = [
            tx.delete(plans, range_end=key.encode()),
            tx.delete(prefix_end(mine), range_end=prefix_end(plans)),
        ]
        if len(value) <= PART_BYTES:
            return [tx.put(key, value), tx.delete(mine, range_end=prefix_end(mine)), *others]
        digest = hashlib.sha256(value).hexdigest()
        chunks = [value[i : i + PART_BYTES] for i in range(0, len(value), PART_BYTES)]
        per_write = PARTS_PER_WRITE
        for first in range(0, len(chunks), per_write):
            self._write(
                [
                    tx.put(part_key(name, g, digest, i), chunks[i])
                    for i in range(first, min(first + per_write, len(chunks)))
                ]
            )
        these = keys.plan_parts(name, g, digest).encode()
        head = PlanPartsRecord(generation=g, parts=len(chunks), size=len(value), sha256=digest)
        return [
            self._put(key, head),
            tx.delete(mine, range_end=these),  # this generation's earlier parts
            tx.delete(prefix_end(these), range_end=prefix_end(mine)),
            *others,
        ]

    def plan(self, name: str, generation: int) -> PlanRecord | None:
        """Generation ``generation``'s plan, put back together if stored in parts;
        raises RecordError (after ``set_aside``) if it does not parse, or its parts
        are missing or do not match their digest."""
        key = keys.plan(name, generation)
        raw, _ = self.client.get(key)
        if raw is None:
            return None
        try:
            head = parts_record(key, raw)
            if head is None:
                return PlanRecord.from_json(key, raw)
            prefix = keys.plan_parts(name, generation, head.sha256)
            kvs, _, _ = read_prefix(self.client, prefix)
            value = b"".join(kv.value for kv in kvs)
            if len(kvs) != head.parts or hashlib.sha256(value).hexdigest() != head.sha256:
                raise RecordError(
                    key,
                    f"its plan is stored in {head.parts} parts under {prefix}, but "
                    f"{len(kvs)} are there and they do not make up its digest",
                )
            return PlanRecord.from_json(key, value)
        except RecordError as error:
            self.set_aside(error)
            raise

    def delete_job(self, name: str) -> None:
        """Every record of job ``name``."""
        tx = self.client.transactions
        self._write([tx.delete(keys.job(name), range_end=prefix_end(keys.job(name).encode()))])

    # ------------------------------------------------------------------- events
    def put_events(self, name: str, events: list[tuple[int, EventRecord]]) -> None:
        """Events of job ``name`` (seq, event): a transaction per ``TXN_OPS`` of them or
        about ``TXN_BYTES`` (a thousand nodes lost at once are ten writes, not a
        thousand)."""
        tx, batch, size = self.client.transactions, [], 0
        for seq, event in events:
            value = event.to_json()
            if batch and (len(batch) == TXN_OPS or size + len(value) > TXN_BYTES):
                self._write(batch)
                batch, size = [], 0
            batch.append(tx.put(keys.event(name, seq), value))
            size += len(value)
        if batch:
            self._write(batch)

    def delete_events(self, name: str, seqs: list[int]) -> None:
        self._delete_each([keys.event(name, seq) for seq in seqs])

    def events(self, name: str) -> list[EventRecord]:
        """A job's saved events, oldest first."""
        return list(self._prefix(keys.events(name), EventRecord).values())

    # -------------------------------------------------------------- checkpoints
    def record_checkpoint(self, name: str, record: CheckpointRecord) -> bool:
        """Record a committed checkpoint once; False if that step was recorded before."""
        key = keys.checkpoint(name, record.step)
        tx = self.client.transactions
        ok, _ = self._write([self._put(key, record)], (tx.version(key) == 0,))
        return ok

    def update_checkpoint(self, name: str, record: CheckpointRecord) -> None:
        """Rewrite a checkpoint's record (a quarantined one is marked so, and kept)."""
        self._write([self._put(keys.checkpoint(name, record.step), record)])

    def delete_checkpoints(self, name: str, steps: list[int]) -> None:
        self._delete_each([keys.checkpoint(name, step) for step in steps])

    def _delete_each(self, doomed: list[str]) -> None:
        tx = self.client.transactions
        for i in range(0, len(doomed), TXN_OPS):
            self._write([tx.delete(key) for key in doomed[i : i + TXN_OPS]])

    def checkpoints(self, name: str) -> list[CheckpointRecord]:
        """Committed checkpoint records, oldest step first (one that does not parse is
        set aside: it is never a restore point)."""
        return list(self._prefix(keys.checkpoints(name), CheckpointRecord).values())

    def put_memory_snapshot(self, name: str, record: MemorySnapshotRecord) -> None:
        """The newest complete memory snapshot of job ``name`` (one key, rewritten)."""
        self._write([self._put(keys.memory_snapshot(name), record)])

    def memory_snapshot(self, name: str) -> MemorySnapshotRecord | None:
        """Its record, or None; one that does not parse is set aside (the restore is
        the ranks' to choose: the record only tells what they hold)."""
        return self._intent(keys.memory_snapshot(name), MemorySnapshotRecord)

    def delete_memory_snapshot(self, name: str) -> None:
        self._write([self.client.transactions.delete(keys.memory_snapshot(name))])

    # ------------------------------------------------------- operator intents
    def put_operation(self, name: str, record: OperationRecord) -> None:
        """The checkpoint-then-stop under way for job ``name``."""
        self._write([self._put(keys.operation(name), record)])

    def operation(self, name: str) -> OperationRecord | None:
        return self._intent(keys.operation(name), OperationRecord)

    def delete_operation(self, name: str) -> None:
        self._write([self.client.transactions.delete(keys.operation(name))])

    def put_checkpoint_request(self, name: str, request: CheckpointRequestRecord) -> None:
        """An operator's request for a checkpoint of job ``name`` after a step."""
        self._write([self._put(keys.checkpoint_request(name), request)])

    def checkpoint_request(self, name: str) -> CheckpointRequestRecord | None:
        return self._intent(keys.checkpoint_request(name), CheckpointRequestRecord)

    def delete_checkpoint_request(self, name: str) -> None:
        self._write([self.client.transactions.delete(keys.checkpoint_request(name))])

    def _intent(self, key: str, kind: type[R]) -> R | None:
        """An operator intent (or another record the job goes on without), or None; one
        that does not parse is set aside (the job goes on without it, and the operator
        can ask again)."""
        try:
            return self._get(key, kind).value
        except RecordError:
            return None
