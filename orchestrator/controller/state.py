"""What the leading controller holds in memory: its agents' sessions, the jobs, the
node records (followed in etcd with a watch) and the cordons. One lock guards all of
it: the thread that takes in agent messages and the operator calls record facts and
intents under it, the reconcile thread observes, decides and applies under it."""

from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

from etcd3 import events

from common import keys
from common.records import CordonRecord, NodeRecord, RecordError
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.store import Store
from orchestrator.policy.authority import Reporting
from protos import keel_pb2


class CountedDict(dict):
    """A dict that counts its changes on its owner (``owner.nodes_touched()``, read back
    as ``ControllerState.nodes_version``), so that what is built from the node tables
    (``ListNodes``) can be kept for as long as the version stands.

    The contract: every dict method that can change it (``__setitem__``,
    ``__delitem__``, ``__ior__``, ``pop``, ``popitem``, ``clear``, ``update``,
    ``setdefault``) counts, before the change and whether or not one happens (a count
    too many costs a rebuild, never a stale reply); so while the version stands the
    keys and the values are the same objects. A value changed in place is not seen
    here: whoever changes one (a session's ``connected``) calls ``nodes_touched``.
    Reads are a dict's own."""

    __slots__ = ("_owner",)

    def __init__(self, owner: ControllerState, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._owner = owner

    def _changed(self) -> None:
        self._owner.nodes_touched()

    def __setitem__(self, key, value):
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._changed()
        super().__delitem__(key)

    def __ior__(self, other):
        self._changed()
        return super().__ior__(other)

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def clear(self):
        self._changed()
        super().clear()

    def update(self, *args, **kwargs):
        self._changed()
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self._changed()
        return super().setdefault(key, default)


class LoopPost:
    """Hands messages from any thread to queues on one event loop, waking the loop once
    per batch, not once per message: a wake is a write to the loop's self-pipe, and a
    start sent to every node of a large cluster would be one per node, each contending
    for the GIL while the tick holds the state lock."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: collections.deque = collections.deque()  # (queue, message)
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, message) -> None:
        self._pending.append((queue, message))
        with self._lock:
            if self._scheduled:
                return  # a drain is due: it takes this one too
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            pass  # the loop is closed: the controller is stopping

    def _drain(self) -> None:
        with self._lock:
            self._scheduled = False  # (before taking: a later post schedules again)
        pending = self._pending
        while pending:
            queue, message = pending.popleft()
            queue.put_nowait(message)


class LoopOutbox:
    """The messages queued for one agent stream: put from any thread (through the
    loop's ``LoopPost``), taken by the stream's writer on the server's event loop."""

    def __init__(self, post: LoopPost):
        self._post = post
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, message) -> None:
        self._post.post(self._queue, message)

    async def get(self):
        return await self._queue.get()


@dataclass(eq=False)
class AgentSession:
    """One agent's stream: what its Hello said, and the messages queued for it."""

    node: str
    host: str
    slots: int
    lease_id: int
    pid: int
    hello: keel_pb2.Hello
    term: int  # of the leadership the stream was accepted under
    epoch: int = 0  # and the epoch it led in (``common.epoch``)
    outbox: queue.Queue | LoopOutbox = field(default_factory=queue.Queue)
    connected: bool = True
    disconnected_at: float = 0.0
    # Its Hello has been squared with the plan (adoption); the reconcile loop does it.
    accounted: bool = False
    status: keel_pb2.AgentStatus | None = None  # what it said it runs, last
    status_at: float = 0.0  # monotonic: when that status arrived
    fixed_at: float = 0.0  # monotonic: it was last sent a start or a stop
    leaving: str = ""  # the agent asked for its node to be drained: why
    batch_refused: bool = False  # a batch of its step reports was refused (logged once)

    def send(self, message: keel_pb2.ControllerMessage) -> None:
        message.term, message.epoch = self.term, self.epoch
        self.outbox.put(message)

    def close(self) -> None:
        self.outbox.put(None)


class AgentReplies:
    """Answers awaited from agents (a rank's log chunk), by request id: the caller
    ``expect``s one, sends its request, and waits on the future; the agent's reader
    thread ``deliver``s it."""

    def __init__(self):
        self._ids = itertools.count(1)
        self._waiting: dict[int, Future] = {}
        self._lock = threading.Lock()

    def expect(self) -> tuple[int, Future]:
        future = Future()
        with self._lock:
            request_id = next(self._ids)
            self._waiting[request_id] = future
        return request_id, future

    def deliver(self, request_id: int, answer) -> bool:
        """Whether someone was waiting for ``request_id`` (an answer after the wait
        gave up is dropped)."""
        with self._lock:
            future = self._waiting.pop(request_id, None)
        if future is None:
            return False
        future.set_result(answer)
        return True

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)


class ControllerState:
    def __init__(self, config: ControllerConfig, store: Store):
        self.config = config
        self.store = store
        self.id = uuid.uuid4().hex[:12]
        self.address = ""
        self.lock = threading.RLock()
        self._nodes_version = 0  # changes to sessions, registered, cordons (CountedDict)
        self.wake = threading.Event()  # set to run a reconcile tick now
        self.stopping = threading.Event()
        self.sessions = {}
        self.jobs: dict[str, JobRuntime] = {}
        # Each job's generation and nodes, for the checks agents' messages get on the
        # server's loop before any lock (``publish_reporting``): read without the lock.
        self.reporting: dict[str, Reporting] = {}
        self.registered = {}  # node records, as etcd has them (a watch)
        # monotonic: when a node's record went while its agent's stream was up (put
        # again: forgotten), which ``liveness.node_usable`` gives a lease TTL from.
        self.unregistered_at: dict[str, float] = {}
        # Agents whose stream is up; and nodes whose agent said something the reconcile
        # loop has to square with the plan (a new status, a Hello), or which it is
        # still squaring: per tick, the loop looks only at these.
        self.streams = 0
        self.unsettled: set[str] = set()
        self.down: set[str] = set()  # nodes whose agent's stream is down
        self.report_interval_s = 0.0  # asked of the agents (orchestrator.policy.pacing)
        self.cordons = {}  # as in etcd; written only by the leader
        self.is_leader = False
        self.leader_since = 0.0  # monotonic
        # Monotonic: an agent was last let in, or told to back off and connect again
        # (a cluster still reconnecting to a new leader: ``policy.liveness.taking_over``).
        self.agent_knocked_at = 0.0
        self.replies = AgentReplies()

    # The node tables: whatever is put in their place, or changed in them, counts.
    @property
    def sessions(self) -> dict[str, AgentSession]:
        return self._sessions

    @sessions.setter
    def sessions(self, value: dict) -> None:
        self._sessions = CountedDict(self, value)
        self.nodes_touched()

    @property
    def registered(self) -> dict[str, NodeRecord]:
        return self._registered

    @registered.setter
    def registered(self, value: dict) -> None:
        self._registered = CountedDict(self, value)
        self.nodes_touched()

    @property
    def cordons(self) -> dict[str, CordonRecord]:
        return self._cordons

    @cordons.setter
    def cordons(self, value: dict) -> None:
        self._cordons = CountedDict(self, value)
        self.nodes_touched()

    def nodes_touched(self) -> None:
        """A session, node record or cordon changed (the tables count their own changes;
        a session's ``connected`` is counted where it is set)."""
        self._nodes_version += 1

    def nodes_version(self) -> int:
        """Changes to the node tables so far: the same number, the same tables."""
        return self._nodes_version

    @property
    def term(self) -> int | None:
        """While leading: the term, the create revision of our leader key."""
        return self.store.term

    @property
    def epoch(self) -> int:
        """The epoch of the lead (``common.epoch``), read when it was taken."""
        return self.store.epoch

    def job_on(self, node: str) -> JobRuntime | None:
        """The job whose current generation runs (or is being started or stopped) on
        ``node``."""
        return next(
            (j for j in self.jobs.values() if j.state.holds_nodes and node in j.nodes), None
        )

    def node_state(self, node: str) -> str:
        """``ready``, ``cordoned``, ``draining`` (cordoned, a job still on it) or
        ``drained``."""
        cordon = self.cordons.get(node)
        if cordon is None:
            return "ready"
        if cordon.drain:
            return "draining" if self.job_on(node) is not None else "drained"
        return "cordoned"

    def connected(self) -> int:
        """Agents whose stream is up."""
        return self.streams

    def attach(self, session: AgentSession) -> None:
        """``session`` is the stream of its node from now on (under the lock)."""
        previous = self.sessions.get(session.node)
        if previous is not None:
            self.detach(previous)
            previous.close()
        self.sessions[session.node] = session
        self.streams += 1
        self.unsettled.add(session.node)
        self.down.discard(session.node)

    def detach(self, session: AgentSession, now: float | None = None) -> None:
        """``session``'s stream is down (under the lock)."""
        if session.connected:
            session.connected = False
            self.nodes_touched()
            self.streams -= 1
            if now is not None:
                session.disconnected_at = now
            self.unsettled.add(session.node)
            if self.sessions.get(session.node) is session:
                self.down.add(session.node)

    def publish_reporting(self) -> None:
        """Publish each job's generation and nodes (under the lock, after they change:
        a new leader's jobs, a tick's plans). Replaced whole, never changed in place,
        so a reader without the lock sees one publication or the next."""
        self.reporting = {
            name: Reporting(job.generation, job.nodes) for name, job in self.jobs.items()
        }

    def forget_sessions(self, nodes: list[str]) -> None:
        """Forget the sessions of ``nodes``, whose streams are down (under the lock):
        ``policy.retention.sessions_to_forget`` chose them."""
        for node in nodes:
            self.sessions.pop(node)
            self.down.discard(node)
            self.unsettled.discard(node)

    def drop_sessions(self) -> None:
        """Every stream closed (stepping down)."""
        for session in self.sessions.values():
            session.connected = False
            session.close()
        self.sessions.clear()  # (counted)
        self.streams = 0
        self.unsettled.clear()
        self.down.clear()
        self.report_interval_s = 0.0

    # ---------------------------------------------------------- the node records
    def nodes_read(self, kvs: list, _cluster: int) -> None:
        """The node records, read whole (the watch started or started again)."""
        found = {}
        for kv in kvs:
            record = self._node_record(kv.key.decode(), kv.value)
            if record is not None:
                found[keys.last_part(kv.key.decode())] = record
        with self.lock:
            for node in set(self.registered) - set(found):
                self._record_went(node)
            for node in found:
                self.unregistered_at.pop(node, None)
            self.unsettled.update(set(self.registered) ^ set(found))
            self.registered = found

    def nodes_changed(self, changes: list) -> None:
        """Node records put or deleted since."""
        with self.lock:
            for event in changes:
                node = keys.last_part(event.key.decode())
                record = None
                if not isinstance(event, events.DeleteEvent):
                    record = self._node_record(event.key.decode(), event.value)
                if record is None:
                    if self.registered.pop(node, None) is not None:
                        self._record_went(node)
                else:
                    self.registered[node] = record
                    self.unregistered_at.pop(node, None)
                self.unsettled.add(node)

    def _record_went(self, node: str) -> None:
        """Note when ``node``'s record went if its agent's stream was up then (what
        ``liveness.node_usable`` gives a lease TTL to register again)."""
        session = self.sessions.get(node)
        if session is not None and session.connected:
            self.unregistered_at[node] = time.monotonic()
        else:
            self.unregistered_at.pop(node, None)

    def _node_record(self, key: str, raw: bytes) -> NodeRecord | None:
        """A node record from the watch; one that does not parse is set aside (the node
        counts as unregistered until its agent registers it again)."""
        try:
            return NodeRecord.from_json(key, raw)
        except RecordError as error:
            self.store.set_aside(error)
            return None

    def send(self, node: str, message: keel_pb2.ControllerMessage) -> bool:
        """Queue ``message`` for ``node``'s agent if its stream is up; whether it was."""
        session = self.sessions.get(node)
        if session is None or not session.connected:
            return False
        session.send(message)
        return True
