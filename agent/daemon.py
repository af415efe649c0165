"""The agent daemon: lease, controller stream, rank supervision and the local channel.

The main thread owns the supervisor (ranks are started from it, so PR_SET_PDEATHSIG
ties them to a thread that lives as long as the agent). Other threads only feed the
event queue: controller messages, trainer reports.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import shutil
import signal
import tempfile
import threading
import time

import grpc
import structlog

from agent import leftovers, metrics
from agent.config import AgentConfig
from common import keys, procs
from common.etcd import EtcdClient
from common.tls import call_metadata, channel
from agent.local_server import AgentLocalService, serve
from agent.failure import tail
from agent.hang import HangConfig, RankProgress, find_hang
from agent.stacks import dump_since, parse_dump, where
from agent.supervisor import RankPhase, Supervisor
from protos import keel_pb2, keel_pb2_grpc

log = structlog.get_logger()

STACK_DUMP_WAIT_S = 0.5      # faulthandler writes within milliseconds; slack for a busy node
STACK_TAIL_BYTES = 65536


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.etcd = EtcdClient(list(config.etcd_endpoints), config.etcd_timeout_s,
                               config.etcd_credentials)
        self.events: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.supervisor = Supervisor(config.run_dir, config.stop_grace_s)
        self.lease = None
        self.stream_call = None      # the Connect call in progress, to cancel on a new lease
        self.socket_dir = tempfile.mkdtemp(prefix="keel-agent-")
        self.socket_path = f"{self.socket_dir}/agent.sock"
        self.local_server: grpc.Server | None = None
        self.step_lock = threading.Lock()
        self.pending_steps: list[keel_pb2.StepReport] = []
        self.current: keel_pb2.StartGeneration | None = None
        self.stopping_generation: tuple[str, int] | None = None
        # Guarded by step_lock: each rank's latest report of the current generation and
        # when it arrived (monotonic): progress for the hang detector, and sent again
        # after every Hello (marked replayed) for the job's step and loss.
        self.latest: dict[int, tuple[float, keel_pb2.StepReport]] = {}
        self.step_times: collections.deque = collections.deque(maxlen=64)
        self.checkpoint_wanted = False
        self.hang_reported = False
        self.hang_config = HangConfig()
        # Exits and the newest commit of the current generation, sent again after every
        # Hello: a controller that took over may have missed them (both are idempotent
        # there, and an older commit than the newest changes nothing).
        self.replay: list[keel_pb2.AgentMessage] = []

    # ================================================================ lifecycle
    def run(self) -> None:
        try:
            self.config.run_dir.mkdir(parents=True, exist_ok=True)
            leftovers.take_over(self.config.run_dir, self.socket_path)
            self.lease = self.etcd.lease(int(self.config.lease_ttl_s))
            self.local_server = serve(self.socket_path, AgentLocalService(
                self._on_local_steps, lambda saved: self.events.put(("checkpoint", saved)),
                lambda report: self.events.put(("preflight", report))))
            if self.config.metrics_port is not None:
                metrics.serve(self.config.metrics_port)
            threading.Thread(target=self._keep_lease, name="lease", daemon=True).start()
            threading.Thread(target=self._stream_forever, name="stream", daemon=True).start()
            log.info("agent started", slots=self.config.slots, lease_id=self.lease.id,
                     socket=self.socket_path)
            self._main_loop()
        finally:
            self._shutdown()

    def request_stop(self, *_):
        self.stopping.set()
        self.events.put(("wake", None))

    def _shutdown(self) -> None:
        self.supervisor.stop_all(self.config.stop_grace_s + 2)
        # Whatever the ranks started outside their process groups goes too.
        leftovers.kill_marked(self.socket_path)
        self.outbox.put(None)
        if self.local_server is not None:
            self.local_server.stop(0.5).wait()
        try:
            if self.lease is not None:
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
                alive = self.lease.refresh()[0].TTL > 0
            except Exception as exc:  # etcd down or restarting: it keeps leases across
                log.warning("lease refresh failed", error=str(exc), lease_id=self.lease.id)
                continue
            if not alive:
                self._register_again()

    def _register_again(self) -> None:
        """The lease is gone (it expired while etcd was out of reach, or etcd lost its
        data): take a new one and say Hello again on it, ranks still running."""
        try:
            lease = self.etcd.lease(int(self.config.lease_ttl_s))
        except Exception as exc:
            log.warning("cannot grant a new lease; retrying", error=str(exc))
            return
        log.warning("etcd lease lost; registering again", old_lease_id=self.lease.id,
                    lease_id=lease.id)
        self.lease = lease
        call = self.stream_call
        if call is not None:
            call.cancel()  # the stream loop reconnects at once with a Hello on the new lease

    # =================================================================== stream
    def _controller_address(self) -> str | None:
        if self.config.controller:
            return self.config.controller
        raw, _ = self.etcd.get(keys.LEADER)
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
                try:
                    self._stream_once(address)
                except Exception as exc:  # e.g. TLS files unreadable: retry, never die
                    log.error("cannot connect to the controller", address=address,
                              error=f"{type(exc).__name__}: {exc}")
                if time.monotonic() - started > 10:
                    backoff = 0.1
            if self.stopping.wait(backoff):
                return
            backoff = min(backoff * 2, self.config.reconnect_max_s)

    def _requests(self, closed: threading.Event):
        hello = keel_pb2.Hello(node=self.config.node, host=self.config.host,
                               slots=self.config.slots, lease_id=self.lease.id,
                               pid=os.getpid())
        current = self.current
        if current is not None:
            # The generation this agent runs, even when all its ranks here have exited
            # (their exits are replayed right after this Hello).
            hello.running_job, hello.running_generation = current.job, current.generation
            hello.running.extend(
                keel_pb2.RankAssignment(rank=r.rank, local_rank=r.local_rank)
                for r in self.supervisor.of_generation(current.job, current.generation)
                if r.popen.returncode is None)
        yield keel_pb2.AgentMessage(hello=hello)
        with self.step_lock:
            latest = [report for _, report in sorted(self.latest.values(),
                                                     key=lambda seen: seen[1].rank)]
        if current is not None and latest:
            yield keel_pb2.AgentMessage(steps=keel_pb2.StepReportBatch(
                job=current.job, generation=current.generation, reports=latest,
                replayed=True))
        yield from list(self.replay)
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
        metadata = call_metadata(self.config.token)
        with channel(address, self.config.tls) as link:
            stub = keel_pb2_grpc.ControllerStub(link)
            self.stream_call = stub.Connect(self._requests(closed), metadata=metadata)
            try:
                for message in self.stream_call:
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
                self.stream_call = None
                closed.set()

    def _send(self, **kind) -> None:
        self.outbox.put(keel_pb2.AgentMessage(**kind))

    # ============================================================ local reports
    def _on_local_steps(self, generation: int, reports: list) -> bool:
        """Queue reports for the controller and note progress; return whether the
        controller's checkpoint request is to be passed on (once: the trainers agree
        among themselves on the step)."""
        now = time.monotonic()
        with self.step_lock:
            current = self.current
            if current is None or generation != current.generation:
                return False  # a straggling report from a generation that is gone
            self.pending_steps.extend(reports)
            for report in reports:
                self.latest[report.rank] = (now, report)  # a rank reports in step order
                if report.step_time_s > 0:
                    self.step_times.append(report.step_time_s)
            wanted, self.checkpoint_wanted = self.checkpoint_wanted, False
            return wanted

    def _flush_steps(self) -> None:
        with self.step_lock:
            reports, self.pending_steps = self.pending_steps, []
            current = self.current
            last = {rank: report.step for rank, (_, report) in self.latest.items()}
        if not reports or current is None:
            return
        for proc in self.supervisor.of_generation(current.job, current.generation):
            proc.last_step = last.get(proc.rank, proc.last_step)
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
                    self.replay = [m for m in self.replay
                                   if m.WhichOneof("kind") != "checkpoint_saved"]
                    self.replay.append(keel_pb2.AgentMessage(checkpoint_saved=payload))
                elif kind == "preflight":
                    self._send(preflight=payload)
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
                self.replay.append(keel_pb2.AgentMessage(rank_exited=report))
            self._maybe_confirm_stop()
            self._check_hang(now)
            metrics.RANKS_RUNNING.set(sum(1 for r in self.supervisor.ranks
                                          if r.popen.returncode is None))
            if now >= next_flush:
                self._flush_steps()
                next_flush = now + self.config.report_flush_s

    def _on_controller(self, message: keel_pb2.ControllerMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "prepare_rendezvous":
            prep = message.prepare_rendezvous
            port = procs.free_port(self.config.host)
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
            ranks = self.supervisor.of_generation(stop.job, stop.generation)
            running = [r for r in ranks if r.phase is RankPhase.RUNNING]
            if stop.collect_stacks and running and not self.hang_reported:
                self._report_stacks(stop.job, stop.generation, running, hang=None)
            self.supervisor.stop(ranks, time.monotonic())
            self.stopping_generation = (stop.job, stop.generation)
        elif kind == "checkpoint_now":
            request = message.checkpoint_now
            with self.step_lock:
                if self.current is not None and self.current.generation == request.generation:
                    self.checkpoint_wanted = True
            log.info("checkpoint requested", job=request.job, generation=request.generation,
                     reason=request.reason)

    def _start(self, start: keel_pb2.StartGeneration) -> None:
        # A node runs one generation at a time: anything older goes first.
        older = [r for r in self.supervisor.ranks if r.generation != start.generation
                 or r.job != start.job]
        if older:
            log.warning("stopping ranks of an older generation before starting",
                        count=len(older))
            self.supervisor.stop_all(self.config.stop_grace_s + 2)
            for job, generation in {(r.job, r.generation) for r in older}:
                leftovers.kill_marked(self.socket_path, job, generation)
            self.supervisor.ranks.clear()
        self.replay = []
        with self.step_lock:
            self.current = start
            self.pending_steps.clear()
            self.latest.clear()
            self.step_times.clear()
            self.checkpoint_wanted = False
        self.hang_reported = False
        health = start.health
        try:
            self.hang_config = HangConfig(floor_s=health.hang_floor_s, k=health.hang_k,
                                          first_step_timeout_s=health.first_step_timeout_s,
                                          checkpoint_timeout_s=health.checkpoint_timeout_s)
            self.supervisor.start(start, self.socket_path)
        except (ValueError, OSError) as exc:
            # A health budget that makes no sense, or a command that cannot be executed
            # at all: report it as the ranks' failure, with the reason.
            log.error("cannot start ranks", error=str(exc), command=list(start.command))
            for assignment in start.ranks:
                self._send(rank_exited=keel_pb2.RankExited(
                    job=start.job, generation=start.generation, rank=assignment.rank,
                    exit_code=127, traceback=f"cannot start {list(start.command)}: {exc}",
                    exited_at=time.time()))

    # ===================================================================== hangs
    def _check_hang(self, now: float) -> None:
        current = self.current
        if current is None or self.hang_reported or self.stopping_generation:
            return
        ranks = [r for r in self.supervisor.of_generation(current.job, current.generation)
                 if r.phase is RankPhase.RUNNING]
        if not ranks:
            return
        with self.step_lock:
            latest = dict(self.latest)
            recent = list(self.step_times)
        progress = []
        for r in ranks:
            at, report = latest.get(r.rank, (None, keel_pb2.StepReport()))
            progress.append(RankProgress(rank=r.rank, pid=r.pid, started_at=r.started_at,
                                         last_report_at=at, last_step=report.step,
                                         checkpointing=report.checkpointing))
        hang = find_hang(now, progress, recent, self.hang_config)
        if hang is None:
            return
        log.warning("hang detected", job=current.job, generation=current.generation,
                    rank=hang.rank, reason=hang.reason)
        self._report_stacks(current.job, current.generation, ranks, hang)
        self.supervisor.stop(ranks, now)
        self.stopping_generation = (current.job, current.generation)

    def _report_stacks(self, job: str, generation: int, ranks: list, hang) -> None:
        """SIGUSR1 every rank of ``ranks``, all running (faulthandler dumps its threads
        to stderr), read what each wrote, and report the stacks of ``job``'s
        ``generation``, with the hang if this agent detected it."""
        before = {r.rank: tail(r.stderr_path, STACK_TAIL_BYTES) for r in ranks}
        for proc in ranks:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(STACK_DUMP_WAIT_S)
        stacks = {}
        for proc in ranks:
            dump = dump_since(before[proc.rank], tail(proc.stderr_path, STACK_TAIL_BYTES))
            parsed = parse_dump(dump)
            stacks[proc.rank] = f"{where(parsed) or 'no stack dumped'}\n{dump.strip()}"
        self.hang_reported = True
        report = keel_pb2.HangDetected(job=job, generation=generation, stacks=stacks,
                                       detected_at=time.time())
        if hang is not None:
            report.rank, report.pid, report.last_step = hang.rank, hang.pid, hang.last_step
            report.stalled_for_s, report.timeout_s = hang.stalled_for_s, hang.timeout_s
            report.phase = hang.phase
        self._flush_steps()
        self._send(hang_detected=report)

    def _maybe_confirm_stop(self) -> None:
        if self.stopping_generation is None:
            return
        job, generation = self.stopping_generation
        if self.supervisor.generation_done(job, generation):
            escaped = leftovers.kill_marked(self.socket_path, job, generation)
            if escaped:
                log.warning("killed processes the ranks had moved out of their process "
                            "groups", job=job, generation=generation, count=escaped)
            self.supervisor.forget(job, generation)
            self.stopping_generation = None
            with self.step_lock:
                if self.current is not None and self.current.generation == generation:
                    self.current = None
            log.info("generation stopped", job=job, generation=generation)
            self._send(generation_stopped=keel_pb2.GenerationStopped(job=job,
                                                                     generation=generation))


def run(config: AgentConfig) -> None:
    agent = Agent(config)
    signal.signal(signal.SIGTERM, agent.request_stop)
    signal.signal(signal.SIGINT, agent.request_stop)
    agent.run()
