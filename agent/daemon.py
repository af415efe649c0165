"""The agent daemon: lease, controller stream, rank supervision and the local channel.

The main thread owns the supervisor (ranks are started from it, so PR_SET_PDEATHSIG
ties them to a thread that lives as long as the agent). Other threads only feed the
event queue: controller messages, trainer reports.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import tempfile
import threading
import time

import etcd3
import grpc
import structlog

from agent import metrics
from agent.config import AgentConfig
from agent.local_server import AgentLocalService, serve
from agent.supervisor import Supervisor
from protos import keel_pb2, keel_pb2_grpc

log = structlog.get_logger()

LEADER_KEY = "/keel/controller/leader"


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        host, _, port = config.etcd_endpoints[0].rpartition(":")
        self.etcd = etcd3.client(host=host, port=int(port), timeout=config.etcd_timeout_s)
        self.events: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.supervisor = Supervisor(config.run_dir, config.stop_grace_s)
        self.lease = None
        self.socket_dir = tempfile.mkdtemp(prefix="keel-agent-")
        self.socket_path = f"{self.socket_dir}/agent.sock"
        self.local_server: grpc.Server | None = None
        self.step_lock = threading.Lock()
        self.pending_steps: list[keel_pb2.StepReport] = []
        self.current: keel_pb2.StartGeneration | None = None
        self.stopping_generation: tuple[str, int] | None = None

    # ================================================================ lifecycle
    def run(self) -> None:
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        self.lease = self.etcd.lease(int(self.config.lease_ttl_s))
        self.local_server = serve(self.socket_path, AgentLocalService(
            self._on_local_steps, lambda saved: self.events.put(("checkpoint", saved))))
        if self.config.metrics_port is not None:
            metrics.serve(self.config.metrics_port)
        threading.Thread(target=self._keep_lease, name="lease", daemon=True).start()
        threading.Thread(target=self._stream_forever, name="stream", daemon=True).start()
        log.info("agent started", slots=self.config.slots, lease_id=self.lease.id,
                 socket=self.socket_path)
        try:
            self._main_loop()
        finally:
            self._shutdown()

    def request_stop(self, *_):
        self.stopping.set()
        self.events.put(("wake", None))

    def _shutdown(self) -> None:
        self.supervisor.stop_all(self.config.stop_grace_s + 2)
        self.outbox.put(None)
        if self.local_server is not None:
            self.local_server.stop(0.5).wait()
        try:
            self.lease.revoke()  # the node record goes at once, not after the TTL
        except Exception as exc:
            log.warning("could not revoke lease", error=str(exc))
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        log.info("agent stopped")

    # ==================================================================== lease
    def _keep_lease(self) -> None:
        period = self.config.lease_ttl_s / 3
        while not self.stopping.wait(period):
            try:
                self.lease.refresh()
            except Exception as exc:
                log.warning("lease refresh failed", error=str(exc), lease_id=self.lease.id)

    # =================================================================== stream
    def _controller_address(self) -> str | None:
        if self.config.controller:
            return self.config.controller
        raw, _ = self.etcd.get(LEADER_KEY)
        return json.loads(raw)["address"] if raw else None

    def _stream_forever(self) -> None:
        backoff = 0.1
        while not self.stopping.is_set():
            try:
                address = self._controller_address()
            except Exception as exc:
                address = None
                log.warning("cannot read the controller address from etcd", error=str(exc))
            if address:
                started = time.monotonic()
                self._stream_once(address)
                if time.monotonic() - started > 10:
                    backoff = 0.1
            if self.stopping.wait(backoff):
                return
            backoff = min(backoff * 2, self.config.reconnect_max_s)

    def _requests(self, closed: threading.Event):
        yield keel_pb2.AgentMessage(hello=keel_pb2.Hello(
            node=self.config.node, host=self.config.host, slots=self.config.slots,
            lease_id=self.lease.id, pid=os.getpid()))
        while not closed.is_set():
            try:
                message = self.outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if message is None:
                return
            yield message

    def _stream_once(self, address: str) -> None:
        closed = threading.Event()
        metadata = (("authorization", f"Bearer {self.config.token}"),)
        with grpc.insecure_channel(address) as channel:
            stub = keel_pb2_grpc.ControllerStub(channel)
            try:
                for message in stub.Connect(self._requests(closed), metadata=metadata):
                    if message.WhichOneof("kind") == "welcome":
                        log.info("connected to controller", address=address,
                                 controller_id=message.welcome.controller_id)
                    else:
                        self.events.put(("controller", message))
            except grpc.RpcError as exc:
                if not self.stopping.is_set():
                    log.warning("controller stream ended", address=address,
                                code=str(exc.code()), details=exc.details())
            finally:
                closed.set()

    def _send(self, **kind) -> None:
        self.outbox.put(keel_pb2.AgentMessage(**kind))

    # ============================================================ local reports
    def _on_local_steps(self, generation: int, reports: list) -> None:
        with self.step_lock:
            current = self.current
            if current is None or generation != current.generation:
                return  # a straggling report from a generation that is gone
            self.pending_steps.extend(reports)

    def _flush_steps(self) -> None:
        with self.step_lock:
            reports, self.pending_steps = self.pending_steps, []
            current = self.current
        if not reports or current is None:
            return
        last = {}
        for report in reports:
            last[report.rank] = max(last.get(report.rank, 0), report.step)
        for proc in self.supervisor.of_generation(current.job, current.generation):
            proc.last_step = max(proc.last_step, last.get(proc.rank, 0))
        self._send(steps=keel_pb2.StepReportBatch(job=current.job,
                                                  generation=current.generation,
                                                  reports=reports))

    # ================================================================ main loop
    def _main_loop(self) -> None:
        next_flush = time.monotonic() + self.config.report_flush_s
        while not self.stopping.is_set():
            try:
                kind, payload = self.events.get(timeout=self.config.tick_s)
                if kind == "controller":
                    self._on_controller(payload)
                elif kind == "checkpoint":
                    self._flush_steps()
                    self._send(checkpoint_saved=payload)
            except queue.Empty:
                pass
            now = time.monotonic()
            for proc in self.supervisor.poll(now):
                report = proc.exit_report
                log.info("rank exited", job=proc.job, generation=proc.generation,
                         rank=proc.rank, pid=proc.pid, exit_code=report.exit_code,
                         signal=report.signal, stopped_by_agent=report.stopped_by_agent)
                metrics.RANK_EXITS.labels(outcome="ok" if report.exit_code == 0
                                          and report.signal == 0 else "failed").inc()
                self._flush_steps()
                self._send(rank_exited=report)
            self._maybe_confirm_stop()
            metrics.RANKS_RUNNING.set(sum(1 for r in self.supervisor.ranks
                                          if r.popen.returncode is None))
            if now >= next_flush:
                self._flush_steps()
                next_flush = now + self.config.report_flush_s

    def _on_controller(self, message: keel_pb2.ControllerMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "prepare_rendezvous":
            prep = message.prepare_rendezvous
            port = _free_port(self.config.host)
            log.info("rendezvous port chosen", job=prep.job, generation=prep.generation,
                     port=port)
            self._send(rendezvous_ready=keel_pb2.RendezvousReady(
                job=prep.job, generation=prep.generation, host=self.config.host, port=port))
        elif kind == "start_generation":
            self._start(message.start_generation)
        elif kind == "stop_generation":
            stop = message.stop_generation
            log.info("stopping generation", job=stop.job, generation=stop.generation,
                     reason=stop.reason)
            self.supervisor.stop(self.supervisor.of_generation(stop.job, stop.generation),
                                 time.monotonic())
            self.stopping_generation = (stop.job, stop.generation)

    def _start(self, start: keel_pb2.StartGeneration) -> None:
        # A node runs one generation at a time: anything older goes first.
        leftovers = [r for r in self.supervisor.ranks if r.generation != start.generation
                     or r.job != start.job]
        if leftovers:
            log.warning("stopping ranks of an older generation before starting",
                        count=len(leftovers))
            self.supervisor.stop_all(self.config.stop_grace_s + 2)
            self.supervisor.ranks.clear()
        with self.step_lock:
            self.current = start
            self.pending_steps.clear()
        try:
            self.supervisor.start(start, self.socket_path)
        except OSError as exc:
            # The command cannot be executed at all: report it as the rank's failure.
            log.error("cannot start ranks", error=str(exc), command=list(start.command))
            for assignment in start.ranks:
                self._send(rank_exited=keel_pb2.RankExited(
                    job=start.job, generation=start.generation, rank=assignment.rank,
                    exit_code=127, traceback=f"cannot start {list(start.command)}: {exc}",
                    exited_at=time.time()))

    def _maybe_confirm_stop(self) -> None:
        if self.stopping_generation is None:
            return
        job, generation = self.stopping_generation
        if self.supervisor.generation_done(job, generation):
            self.supervisor.forget(job, generation)
            self.stopping_generation = None
            with self.step_lock:
                if self.current is not None and self.current.generation == generation:
                    self.current = None
            log.info("generation stopped", job=job, generation=generation)
            self._send(generation_stopped=keel_pb2.GenerationStopped(job=job,
                                                                     generation=generation))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run(config: AgentConfig) -> None:
    agent = Agent(config)
    signal.signal(signal.SIGTERM, agent.request_stop)
    signal.signal(signal.SIGINT, agent.request_stop)
    agent.run()
