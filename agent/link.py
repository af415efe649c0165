"""The agent's link to the leading controller: follow the leader key, hold one
``Connect`` stream to the leader (a Hello first, then the replays, then whatever the
agent sends), hand what it says to the agent's main loop, and reconnect with back-off
when the stream ends. The back-off is jittered, and cut short when the leader key
names a leader: an agent that failed against a dead leader for seconds does not sleep
through its successor's first seconds.

Fencing: every controller message carries its sender's leader term and epoch, and the
link drops any message of a lower (epoch, term) than the highest it has seen (from a
Welcome, or from the leader key itself; ``common.epoch``: a later epoch wins whatever
its term, as after a restore of etcd from a snapshot), so a controller that stalled and
was superseded cannot start or stop anything here when it wakes. When the leader key names another
controller than the one the stream goes to, the stream is ended at once and the link
connects to the new leader; keepalives end a stream to a controller that stalls. A
standby that refuses the stream names the leader, and the link dials it next: the
agent's own view of the key may lag (its watch sat on an etcd member that stalled).
"""

from __future__ import annotations

import collections
import queue
import random
import threading
import time
from collections.abc import Callable

import grpc
import structlog

from common import epoch
from common.epoch import Stamp
from common.leader import Leader, LeaderWatch, named_leader
from common.rpc import AGENT_CHANNEL_OPTIONS, channel
from common.tls import TlsFiles, call_metadata
from protos import keel_pb2, keel_pb2_grpc

log = structlog.get_logger()

BACKOFF_FIRST_S = 0.1
MAX_REPORT_INTERVAL_S = 60.0  # an ask to batch step reports longer is not followed
HEALTHY_STREAM_S = 10.0  # a stream that lasted this long resets the back-off
# An unchanged status is sent again at least this often (the controller resends a
# start or a stop that a status still shows missing, orchestrator.policy.convergence);
# in a cluster large enough that the controller asks for longer step batches, every
# STATUS_REFRESH_BATCHES batches instead, so that the refreshes of all agents together
# stay about as many a second (about 100 at the default pace) however many they are.
STATUS_REFRESH_S = 10.0
STATUS_REFRESH_BATCHES = 10
_NOTHING = object()  # no message taken off the outbox (None is the close request)
_ENDED = object()  # the stream a message was taken for has ended
NO_STAMP = Stamp(0, 0)  # no leader seen yet


def status_refresh_s(report_interval_s: float) -> float:
    """How long an unchanged status may go unsent, at the step-report interval the
    controller asked for (0: the agent's own pace)."""
    return max(STATUS_REFRESH_S, STATUS_REFRESH_BATCHES * report_interval_s)


def jittered(backoff_s: float, rng: random.Random | None = None) -> float:
    """How long to wait before the next attempt: between half and all of ``backoff_s``,
    at random, so that the agents of a cluster that lost its leader at once do not come
    back at once, and keep doing so in step, but no agent retries sooner than half."""
    return (rng or random).uniform(backoff_s / 2, backoff_s)


class ControllerLink:
    def __init__(
        self,
        leaders: LeaderWatch,
        token: str,
        tls: TlsFiles | None,
        controller: str | None,
        reconnect_max_s: float,
        opening: Callable[[], list[keel_pb2.AgentMessage]],
        deliver: Callable[[keel_pb2.ControllerMessage], None],
        stopping: threading.Event,
    ):
        """``opening()`` gives the messages that open each stream (the Hello, then the
        replays); ``deliver`` takes every controller message of a current term but the
        Welcome and ReportPace (kept in ``report_interval_s``); ``controller``: a fixed
        host:port to dial instead of the leader's address (the leader key still gives
        the terms)."""
        self.leaders = leaders
        self.token = token
        self.tls = tls
        self.controller = controller
        self.reconnect_max_s = reconnect_max_s
        self.opening = opening
        self.deliver = deliver
        self.stopping = stopping
        self.outbox: queue.Queue = queue.Queue()
        # Taken off the outbox for a stream that ended meanwhile: the next one sends them.
        self._carried: collections.deque = collections.deque()
        self._carry_lock = threading.Lock()
        self._lock = threading.Lock()
        self._call = None  # the Connect call in progress
        self._dialled: str | None = None  # the address it goes to
        self._named: str | None = None  # the leader a standby named: dialled next
        self._dialling_named = False  # the stream in progress goes to such a leader
        self._cluster = 0  # the etcd cluster the terms below count in
        self._highest = NO_STAMP  # the highest leader (epoch, term) seen
        self._refused = NO_STAMP  # the last one refused (logged once)
        self.up = False  # a stream to a current controller is open
        # How long the controller asks step reports to be batched (0: our own pace): in
        # its Welcome, then in a ReportPace when its cluster grows or shrinks.
        self.report_interval_s = 0.0
        self._leader_named = threading.Event()  # the key named a leader: retry now
        leaders.on_change = self.leader_changed

    # ----------------------------------------------------------------- terms
    def _see_term(self, stamp: Stamp, cluster_id: int = 0) -> None:
        with self._lock:
            if cluster_id and cluster_id != self._cluster:
                # An etcd cluster rebuilt from nothing numbers its revisions anew.
                self._cluster, self._highest = cluster_id, NO_STAMP
            self._highest = epoch.newest(self._highest, stamp)

    def current_term(self, stamp: Stamp) -> bool:
        """Whether a message of leader (epoch, term) ``stamp`` may be acted on."""
        with self._lock:
            if epoch.current(stamp, self._highest):
                return True
            refused, self._refused = self._refused, stamp
        if refused != stamp:
            log.warning(
                "refusing messages of a superseded controller",
                term=stamp.number,
                epoch=stamp.epoch,
                highest_term=self._highest.number,
                highest_epoch=self._highest.epoch,
            )
        return False

    def leader_changed(self, leader: Leader | None) -> None:
        """The leader key changed: learn its term, and leave a stream that goes
        elsewhere."""
        if leader is None:
            return
        self._see_term(leader.stamp, leader.cluster_id)
        self._leader_named.set()
        if self.controller is None and self._dialled not in (None, leader.address):
            log.info("the leader changed; reconnecting", leader=leader.address, term=leader.term)
            self.reconnect()

    # ---------------------------------------------------------------- stream
    def send(self, message: keel_pb2.AgentMessage) -> None:
        """Queue ``message`` for the controller (sent on the current stream, or the
        next one)."""
        self.outbox.put(message)

    def reconnect(self) -> None:
        """End the stream in progress; the next one opens with a fresh Hello."""
        call = self._call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        self.outbox.put(None)
        self._leader_named.set()

    def _pause(self, seconds: float) -> str:
        """Wait ``seconds``: "stop" if the agent is stopping, "leader" if the leader key
        named a leader meanwhile (dial it now), else "waited"."""
        deadline = time.monotonic() + seconds
        while not self.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return "waited"
            if self._leader_named.wait(min(left, 0.2)):
                self._leader_named.clear()
                return "stop" if self.stopping.is_set() else "leader"
        return "stop"

    def _pace(self, interval_s: float) -> None:
        # A value that is not a sane number of seconds is not followed: our own pace.
        self.report_interval_s = interval_s if 0 < interval_s <= MAX_REPORT_INTERVAL_S else 0.0

    def run(self) -> None:
        """Keep a stream to the leader until ``stopping`` is set."""
        backoff = BACKOFF_FIRST_S
        while not self.stopping.is_set():
            leader = self.leaders.current
            named, self._named = self._named, None
            self._dialling_named = named is not None
            address = self.controller or named or (leader.address if leader else None)
            if address:
                started = time.monotonic()
                try:
                    self._stream(address)
                except Exception as exc:  # e.g. TLS files unreadable: retry, never die
                    log.error(
                        "cannot connect to the controller",
                        address=address,
                        error=f"{type(exc).__name__}: {exc}",
                    )
                if time.monotonic() - started > HEALTHY_STREAM_S:
                    backoff = BACKOFF_FIRST_S
            paused = self._pause(jittered(backoff))
            if paused == "stop":
                return
            if paused == "leader":
                # The agents of a whole cluster hear of a new leader at once: a short
                # jittered pause spreads them out, and the back-off begins anew.
                backoff = BACKOFF_FIRST_S
                if self._pause(jittered(BACKOFF_FIRST_S)) == "stop":
                    return
            else:
                backoff = min(backoff * 2, self.reconnect_max_s)

    def _requests(self, closed: threading.Event):
        yield from self.opening()
        while True:
            message = self._take(closed)
            if message is None or message is _ENDED:
                return
            yield message

    def _take(self, closed: threading.Event):
        """The next message for the stream ``closed`` belongs to; ``_ENDED`` once that
        stream has ended. gRPC pulls a stream's messages on a thread of its own, which
        may still be waiting on the outbox when the stream ends: a message it takes then
        is kept, in order, for the next stream, not lost with the ended one (a rendezvous
        answer sent just after a reconnect would be, and the generation would wait for
        it)."""
        while not closed.is_set():
            taken = _NOTHING
            if not self._carried:
                try:
                    taken = self.outbox.get(timeout=0.2)
                except queue.Empty:
                    continue
            with self._carry_lock:
                if taken is not _NOTHING:
                    self._carried.append(taken)
                if closed.is_set():
                    break  # the next stream sends it
                if self._carried:
                    return self._carried.popleft()
        return _ENDED

    def _stream(self, address: str) -> None:
        closed = threading.Event()
        with channel(address, self.tls, AGENT_CHANNEL_OPTIONS) as link:
            stub = keel_pb2_grpc.ControllerStub(link)
            self._dialled = address
            self._call = stub.Connect(self._requests(closed), metadata=call_metadata(self.token))
            try:
                for message in self._call:
                    if message.WhichOneof("kind") == "welcome":
                        stamp = Stamp(message.epoch, message.term)
                        if not self.current_term(stamp):
                            break  # a superseded controller: find the leader again
                        self._see_term(stamp)
                        self.up = True
                        self._pace(message.welcome.report_interval_s)
                        log.info(
                            "connected to controller",
                            address=address,
                            controller_id=message.welcome.controller_id,
                            term=message.term,
                            epoch=message.epoch,
                            report_interval_s=self.report_interval_s,
                        )
                    elif not self.current_term(Stamp(message.epoch, message.term)):
                        pass
                    elif message.WhichOneof("kind") == "report_pace":
                        self._pace(message.report_pace.interval_s)
                        log.info(
                            "batching step reports as the controller asks",
                            report_interval_s=self.report_interval_s,
                        )
                    else:
                        self.deliver(message)
            except grpc.RpcError as exc:
                named = named_leader(exc.details())
                if named not in (None, address) and self.controller is None:
                    self._named = named
                    # Dialled at once, unless a named leader named another in turn
                    # (standbys whose views lag): then after the back-off.
                    if not self._dialling_named:
                        self._leader_named.set()
                if not self.stopping.is_set():
                    log.warning(
                        "controller stream ended",
                        address=address,
                        code=str(exc.code()),
                        details=exc.details(),
                    )
            finally:
                self.up = False
                self._call = None
                self._dialled = None
                closed.set()
