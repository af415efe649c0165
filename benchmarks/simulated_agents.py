"""Simulated agents for ``benchmarks.control_plane``: many per process, on one asyncio
loop, each speaking the real agent protocol to the controller over its own gRPC
stream and TCP connection, each holding its own etcd lease.

An agent here says Hello (with what it runs, after a reconnect), answers a rendezvous
request, takes a generation's start and reports its ranks' steps (every ``--step-s``,
one ``NodeStep`` a step for its 8 ranks, as the real agent sums them up), batched as
the real agent batches them: a message a step, or one per interval the controller
asks for (``Welcome``, ``ReportPace``) if longer; sends its status as the real agent
does (when it changes, and unchanged every ``agent.link.status_refresh_s``), confirms a
stop, and reconnects with jittered exponential back-off to whichever controller leads. It
runs no rank process: what is measured is the control plane.

The leases are kept alive on one LeaseKeepAlive stream per process, and the leader key
is watched once per process (the real agent keeps its own lease and watch on its own
connection: what etcd sees per agent is the same). As the real agent does
(``agent/link``), an agent backing off dials the leader as soon as the key names one,
after a short jittered pause.

Run by ``benchmarks.control_plane``; prints a JSON line to stdout every half second,
``{"at": t, "by": {controller address: agents connected to it}, "paced": {report
interval asked, seconds: agents connected}}``, and a summary when
its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import threading
import time
import zlib

import grpc
from etcd3.etcdrpc import rpc_pb2, rpc_pb2_grpc

from agent.link import BACKOFF_FIRST_S, jittered, status_refresh_s
from common import keys, rpc
from common.records import LeaderRecord, RecordError
from common.tls import call_metadata
from protos import keel_pb2, keel_pb2_grpc

# The real agent's lease TTL is 5 s (agent/config.lease_ttl_s). Here 15 s, and said so
# in the Hello: sharing two cores with the controller and etcd, a load generator of
# 2,000 agents did not refresh their leases within 5 s (most expired, and the job was
# restarted for nodes "lost" that were alive); refreshes cost etcd, not the controller.
LEASE_TTL_S = 15
GRANTS_IN_FLIGHT = 16  # lease grants a process has in flight at once (see Leases)
RECONNECT_MAX_S = 5.0  # agent/config.reconnect_max_s


class Leases:
    """Every agent's etcd lease: granted on the agents' loop, refreshed on one
    LeaseKeepAlive stream from a thread of its own, so that a busy agents' loop (a
    whole process reconnecting at once) cannot let them expire, as the real agents'
    own lease threads do not (on the loop, 448 of 1,000 leases expired within the
    5 s TTL of a leader failover)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.channel = grpc.aio.insecure_channel(endpoint)
        self.stub = rpc_pb2_grpc.LeaseStub(self.channel)
        self.ids: set[int] = set()  # added to on the agents' loop, read by the keeper
        # Leases etcd says are gone (a refresh answered TTL 0: it expired while the
        # generator, or etcd, was starved): their agents take new ones and say Hello
        # again, as the real agent does (agent/daemon._register_again).
        self.expired: set[int] = set()
        # Grants in flight at once: each real agent asks for its lease once, when it
        # starts, so etcd sees as many grants as agents, but not thousands in the same
        # millisecond from one process sharing its cores (that starved etcd, and the
        # controller stepped down for it).
        self.granting = asyncio.Semaphore(GRANTS_IN_FLIGHT)

    async def grant(self, ttl: int) -> int:
        for attempt in range(20):
            try:
                async with self.granting:
                    reply = await self.stub.LeaseGrant(
                        rpc_pb2.LeaseGrantRequest(TTL=ttl), timeout=10
                    )
                self.ids.add(reply.ID)
                return reply.ID
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2 * (attempt + 1))
        raise RuntimeError("etcd granted no lease")

    def keep_alive(self, period_s: float) -> None:
        """Refresh every lease every ``period_s``, on a thread of its own (plain gRPC,
        no event loop)."""
        threading.Thread(target=self._keep, args=(period_s,), name="leases", daemon=True).start()

    def _keep(self, period_s: float) -> None:
        stub = rpc_pb2_grpc.LeaseStub(grpc.insecure_channel(self.endpoint))

        def requests():
            while True:
                began = time.monotonic()
                for lease_id in list(self.ids):
                    yield rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)
                time.sleep(max(0.0, period_s - (time.monotonic() - began)))

        while True:
            try:
                for reply in stub.LeaseKeepAlive(requests()):
                    if reply.TTL <= 0:
                        self.ids.discard(reply.ID)
                        self.expired.add(reply.ID)
            except grpc.RpcError:
                time.sleep(0.5)


class LeaderKey:
    """Who leads, from a watch of the leader key; ``changed`` is set on every change."""

    def __init__(self, endpoint: str):
        self.channel = grpc.aio.insecure_channel(endpoint)
        self.address = ""
        self.changed = asyncio.Event()

    def _set(self, raw: bytes) -> None:
        try:
            address = LeaderRecord.from_json(keys.LEADER, raw).address if raw else ""
        except RecordError:
            address = ""
        if address != self.address:
            self.address = address
            if address:
                self.changed.set()
                self.changed = asyncio.Event()

    async def follow(self) -> None:
        key = keys.LEADER.encode()
        while True:
            try:
                found = await rpc_pb2_grpc.KVStub(self.channel).Range(
                    rpc_pb2.RangeRequest(key=key), timeout=10
                )
                self._set(found.kvs[0].value if found.kvs else b"")
                call = rpc_pb2_grpc.WatchStub(self.channel).Watch()
                await call.write(
                    rpc_pb2.WatchRequest(
                        create_request=rpc_pb2.WatchCreateRequest(
                            key=key, start_revision=found.header.revision + 1
                        )
                    )
                )
                async for response in call:
                    for event in response.events:
                        self._set(event.kv.value if event.type == event.PUT else b"")
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)


class Agent:
    def __init__(
        self,
        node: str,
        pid: int,
        addresses: list[str],
        token: str,
        step_s: float,
        channel_options: list,
    ):
        self.node, self.pid, self.addresses, self.token = node, pid, addresses, token
        self.step_s = step_s
        self.options = channel_options
        self.lease_id = 0
        self.start: keel_pb2.StartGeneration | None = None  # the generation it runs
        self.started: tuple[str, int] = ("", 0)
        self.stopped: tuple[str, int] | None = None
        self.steps = 0
        self.batch: keel_pb2.StepReportBatch | None = None  # reports not yet sent
        self.report_interval_s = 0.0  # as the controller asks (0: a message a step)
        self.connects = 0
        self.connected = ""  # the address of the controller it is connected to
        self.refusals = 0
        self.errors = 0
        self.renewals = 0  # leases found expired and taken again
        self.leases: Leases | None = None

    def hello(self) -> keel_pb2.AgentMessage:
        hello = keel_pb2.Hello(
            node=self.node,
            host="127.0.0.1",
            slots=8,
            lease_id=self.lease_id,
            pid=self.pid,
            heartbeat_s=self.step_s,
            reconnect_max_s=RECONNECT_MAX_S,
            lease_ttl_s=LEASE_TTL_S,
            accelerator="simulated",
        )
        if self.start is not None:
            hello.running_job, hello.running_generation = self.start.job, self.start.generation
            hello.running.extend(self.start.ranks)
        return keel_pb2.AgentMessage(hello=hello)

    def status(self) -> keel_pb2.AgentMessage:
        status = keel_pb2.AgentStatus(
            phase=keel_pb2.AGENT_PHASE_RUNNING if self.start else keel_pb2.AGENT_PHASE_IDLE,
            started_job=self.started[0],
            started_generation=self.started[1],
        )
        if self.start is not None:
            status.job, status.generation = self.start.job, self.start.generation
            status.running.extend(self.start.ranks)
        return keel_pb2.AgentMessage(status=status)

    def step(self) -> None:
        """Its ranks did a step: their reports wait for the next send."""
        self.steps += 1
        now = time.time()
        start = self.start
        if self.batch is None or (self.batch.job, self.batch.generation) != (
            start.job,
            start.generation,
        ):
            self.batch = keel_pb2.StepReportBatch(job=start.job, generation=start.generation)
        # As the real agent sends them (``common.steps.summarize``): one entry a step.
        ranks = sorted(assignment.rank for assignment in start.ranks)
        self.batch.node_steps.append(
            keel_pb2.NodeStep(
                step=self.steps,
                ranks=ranks,
                tokens=4096 * len(ranks),
                at=now,
                step_time_s=[self.step_s * random.uniform(0.98, 1.02) for _ in ranks],
                loss=10.0 / (1 + 0.01 * self.steps),
            )
        )

    def take_batch(self) -> keel_pb2.AgentMessage | None:
        batch, self.batch = self.batch, None
        return keel_pb2.AgentMessage(steps=batch) if batch is not None else None

    async def run(self, leases: Leases, leader: LeaderKey) -> None:
        self.leases = leases
        self.lease_id = await leases.grant(LEASE_TTL_S)
        backoff, index = BACKOFF_FIRST_S, random.randrange(len(self.addresses))
        while True:
            address = leader.address or self.addresses[index % len(self.addresses)]
            started = time.monotonic()
            try:
                await self._stream(address)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    self.refusals += 1
                elif exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                    # Its lease is gone: a new one, as the real agent takes.
                    print(f"{self.node}: {exc.details()}", file=sys.stderr, flush=True)
                    self.lease_id = await leases.grant(LEASE_TTL_S)
            except Exception as exc:  # never lose an agent: say why, and reconnect
                self.errors += 1
                print(f"{self.node}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            self.connected = ""
            index += 1
            if time.monotonic() - started > 10.0:  # a healthy stream: start over
                backoff = BACKOFF_FIRST_S
            # Jittered exponential back-off, cut short when the leader key names a
            # leader, as agent/link.
            changed = leader.changed
            try:
                await asyncio.wait_for(changed.wait(), jittered(backoff))
                backoff = BACKOFF_FIRST_S
                await asyncio.sleep(jittered(BACKOFF_FIRST_S))
            except TimeoutError:
                backoff = min(RECONNECT_MAX_S, backoff * 2)

    async def _stream(self, address: str) -> None:
        async with grpc.aio.insecure_channel(address, options=self.options) as channel:
            call = keel_pb2_grpc.ControllerStub(channel).Connect(metadata=call_metadata(self.token))
            await call.write(self.hello())
            await call.write(self.status())
            first = await call.read()
            if first is grpc.aio.EOF:
                await call  # raises the refusal
                return
            self.report_interval_s = first.welcome.report_interval_s
            self.connects += 1
            self.connected = address
            # One writer per stream (gRPC allows no concurrent writes): what the
            # agent says is queued, and a failed write ends the stream.
            outbox: asyncio.Queue = asyncio.Queue()
            tasks = [
                asyncio.ensure_future(self._pump(call, outbox)),
                asyncio.ensure_future(self._report(outbox)),
            ]
            try:
                while True:
                    message = await call.read()
                    if message is grpc.aio.EOF:
                        break
                    self._on(message, outbox.put_nowait)
            finally:
                for task in tasks:
                    task.cancel()

    @staticmethod
    async def _pump(call, outbox: asyncio.Queue) -> None:
        try:
            while True:
                message = await outbox.get()
                if message is None:  # hang up: the controller ends the stream
                    await call.done_writing()
                    return
                await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            call.cancel()

    async def _report(self, outbox: asyncio.Queue) -> None:
        # Spread the agents' sends over the period, as independent machines would be.
        await asyncio.sleep(random.uniform(0, self.step_s))
        next_status = time.monotonic() + status_refresh_s(self.report_interval_s)
        next_send = time.monotonic()
        while True:
            if self.lease_id in self.leases.expired:
                # The record went with the lease: a new lease, and a Hello on it.
                self.leases.expired.discard(self.lease_id)
                self.lease_id = await self.leases.grant(LEASE_TTL_S)
                self.renewals += 1
                outbox.put_nowait(None)
                return
            if self.start is not None:
                self.step()
            now = time.monotonic()
            if now >= next_send:
                batch = self.take_batch()
                if batch is not None:
                    outbox.put_nowait(batch)
                # (From the last send, not from now: a step's sleep overruns a little.)
                next_send = max(
                    next_send + max(self.step_s, self.report_interval_s), now - self.step_s
                )
            if time.monotonic() >= next_status:  # a change is sent when it happens
                outbox.put_nowait(self.status())
                next_status += status_refresh_s(self.report_interval_s)
            await asyncio.sleep(self.step_s)

    def _on(self, message: keel_pb2.ControllerMessage, say) -> None:
        kind = message.WhichOneof("kind")
        if kind == "report_pace":
            self.report_interval_s = message.report_pace.interval_s
        elif kind == "prepare_rendezvous":
            prep = message.prepare_rendezvous
            say(
                keel_pb2.AgentMessage(
                    rendezvous_ready=keel_pb2.RendezvousReady(
                        job=prep.job, generation=prep.generation, host="127.0.0.1", port=29500
                    )
                )
            )
        elif kind == "start_generation":
            start = message.start_generation
            if self.started != (start.job, start.generation):
                self.start, self.started, self.steps = start, (start.job, start.generation), 0
                say(self.status())
        elif kind == "stop_generation":
            stop = message.stop_generation
            if self.start is not None and (self.start.job, self.start.generation) == (
                stop.job,
                stop.generation,
            ):
                self.start = None
            say(
                keel_pb2.AgentMessage(
                    generation_stopped=keel_pb2.GenerationStopped(
                        job=stop.job, generation=stop.generation
                    )
                )
            )
            say(self.status())
        elif kind == "resync":
            say(self.status())


async def main(args) -> None:
    leases = Leases(args.etcd)
    # A TCP connection per agent, with the real agent's keepalives and limits.
    options = [("grpc.use_local_subchannel_pool", 1), *rpc.AGENT_CHANNEL_OPTIONS]
    names = [f"{args.prefix}{i:05d}" for i in range(args.agents)]
    agents = [
        Agent(name, zlib.crc32(name.encode()), args.controllers, args.token, args.step_s, options)
        for name in names
    ]
    leases.keep_alive(LEASE_TTL_S / 3)
    leader = LeaderKey(args.etcd)
    follower = asyncio.ensure_future(leader.follow())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)

    async def tell():
        while True:
            by: dict[str, int] = {}
            paced: dict[str, int] = {}  # report interval asked -> agents connected
            for agent in agents:
                if agent.connected:
                    by[agent.connected] = by.get(agent.connected, 0) + 1
                    interval = f"{agent.report_interval_s:g}"
                    paced[interval] = paced.get(interval, 0) + 1
            sys.stdout.write(json.dumps({"at": time.time(), "by": by, "paced": paced}) + "\n")
            sys.stdout.flush()
            await asyncio.sleep(0.5)

    teller = asyncio.ensure_future(tell())
    tasks = []
    for agent in agents:
        tasks.append(asyncio.ensure_future(agent.run(leases, leader)))
        if args.ramp_s:
            await asyncio.sleep(args.ramp_s / args.agents)
    await stop.wait()
    teller.cancel()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    sys.stdout.write(
        json.dumps(
            {
                "summary": True,
                "agents": len(agents),
                "connected": sum(bool(a.connected) for a in agents),
                "connects": sum(a.connects for a in agents),
                "refusals": sum(a.refusals for a in agents),
                "errors": sum(a.errors for a in agents),
                "lease_renewals": sum(a.renewals for a in agents),
                "cpu_s": usage.ru_utime + usage.ru_stime,
            }
        )
        + "\n"
    )
    sys.stdout.flush()
    follower.cancel()
    for task in tasks:
        task.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--controllers", required=True, type=lambda s: s.split(","))
    parser.add_argument("--token", required=True)
    parser.add_argument("--agents", type=int, required=True)
    parser.add_argument("--prefix", default="sim-")
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument(
        "--ramp-s", type=float, default=0.0, help="start the agents evenly over this many seconds"
    )
    asyncio.run(main(parser.parse_args()))
