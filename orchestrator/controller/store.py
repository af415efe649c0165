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

Reads of a prefix are paginated (``common.etcd.read_prefix``: ``PAGE`` keys a call,
fewer if a page of large values would pass the message limit) at one revision, so
however much a prefix holds, a new leader can read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import structlog

from common import keys
from common.etcd import EtcdClient, prefix_end, read_prefix
from common.leader import Leader, parse_leader
from common.records import (
    CheckpointRecord,
    CheckpointRequestRecord,
    CordonRecord,
    EventRecord,
    JobSpecRecord,
    JobStateRecord,
    LeaderRecord,
    NodeRecord,
    OperationRecord,
    PlanRecord,
    Record,
    RecordError,
)

log = structlog.get_logger()

R = TypeVar("R", bound=Record)

TXN_OPS = 100  # etcd refuses transactions of more than 128 operations by default
TXN_BYTES = 1 << 20  # and requests over 1.5 MiB


class StaleRevision(Exception):
    """A guarded write lost: the key changed since it was read."""


class Deposed(Exception):
    """This controller no longer holds the leader key it led with: another leads."""


@dataclass(frozen=True)
class Versioned(Generic[R]):
    """A record with the mod revision it was read at (None and 0: absent)."""

    value: R | None
    mod_revision: int


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

    # ------------------------------------------------------------------ helpers
    def _get(self, key: str, kind: type[R]) -> Versioned[R]:
        """The record at ``key``; one that does not parse is reported to ``set_aside``
        and raises RecordError."""
        raw, meta = self.client.get(key)
        if raw is None:
            return Versioned(None, 0)
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
        term is then unchanged). Returns the term we lead with, or None."""
        key = keys.LEADER
        value = LeaderRecord(address=address, id=controller_id).to_json()
        tx = self.client.transactions
        for held in (tx.version(key) == 0, tx.value(key) == value):
            ok, responses = self.client.transaction(
                compare=[held],
                success=[tx.put(key, value, lease=lease_id), tx.get(key)],
                failure=[],
            )
            if ok:
                self.term = responses[1][0][1].create_revision
                return self.term
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
            puts.append(self._put(keys.plan(name, plan.generation), plan))
        ok, responses = self._write(puts, (tx.mod(state_key) == read_revision,))
        if not ok:
            raise StaleRevision(f"job {name}: state changed since revision {read_revision}")
        return responses[0].response_put.header.revision

    def plan(self, name: str, generation: int) -> PlanRecord | None:
        return self._get(keys.plan(name, generation), PlanRecord).value

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
        """An operator intent, or None; one that does not parse is set aside (the job
        goes on without it, and the operator can ask again)."""
        try:
            return self._get(key, kind).value
        except RecordError:
            return None
