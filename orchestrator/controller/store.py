"""The controller's view of etcd: the only state that must survive a controller.

Every key is in ``common.keys``; values are JSON. Writes happen on membership and
generation changes only, never per step. Every write that decides something is a
transaction guarded by the revision it read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common import keys
from common.etcd import EtcdClient


class StaleRevision(Exception):
    """A guarded write lost: the key changed since it was read."""


@dataclass(frozen=True)
class Versioned:
    """A decoded value with the mod revision it was read at (0 = absent)."""
    value: dict | None
    mod_revision: int


class Store:
    def __init__(self, client: EtcdClient):
        self.client = client

    # ------------------------------------------------------------------ helpers
    def _get(self, key: str) -> Versioned:
        raw, meta = self.client.get(key)
        if raw is None:
            return Versioned(None, 0)
        return Versioned(json.loads(raw), meta.mod_revision)

    def _prefix(self, prefix: str) -> dict[str, dict]:
        return {meta.key.decode(): json.loads(raw)
                for raw, meta in self.client.get_prefix(prefix)}

    # -------------------------------------------------------------------- nodes
    def put_node(self, node: str, record: dict, lease_id: int) -> None:
        """Write a node record on the agent's lease, so it vanishes with the agent."""
        self.client.put(keys.node(node), json.dumps(record), lease=lease_id)

    def nodes(self) -> dict[str, dict]:
        """Registered nodes by name (records whose lease is still alive)."""
        return {keys.last_part(key): value for key, value in self._prefix(keys.NODES).items()}

    def lease_alive(self, lease_id: int) -> bool:
        info = self.client.get_lease_info(lease_id)
        return info.TTL > 0

    def cordon(self, node: str, record: dict) -> None:
        """Keep new generations off ``node``; ``record``: reason, by, drain, at."""
        self.client.put(keys.cordon(node), json.dumps(record))

    def uncordon(self, node: str) -> bool:
        """Lift a cordon; False if the node was not cordoned."""
        return self.client.delete(keys.cordon(node))

    def cordons(self) -> dict[str, dict]:
        return {keys.last_part(key): value for key, value in self._prefix(keys.CORDONS).items()}

    # ------------------------------------------------------------------- leader
    def campaign(self, controller_id: str, address: str, lease_id: int) -> bool:
        """Take the leader key on ``lease_id`` if nobody holds it, or if it is still
        ours (we stepped down while etcd was out of reach, and nobody led since);
        True if we lead."""
        key = keys.LEADER
        value = json.dumps({"address": address, "id": controller_id})
        tx = self.client.transactions
        for held in (tx.version(key) == 0, tx.value(key) == value):
            ok, _ = self.client.transaction(compare=[held],
                                            success=[tx.put(key, value, lease=lease_id)],
                                            failure=[])
            if ok:
                return True
        return False

    def leader(self) -> dict | None:
        """The leading controller's ``{"address", "id"}``, or None."""
        return self._get(keys.LEADER).value

    def controller_address(self) -> str | None:
        value = self.leader()
        return value["address"] if value else None

    # --------------------------------------------------------------------- jobs
    def create_job(self, name: str, spec: dict, state: dict) -> int:
        """Create a job's spec and state together; return the state's revision, or 0
        if the job already exists."""
        spec_key = keys.job_spec(name)
        tx = self.client.transactions
        ok, responses = self.client.transaction(
            compare=[tx.version(spec_key) == 0],
            success=[tx.put(spec_key, json.dumps(spec)),
                     tx.put(keys.job_state(name), json.dumps(state))],
            failure=[])
        return responses[1].response_put.header.revision if ok else 0

    def job_spec(self, name: str) -> dict | None:
        return self._get(keys.job_spec(name)).value

    def job_state(self, name: str) -> Versioned:
        return self._get(keys.job_state(name))

    def job_names(self) -> list[str]:
        # Keys only: the values under a job (plans, checkpoints, events) can be large.
        found = [meta.key.decode()
                for _, meta in self.client.get_prefix(keys.JOBS, keys_only=True)]
        return sorted({keys.job_of(k) for k in found if k.endswith("/spec")})

    def update_job_state(self, name: str, state: dict, read_revision: int,
                         plan: dict | None = None) -> int:
        """Write a new job state (and a generation plan) if the state is unchanged
        since ``read_revision``; return the new revision, raise StaleRevision otherwise."""
        state_key = keys.job_state(name)
        tx = self.client.transactions
        puts = [tx.put(state_key, json.dumps(state))]
        if plan is not None:
            puts.append(tx.put(keys.plan(name, plan["generation"]), json.dumps(plan)))
        ok, responses = self.client.transaction(
            compare=[tx.mod(state_key) == read_revision], success=puts, failure=[])
        if not ok:
            raise StaleRevision(f"job {name}: state changed since revision {read_revision}")
        return responses[0].response_put.header.revision

    def plan(self, name: str, generation: int) -> dict | None:
        return self._get(keys.plan(name, generation)).value

    # ------------------------------------------------------------------- events
    def put_event(self, name: str, seq: int, event: dict) -> None:
        self.client.put(keys.event(name, seq), json.dumps(event))

    def delete_event(self, name: str, seq: int) -> None:
        self.client.delete(keys.event(name, seq))

    def events(self, name: str) -> list[dict]:
        """A job's saved events, oldest first."""
        found = self._prefix(keys.events(name))
        return [found[k] for k in sorted(found)]

    # -------------------------------------------------------------- checkpoints
    def record_checkpoint(self, name: str, record: dict) -> bool:
        """Record a committed checkpoint once; False if that step was recorded before."""
        key = keys.checkpoint(name, record["step"])
        tx = self.client.transactions
        ok, _ = self.client.transaction(
            compare=[tx.version(key) == 0], success=[tx.put(key, json.dumps(record))],
            failure=[])
        return ok

    def checkpoints(self, name: str) -> list[dict]:
        """Committed checkpoint records, oldest step first."""
        found = self._prefix(keys.checkpoints(name))
        return [found[k] for k in sorted(found)]

    # ------------------------------------------------------- operator intents
    def put_operation(self, name: str, record: dict) -> None:
        """The checkpoint-then-stop under way for job ``name`` (``Operation.record()``)."""
        self.client.put(keys.operation(name), json.dumps(record))

    def operation(self, name: str) -> dict | None:
        return self._get(keys.operation(name)).value

    def delete_operation(self, name: str) -> None:
        self.client.delete(keys.operation(name))

    def put_checkpoint_request(self, name: str, request: dict) -> None:
        """An operator's request for a checkpoint of job ``name`` after a step."""
        self.client.put(keys.checkpoint_request(name), json.dumps(request))

    def checkpoint_request(self, name: str) -> dict | None:
        return self._get(keys.checkpoint_request(name)).value

    def delete_checkpoint_request(self, name: str) -> None:
        self.client.delete(keys.checkpoint_request(name))
