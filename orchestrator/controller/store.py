"""The controller's view of etcd: the only state that must survive a controller.

Every key is in ``common.keys``; values are JSON. Writes happen on membership and
generation changes only, never per step.

Fencing: a leader's term is the create revision of its leader key, fixed when the key
is created and larger for every later leader. Every write of a leader is a transaction
that also compares the leader key's create revision with its term, so a write of a
controller that has been superseded (it stalled, and another took over) fails, and
raises ``Deposed``; the controller then steps down at once. Writes that decide
something compare the revision they read as well (``StaleRevision`` when it moved).

Reads of a prefix are paginated (``common.etcd.read_prefix``: ``PAGE`` keys a call, fewer
if a page of large values would pass the message limit) at one revision, so however much a
prefix holds, a new leader can read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common import keys
from common.etcd import EtcdClient, prefix_end, read_prefix

TXN_OPS = 100  # etcd refuses transactions of more than 128 operations by default
TXN_BYTES = 1 << 20  # and requests over 1.5 MiB


class StaleRevision(Exception):
    """A guarded write lost: the key changed since it was read."""


class Deposed(Exception):
    """This controller no longer holds the leader key it led with: another leads."""


@dataclass(frozen=True)
class Versioned:
    """A decoded value with the mod revision it was read at (0 = absent)."""

    value: dict | None
    mod_revision: int


class Store:
    def __init__(self, client: EtcdClient):
        self.client = client
        self.term: int | None = None  # while leading: the create revision of our leader key

    # ------------------------------------------------------------------ helpers
    def _get(self, key: str) -> Versioned:
        raw, meta = self.client.get(key)
        if raw is None:
            return Versioned(None, 0)
        return Versioned(json.loads(raw), meta.mod_revision)

    def _prefix(self, prefix: str, keys_only: bool = False) -> dict[str, dict | None]:
        """Every key under ``prefix`` with its decoded value (None with ``keys_only``),
        in key order, read page by page at the revision of the first page."""
        kvs, _, _ = read_prefix(self.client, prefix, keys_only)
        return {kv.key.decode(): None if keys_only else json.loads(kv.value) for kv in kvs}

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
                held = json.loads(leader[0][0]) if leader else None
                raise Deposed(
                    f"the leader key is now {held or 'gone'}; our term {self.term} is over"
                )
        return ok, responses

    # -------------------------------------------------------------------- nodes
    def put_node(self, node: str, record: dict, lease_id: int) -> None:
        """Write a node record on the agent's lease, so it vanishes with the agent."""
        self._write(
            [self.client.transactions.put(keys.node(node), json.dumps(record), lease=lease_id)]
        )

    def probe(self) -> None:
        """One small read (the leader key), raising if etcd does not answer it."""
        self.client.get(keys.LEADER)

    def nodes(self) -> dict[str, dict]:
        """Registered nodes by name (records whose lease is still alive)."""
        return {keys.last_part(key): value for key, value in self._prefix(keys.NODES).items()}

    def lease_alive(self, lease_id: int) -> bool:
        info = self.client.get_lease_info(lease_id)
        return info.TTL > 0

    def cordon(self, node: str, record: dict) -> None:
        """Keep new generations off ``node``; ``record``: reason, by, drain, at."""
        self._write([self.client.transactions.put(keys.cordon(node), json.dumps(record))])

    def uncordon(self, node: str) -> None:
        """Lift a cordon."""
        self._write([self.client.transactions.delete(keys.cordon(node))])

    def cordons(self) -> dict[str, dict]:
        return {keys.last_part(key): value for key, value in self._prefix(keys.CORDONS).items()}

    # ------------------------------------------------------------------- leader
    def campaign(self, controller_id: str, address: str, lease_id: int) -> int | None:
        """Take the leader key on ``lease_id`` if nobody holds it, or if it is still
        ours (we stepped down while etcd was out of reach, and nobody led since: the
        term is then unchanged). Returns the term we lead with, or None."""
        key = keys.LEADER
        value = json.dumps({"address": address, "id": controller_id})
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

    def leader(self) -> dict | None:
        """The leading controller's ``{"address", "id"}`` and its ``term``, or None."""
        raw, meta = self.client.get(keys.LEADER)
        if raw is None:
            return None
        return json.loads(raw) | {"term": meta.create_revision}

    def controller_address(self) -> str | None:
        value = self.leader()
        return value["address"] if value else None

    # --------------------------------------------------------------------- jobs
    def create_job(self, name: str, spec: dict, state: dict) -> int:
        """Create a job's spec and state together; return the state's revision, or 0
        if the job already exists."""
        spec_key = keys.job_spec(name)
        tx = self.client.transactions
        ok, responses = self._write(
            [tx.put(spec_key, json.dumps(spec)), tx.put(keys.job_state(name), json.dumps(state))],
            (tx.version(spec_key) == 0,),
        )
        return responses[1].response_put.header.revision if ok else 0

    def job_spec(self, name: str) -> dict | None:
        return self._get(keys.job_spec(name)).value

    def job_state(self, name: str) -> Versioned:
        return self._get(keys.job_state(name))

    def job_names(self) -> list[str]:
        # Keys only: the values under a job (plans, checkpoints, events) can be large.
        return sorted(
            {keys.job_of(k) for k in self._prefix(keys.JOBS, keys_only=True) if k.endswith("/spec")}
        )

    def update_job_state(
        self, name: str, state: dict, read_revision: int, plan: dict | None = None
    ) -> int:
        """Write a new job state (and a generation plan) if the state is unchanged
        since ``read_revision``; return the new revision, raise StaleRevision otherwise."""
        state_key = keys.job_state(name)
        tx = self.client.transactions
        puts = [tx.put(state_key, json.dumps(state))]
        if plan is not None:
            puts.append(tx.put(keys.plan(name, plan["generation"]), json.dumps(plan)))
        ok, responses = self._write(puts, (tx.mod(state_key) == read_revision,))
        if not ok:
            raise StaleRevision(f"job {name}: state changed since revision {read_revision}")
        return responses[0].response_put.header.revision

    def plan(self, name: str, generation: int) -> dict | None:
        return self._get(keys.plan(name, generation)).value

    def delete_job(self, name: str) -> None:
        """Every record of job ``name``."""
        tx = self.client.transactions
        self._write([tx.delete(keys.job(name), range_end=prefix_end(keys.job(name).encode()))])

    # ------------------------------------------------------------------- events
    def put_events(self, name: str, events: list[tuple[int, dict]]) -> None:
        """Events of job ``name`` (seq, event): a transaction per ``TXN_OPS`` of them or
        about ``TXN_BYTES`` (a thousand nodes lost at once are ten writes, not a
        thousand)."""
        tx, batch, size = self.client.transactions, [], 0
        for seq, event in events:
            value = json.dumps(event)
            if batch and (len(batch) == TXN_OPS or size + len(value) > TXN_BYTES):
                self._write(batch)
                batch, size = [], 0
            batch.append(tx.put(keys.event(name, seq), value))
            size += len(value)
        if batch:
            self._write(batch)

    def delete_events(self, name: str, seqs: list[int]) -> None:
        self._delete_each([keys.event(name, seq) for seq in seqs])

    def events(self, name: str) -> list[dict]:
        """A job's saved events, oldest first."""
        return list(self._prefix(keys.events(name)).values())

    # -------------------------------------------------------------- checkpoints
    def record_checkpoint(self, name: str, record: dict) -> bool:
        """Record a committed checkpoint once; False if that step was recorded before."""
        key = keys.checkpoint(name, record["step"])
        tx = self.client.transactions
        ok, _ = self._write([tx.put(key, json.dumps(record))], (tx.version(key) == 0,))
        return ok

    def update_checkpoint(self, name: str, record: dict) -> None:
        """Rewrite a checkpoint's record (a quarantined one is marked so, and kept)."""
        self._write(
            [
                self.client.transactions.put(
                    keys.checkpoint(name, record["step"]), json.dumps(record)
                )
            ]
        )

    def delete_checkpoints(self, name: str, steps: list[int]) -> None:
        self._delete_each([keys.checkpoint(name, step) for step in steps])

    def _delete_each(self, doomed: list[str]) -> None:
        tx = self.client.transactions
        for i in range(0, len(doomed), TXN_OPS):
            self._write([tx.delete(key) for key in doomed[i : i + TXN_OPS]])

    def checkpoints(self, name: str) -> list[dict]:
        """Committed checkpoint records, oldest step first."""
        return list(self._prefix(keys.checkpoints(name)).values())

    # ------------------------------------------------------- operator intents
    def put_operation(self, name: str, record: dict) -> None:
        """The checkpoint-then-stop under way for job ``name`` (``Operation.record()``)."""
        self._write([self.client.transactions.put(keys.operation(name), json.dumps(record))])

    def operation(self, name: str) -> dict | None:
        return self._get(keys.operation(name)).value

    def delete_operation(self, name: str) -> None:
        self._write([self.client.transactions.delete(keys.operation(name))])

    def put_checkpoint_request(self, name: str, request: dict) -> None:
        """An operator's request for a checkpoint of job ``name`` after a step."""
        self._write(
            [self.client.transactions.put(keys.checkpoint_request(name), json.dumps(request))]
        )

    def checkpoint_request(self, name: str) -> dict | None:
        return self._get(keys.checkpoint_request(name)).value

    def delete_checkpoint_request(self, name: str) -> None:
        self._write([self.client.transactions.delete(keys.checkpoint_request(name))])
