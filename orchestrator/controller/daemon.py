"""The controller daemon: one gRPC server (``grpc.aio``, on an event loop thread of its
own) whose calls go to the agent sessions (``Connect``, streams on the loop) and the
operator service (on the server's thread pool), one reconcile thread that leads (or
campaigns) and observes, decides and applies, and a watch of the node records.

Every controller serves; only the leader acts. A standby answers every call with
UNAVAILABLE and the leader's address.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
import time

import grpc
import structlog

from common import keys, rpc
from common import metrics as common_metrics
from common.etcd import connect
from common.net import listen_address
from common.paths import write_atomically as write_address
from common.records import RecordError
from common.watch import Watch
from orchestrator.controller import bootstrap, exporter, metrics
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.executor import Executor
from orchestrator.controller.leadership import Leadership
from orchestrator.controller.operator_service import OperatorService
from orchestrator.controller.rebuild import load_jobs
from orchestrator.controller.reconcile import Reconciler
from orchestrator.controller.sessions import (
    ADMISSION_QUEUE,
    MAX_AGENTS,
    OPERATOR_THREADS,
    AgentService,
)
from orchestrator.controller.state import ControllerState
from orchestrator.controller.store import Store, log_set_aside
from orchestrator.security.auth import AioTokenInterceptor
from orchestrator.security.call_limits import CONTROLLER_LIMITS
from orchestrator.security.certs import NodeSigner
from protos import keel_pb2, keel_pb2_grpc

log = structlog.get_logger()

# Calls the server takes at once (gRPC refuses the next with RESOURCE_EXHAUSTED, unread):
# a stream for every agent it serves, as many Connects again as the admission queue
# holds, and a few operators' calls queued for each operator thread. A Connect that
# never says its Hello holds one for ``deadlines.HELLO_TIMEOUT_S`` at most.
MAX_CALLS = MAX_AGENTS + ADMISSION_QUEUE + 4 * OPERATOR_THREADS


def _set_aside(error: RecordError) -> None:
    """A stored value that does not parse: named in the log and counted, then passed
    over; it stays in etcd for an operator to mend."""
    metrics.RECORDS_SET_ASIDE.labels(keys.kind_of(error.key)).inc()
    log_set_aside(error)


class Controller(keel_pb2_grpc.ControllerServicer):
    def __init__(self, config: ControllerConfig):
        self.config = config
        self.state = ControllerState(
            config,
            Store(
                connect(
                    list(config.etcd_endpoints), config.etcd_timeout_s, config.etcd_credentials
                ),
                set_aside=_set_aside,
            ),
        )
        self.leadership = Leadership(self.state, self._lead)
        self.executor = Executor(self.state)
        self.agents = AgentService(self.state, self.leadership)
        self.operator = OperatorService(self.state, self.leadership, self.executor)
        self.reconciler = Reconciler(self.state, self.leadership, self.executor)
        self.collector = self.metrics_server = self.bootstrap_server = None
        self.server: grpc.aio.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # The node records, kept in the state as etcd has them (a standby's too, so a
        # new leader knows them at once): no tick reads them.
        self.node_records = Watch(
            self.state.store.client,
            keys.NODES,
            prefix=True,
            on_reset=self.state.nodes_read,
            on_events=self.state.nodes_changed,
            name="the node records",
        )
        # The gRPC methods of the Controller service: Connect is the agents', the rest
        # the operators'.
        self.Connect = self.agents.connect
        for method in keel_pb2.DESCRIPTOR.services_by_name["Controller"].methods_by_name:
            if method != "Connect":
                setattr(self, method, getattr(self.operator, method))

    @property
    def address(self) -> str:
        return self.state.address

    def _lead(self, now: float) -> None:
        """What a new leader knows: every job and cordon, as etcd has them."""
        state = self.state
        state.jobs = load_jobs(state.store, now)
        state.cordons = state.store.cordons()
        state.publish_reporting()

    def serve(self) -> str:
        """Bind, start campaigning for leadership and, once leading, reconciling; return
        host:port."""
        config = self.config
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="grpc-loop", daemon=True).start()
        port = asyncio.run_coroutine_threadsafe(self._start_server(), self.loop).result()
        self.state.address = f"{config.advertise_host}:{port}"
        bootstrap_port = None
        if config.bootstrap_port is not None:
            signer = NodeSigner(config.tls.ca, config.ca_key)
            host = config.listen.rpartition(":")[0]
            self.bootstrap_server, bootstrap_port = bootstrap.serve(
                self.state, signer, f"{host}:{config.bootstrap_port}", config.tokens or config.token
            )
        if config.metrics_listen is not None:
            self.collector = exporter.register(self.state)
            self.metrics_server = common_metrics.serve(
                listen_address(config.metrics_listen, config.advertise_host), config.tls
            )
            if config.metrics_address_file:
                write_address(
                    config.metrics_address_file,
                    f"{config.advertise_host}:{self.metrics_server.server_port}",
                )
        # Last: whoever waits for the address finds the metrics address there too.
        if config.address_file:
            write_address(config.address_file, self.state.address)
        self.node_records.start()
        self.leadership.start()
        threading.Thread(
            target=self.reconciler.loop, args=(time.monotonic,), name="reconcile", daemon=True
        ).start()
        threading.Thread(
            target=self.reconciler.score_loop, name="straggler-scoring", daemon=True
        ).start()
        log.info(
            "controller serving",
            address=self.state.address,
            controller_id=self.state.id,
            mutual_tls=config.tls is not None,
            role_tokens=config.tokens is not None,
            bootstrap_port=bootstrap_port,
            approve_agents=config.approve_agents if bootstrap_port is not None else None,
        )
        return self.state.address

    async def _start_server(self) -> int:
        """Make, bind and start the server on its loop; the port."""
        config = self.config
        self.server = rpc.aio_server(
            OPERATOR_THREADS,
            CONTROLLER_LIMITS,
            MAX_CALLS,
            [AioTokenInterceptor(config.tokens or config.token)],
        )
        keel_pb2_grpc.add_ControllerServicer_to_server(self, self.server)
        port = rpc.add_port(self.server, config.listen, config.tls)
        if port == 0:
            raise OSError(f"cannot listen on {config.listen}")
        await self.server.start()
        return port

    def shutdown(self, grace_s: float = 2.0) -> None:
        """Hand the lead over at once (revoking the leader lease deletes the key: a
        standby takes it at its next campaign, and agents watching the key follow),
        then close the agents' streams and stop serving."""
        state = self.state
        state.stopping.set()
        state.wake.set()
        self.leadership.release()
        self.node_records.stop()
        with state.lock:
            for session in state.sessions.values():
                session.close()
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self.loop).result(
                grace_s + 10
            )
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop(grace_s).wait(grace_s + 10)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            exporter.unregister(self.collector)
        log.info("controller stopped")


# The controller keeps a large, long-lived heap (every rank's recent steps, every
# agent's session) and makes a small object per step report: at the default thresholds
# the cyclic garbage collector ran so often that it took a large share of the time of
# recording a report (docs/BENCHMARKS.md, control_plane). Collect young objects 100x
# less often; what exists once serving (the imports, the code) is never scanned again.
GC_THRESHOLDS = (70_000, 10, 10)


def run(config: ControllerConfig) -> None:
    """Serve until SIGTERM or SIGINT."""
    gc.set_threshold(*GC_THRESHOLDS)
    controller = Controller(config)
    controller.serve()
    gc.freeze()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    controller.shutdown()
