"""The agent daemon: its lease, its link to the controller, rank supervision and the
local channel, tied together by one main loop.

The main thread owns the supervisor (ranks are started from it, so PR_SET_PDEATHSIG
ties them to a thread that lives as long as the agent) and the generation's lifecycle
(``agent.generation``). Other threads only feed its event queue: controller messages
(``agent.link``), checkpoint and preflight reports from the ranks; step reports go
into ``agent.reports``.
"""

from __future__ import annotations

import math
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import grpc
import structlog
from google.protobuf import json_format

from agent import hangs, leftovers, metrics, peer, rank_logs, rank_user
from agent.config import AgentConfig
from agent.generation import WIRE_PHASES, Generation, Phase
from agent.hang import HangConfig
from agent.link import ControllerLink, status_refresh_s
from agent.local_server import AgentLocalService, LocalCallbacks, serve
from agent.memory import JobMemory, default_root
from agent.policy.fencing import hold_until, self_fence
from agent.pool import WarmPool, pool_env
from agent.reports import Reports
from agent.supervisor import RankPhase, Supervisor
from common import deadlines, lineage, net
from common import metrics as common_metrics
from common.etcd import EtcdClient
from common.leader import LeaderWatch
from common.net import listen_address
from common.paths import write_atomically
from protos import keel_pb2

log = structlog.get_logger()

# The agent tells the controller what it runs this often (AgentStatus); the controller
# resends or stops until that agrees with the plan.
STATUS_PERIOD_S = 1.0  # the status is looked at this often, and sent when it changed
# (and sent unchanged every link.status_refresh_s)
# A rank that parks waits this long at most for the main loop to say whether it is kept.
PARK_DECISION_S = 5.0
# The longest a replacement waits for a memory snapshot's copy from the partner before
# its ranks start without it (and restore from storage).
FETCH_TIMEOUT_S = 120.0


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.etcd = EtcdClient(
            list(config.etcd_endpoints), config.etcd_timeout_s, config.etcd_credentials
        )
        # The main loop's work, (kind, payload), from the other threads; what each kind
        # does (``_event_handlers``), and what each kind of controller message does
        # (``_commands``; the link itself takes Welcome and ReportPace).
        self.events: queue.Queue = queue.Queue()
        self._event_handlers = {
            "controller": self._on_controller,
            "checkpoint": self._on_event_checkpoint,
            "memory_snapshot": self._on_event_memory_snapshot,
            "memory_replicated": self._on_event_memory_replicated,
            "memory_copied": self._on_event_memory_copied,
            "preflight": lambda report: self._send(preflight=report),
            "park": lambda parked: self._park(*parked),
            "leave": self._on_event_leave,
            "problem": self._on_event_problem,
            "wake": lambda _: None,
        }
        self._commands = {
            "welcome": lambda _: None,
            "report_pace": lambda _: None,
            "prepare_rendezvous": self._do_prepare_rendezvous,
            "start_generation": self._start,
            "stop_generation": self._do_stop_generation,
            "checkpoint_now": self._do_checkpoint_now,
            "checkpoint_recorded": self._do_checkpoint_recorded,
            "etcd_unreachable": self._do_etcd_unreachable,
            "resync": self._do_resync,
            "read_log": self._do_read_log,
            "release_replicas": self._do_release_replicas,
            "replica_partner": self._do_replica_partner,
        }
        self.stopping = threading.Event()
        interface = net.interface_of(config.host)
        if interface is None:
            log.warning(
                "no interface of this machine holds the advertised host; the "
                "ranks' gloo picks its own address (set GLOO_SOCKET_IFNAME)",
                host=config.host,
            )
        self.socket_dir = tempfile.mkdtemp(prefix="keel-agent-")
        self.socket_path = f"{self.socket_dir}/agent.sock"
        if config.rank_user is not None:
            # The ranks' group passes to the socket, and lists nothing else.
            os.chown(self.socket_dir, -1, config.rank_user.gid)
            os.chmod(self.socket_dir, 0o710)
        self.pool = (
            WarmPool(
                config.slots,
                config.run_dir / "pool",
                pool_env(dict(os.environ), self.socket_path),
                refill_delay_s=config.warm_refill_delay_s,
                rank_user=config.rank_user,
                eager=config.warm_fill == "eager",
                **({"imports": config.warm_imports} if config.warm_imports else {}),
            )
            if config.warm_processes
            else None
        )
        self.memory = JobMemory(
            config.memory_dir or default_root(config.run_dir),
            config.memory_budget_bytes,
            config.rank_user,
        )
        # The copies of other nodes' snapshots this agent holds, and the thread that
        # sends this node's to its partner (``agent.peer``): with a memory tier only.
        self.replicas = peer.Replicas(self.memory.root, config.memory_budget_bytes)
        self.replicator = (
            peer.Replicator(
                config.node,
                config.tls,
                config.replication_mbps * 1e6 / 8,
                lambda *done: self.events.put(("memory_replicated", done)),
            )
            if self.memory.enabled
            else None
        )
        self.peer_server: grpc.Server | None = None
        self.peer_address = ""
        self.partner: tuple[str, str] | None = None  # this generation's (node, address)
        self._offered: dict[tuple[str, int], tuple[str, int]] = {}  # → (job, generation)
        # The newest snapshot every node of the running generation committed: what a
        # new partner is given at once (``_do_replica_partner``).
        self._newest_snapshot: keel_pb2.MemorySnapshotSaved | None = None
        self.supervisor = Supervisor(
            config.run_dir,
            node=config.node,
            interface=interface or "",
            pool=self.pool,
            in_place=config.restart_in_place,
            rank_user=config.rank_user,
            memory=self.memory if self.memory.enabled else None,
        )
        self.generation = Generation()
        self.started: tuple[str, int] | None = None  # the newest StartGeneration's
        self.started_id = ""  # ... job id
        self.reports = Reports()
        self.hang_config = HangConfig()
        self.lease = None
        self.lease_ok_at = 0.0  # monotonic: the lease was last renewed (or granted)
        self.metrics_server = None
        self.leaving_since: float | None = None  # monotonic: SIGTERM asked it to drain
        self.rank_series = metrics.RankSeries(config.node)
        self.accelerator = config.accelerator or detect_accelerator()
        # Monotonic: until then the leading controller's word that etcd is out of its
        # reach too holds off self-fencing (``policy.fencing``); -inf: no hold.
        self.held_until = -math.inf
        self.local_server: grpc.Server | None = None
        self.leaders = LeaderWatch(self.etcd)
        self.link = ControllerLink(
            self.leaders,
            config.token,
            config.tls,
            config.controller,
            config.reconnect_max_s,
            self._opening,
            lambda message: self.events.put(("controller", message)),
            self.stopping,
        )

    # ================================================================ lifecycle
    def run(self) -> None:
        try:
            self.config.run_dir.mkdir(parents=True, exist_ok=True)
            if self.config.rank_user is not None:
                # Passable to the ranks' directories inside, listable by none of them.
                os.chmod(self.config.run_dir, 0o711)
            leftovers.take_over(self.config.run_dir, self.socket_path)
            self.lease = self.etcd.lease(int(self.config.lease_ttl_s))
            self.lease_ok_at = time.monotonic()
            self.local_server = serve(
                self.socket_path,
                AgentLocalService(
                    LocalCallbacks(
                        identify=self.supervisor.identify,
                        on_steps=self._on_steps,
                        on_checkpoint=self._on_checkpoint,
                        on_memory_snapshot=lambda saved: self.events.put(
                            ("memory_snapshot", saved)
                        ),
                        on_preflight=lambda report: self.events.put(("preflight", report)),
                        on_problem=lambda problem: self.events.put(("problem", problem)),
                        recorded_step=self.reports.recorded_step,
                        on_attach=self._on_attach,
                        leaving=self.supervisor.leaving,
                        on_park=self._on_park,
                        next_generation=self.supervisor.parking.answer,
                        parked=lambda token: self.supervisor.parking.find(token) is not None,
                    )
                ),
                workers=2 * self.config.slots + 8,
            )
            if self.config.rank_user is not None:
                os.chown(self.socket_path, -1, self.config.rank_user.gid)
                os.chmod(self.socket_path, 0o660)
            if self.config.metrics_listen is not None:
                self.metrics_server = common_metrics.serve(
                    listen_address(self.config.metrics_listen, self.config.host), self.config.tls
                )
                if self.config.metrics_address_file:
                    write_atomically(
                        self.config.metrics_address_file,
                        f"{self.config.host}:{self.metrics_server.server_port}",
                    )
            if self.memory.enabled:
                self.peer_server, port = peer.serve(
                    listen_address(self.config.peer_listen, self.config.host),
                    self.config.tls,
                    self.replicas,
                )
                self.peer_address = f"{self.config.host}:{port}"
            threading.Thread(target=self._keep_lease, name="lease", daemon=True).start()
            self.leaders.start()
            threading.Thread(target=self.link.run, name="stream", daemon=True).start()
            log.info(
                "agent started",
                slots=self.config.slots,
                lease_id=self.lease.id,
                socket=self.socket_path,
            )
            self._main_loop()
        finally:
            self._shutdown()

    def request_stop(self, *_):
        """SIGINT, or a second signal: stop now (the ranks with their grace)."""
        self.stopping.set()
        self.events.put(("wake", None))

    def request_leave(self, *_):
        """SIGTERM: drain this node (``Leaving``) if it runs ranks and the controller
        is there to move the job; stop once they are stopped, or after the drain
        timeout. With nothing to drain, or asked twice, stop now."""
        if self.leaving_since is not None or not self._live_ranks_any() or not self.link.up:
            self.request_stop()
            return
        self.leaving_since = time.monotonic()
        self.events.put(("leave", None))

    def _live_ranks_any(self) -> bool:
        return any(r.live for r in self.supervisor.ranks)

    def _leave_done(self, now: float) -> bool:
        """Leaving, and nothing is left to drain (or it took too long)."""
        if self.leaving_since is None:
            return False
        if now - self.leaving_since > self.config.drain_timeout_s:
            log.warning(
                "drain timed out; stopping the ranks", drain_timeout_s=self.config.drain_timeout_s
            )
            return True
        return not self._live_ranks_any() and self.generation.phase is Phase.IDLE

    def _shutdown(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.supervisor.stop_all(self.config.stop_grace_s + 2)
        self.supervisor.parking.kill_all()
        # Whatever the ranks started outside their process groups goes too.
        leftovers.kill_marked(self.socket_path)
        if self.replicator is not None:
            self.replicator.close()
        if self.peer_server is not None:
            self.peer_server.stop(0.5).wait()
        self.memory.close()
        self.link.close()
        self.leaders.stop()
        if self.local_server is not None:
            self.local_server.stop(0.5).wait()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        try:
            if self.lease is not None:
                self.lease.revoke()  # the node record goes at once, not after the TTL
        except Exception as exc:
            # etcd refuses it to the shared agent certificate's user, who may not
            # write the node record on it (``orchestrator.security.etcd_roles``).
            log.warning(
                "could not revoke lease; the node record goes when it expires",
                error=str(exc),
                lease_ttl_s=self.config.lease_ttl_s,
            )
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        log.info("agent stopped")

    # ==================================================================== lease
    def _keep_lease(self) -> None:
        """Refresh the lease on the deadline chain's schedule (``common.deadlines``): a
        refresh that fails (a member stalled: the client moves to another) is tried
        again soon, not a whole period later."""
        ttl_s = self.config.lease_ttl_s
        wait = deadlines.lease_refresh_s(ttl_s)
        while not self.stopping.wait(wait):
            wait = deadlines.lease_retry_s(ttl_s)
            try:
                alive = self.lease.refresh()[0].TTL > 0
            except Exception as exc:  # etcd down or restarting: it keeps leases across
                log.warning("lease refresh failed", error=str(exc), lease_id=self.lease.id)
                continue
            wait = deadlines.lease_refresh_s(ttl_s)
            self.held_until = -math.inf  # etcd answers us again
            if alive:
                self.lease_ok_at = time.monotonic()
            else:
                self._register_again()

    def _register_again(self) -> None:
        """The lease is gone (it expired while etcd was out of reach, or etcd lost its
        data): take a new one and say Hello again on it, ranks still running."""
        try:
            lease = self.etcd.lease(int(self.config.lease_ttl_s))
        except Exception as exc:
            log.warning("cannot grant a new lease; retrying", error=str(exc))
            return
        log.warning(
            "etcd lease lost; registering again", old_lease_id=self.lease.id, lease_id=lease.id
        )
        self.lease, self.lease_ok_at = lease, time.monotonic()
        self.link.reconnect()  # the next stream opens with a Hello on the new lease

    # ==================================================================== Hello
    def _opening(self) -> list[keel_pb2.AgentMessage]:
        """What opens every stream: a Hello naming the generation this agent runs (even
        when all its ranks here have exited) and its live ranks, then the replays."""
        config = self.config
        hello = keel_pb2.Hello(
            node=config.node,
            host=config.host,
            slots=config.slots,
            lease_id=self.lease.id,
            pid=os.getpid(),
            heartbeat_s=config.report_flush_s,
            reconnect_max_s=config.reconnect_max_s,
            lease_ttl_s=config.lease_ttl_s,
            accelerator=self.accelerator,
            peer_address=self.peer_address,
            failure_domain=config.failure_domain,
        )
        current = self.generation.start
        if current is not None:
            hello.running_job, hello.running_generation = current.job, current.generation
            hello.running.extend(self._live_ranks(current))
            partner = self.partner
            hello.replica_node = partner[0] if partner is not None else ""
        opening = [
            keel_pb2.AgentMessage(hello=hello),
            *self.reports.replay(),
            keel_pb2.AgentMessage(status=self._status()),
        ]
        if self.leaving_since is not None:
            opening.append(keel_pb2.AgentMessage(leaving=self._leaving()))
        return opening

    @staticmethod
    def _leaving() -> keel_pb2.Leaving:
        return keel_pb2.Leaving(
            reason="its agent was sent SIGTERM (the node is shutting down or being drained)"
        )

    def _live_ranks(self, start: keel_pb2.StartGeneration) -> list[keel_pb2.RankAssignment]:
        return [
            keel_pb2.RankAssignment(rank=r.rank, local_rank=r.local_rank)
            for r in self.supervisor.of_generation(start.job, start.generation)
            if r.live
        ]

    def _status(self) -> keel_pb2.AgentStatus:
        """What this agent runs: the generation (running or being stopped), its live
        ranks, the newest start it was given, and its ranks' processes that SIGKILL
        did not end."""
        state = self.generation
        status = keel_pb2.AgentStatus(phase=WIRE_PHASES.to_wire(state.phase))
        current = state.start
        if current is not None:
            status.job, status.generation = current.job, current.generation
            status.running.extend(self._live_ranks(current))
        elif state.stopping is not None:
            status.job, status.generation = state.stopping
        if self.started is not None:
            status.started_job, status.started_generation = self.started
        if status.job:
            status.stuck.extend(
                stuck
                for proc in self.supervisor.of_generation(status.job, status.generation)
                for stuck in proc.stuck
            )
        return status

    # ============================================================ rank reports
    def _job_of(self, generation: int) -> str:
        start = self.generation.start
        return start.job if start is not None and start.generation == generation else ""

    def _on_steps(self, generation: int, reports: list) -> int | None:
        """A rank's step reports (from the local server's threads); the checkpoint
        request to pass on (``Reports.add_steps``)."""
        job = self._job_of(generation)
        if job:
            self.rank_series.steps(job, reports)
        return self.reports.add_steps(generation, reports)

    def _on_attach(self, who, rank: int, restart_in_place: bool) -> None:
        """Rank ``rank`` reports its steps: it may be judged hung before its first; and
        it may say it can restart in place."""
        for proc in self.supervisor.of_generation(who.job, who.generation):
            if proc.rank == rank:
                proc.attached = True
                proc.in_place = proc.in_place or restart_in_place

    def _on_park(self, token: str, request: keel_pb2.RankPark) -> str | None:
        """A rank leaves its generation alive (the local server's thread): the main
        thread decides; None if it is kept, else why not."""
        decided: queue.Queue = queue.Queue(maxsize=1)
        self.events.put(("park", (token, request, decided)))
        try:
            return decided.get(timeout=PARK_DECISION_S)
        except queue.Empty:
            return f"the agent did not decide within {PARK_DECISION_S:g} s"

    def _park(self, token: str, request: keel_pb2.RankPark, decided: queue.Queue) -> None:
        if self.leaving_since is not None:
            decided.put("the node is draining")
            return
        kept = self.supervisor.park(token, request, time.monotonic())
        if kept is None:
            decided.put(None)
            return
        if isinstance(kept, str):
            log.info(
                "not keeping a rank for restart in place",
                generation=request.generation,
                rank=request.rank,
                reason=kept,
            )
            decided.put(kept)
            return
        decided.put(None)
        self._report_exit(kept)

    def _report_exit(self, report: keel_pb2.RankExited) -> None:
        """A rank is done with its generation (exited, or parked alive): logged, counted,
        and told to the controller after the steps it reported before."""
        log.info(
            "rank exited",
            job=report.job,
            generation=report.generation,
            rank=report.rank,
            pid=report.pid,
            exit_code=report.exit_code,
            signal=report.signal,
            stopped_by_agent=report.stopped_by_agent,
            parked=report.parked,
        )
        metrics.RANK_EXITS.labels(
            node=self.config.node,
            outcome=(
                "stopped"
                if report.stopped_by_agent
                else "parked"
                if report.parked
                else "signal"
                if report.signal
                else "ok"
                if report.exit_code == 0
                else "failed"
            ),
        ).inc()
        self._flush_steps()
        self._send(rank_exited=report)
        self.reports.remember(keel_pb2.AgentMessage(rank_exited=report))
        self._release_if_done(report.job, report.generation)

    def _release_if_done(self, job: str, generation: int) -> None:
        """The job's memory goes once every rank of its generation here has exited with
        status 0 of its own accord: the job is done (``agent.memory``)."""
        ranks = self.supervisor.of_generation(job, generation)
        if ranks and all(
            r.exit_report is not None
            and r.exit_report.exit_code == 0
            and not r.exit_report.signal
            and not r.exit_report.stopped_by_agent
            and not r.exit_report.parked
            for r in ranks
        ):
            self.memory.release(ranks[0].start.job_id, f"job {job} finished on this node")

    def _on_checkpoint(self, saved: keel_pb2.CheckpointSaved) -> None:
        job = self._job_of(saved.generation)
        if job:
            self.rank_series.checkpoint(job, saved)
        self.events.put(("checkpoint", saved))

    def _send(self, **kind) -> None:
        self.link.send(keel_pb2.AgentMessage(**kind))

    def _flush_steps(self) -> None:
        batch = self.reports.take_batch()
        if batch is None:
            return
        last = self.reports.last_steps()
        for proc in self.supervisor.of_generation(batch.job, batch.generation):
            proc.last_step = last.get(proc.rank, proc.last_step)
        self._send(steps=batch)

    # ================================================================ main loop
    def _main_loop(self) -> None:
        next_flush = time.monotonic() + self.config.report_flush_s
        next_status = time.monotonic() + STATUS_PERIOD_S
        sent_status, status_sent_at = None, 0.0
        while not self.stopping.is_set():
            try:
                kind, payload = self.events.get(timeout=self.config.tick_s)
                self._event_handlers[kind](payload)
            except queue.Empty:
                pass
            now = time.monotonic()
            if self.pool is not None:
                self.pool.refill(now)
            for proc in self.supervisor.poll(now):
                self._report_exit(proc.exit_report)
            self._maybe_confirm_stop()
            self._check_fence(now)
            self._check_hang(now)
            node = self.config.node
            metrics.RANKS_RUNNING.labels(node).set(sum(1 for r in self.supervisor.ranks if r.live))
            metrics.CONTROLLER_CONNECTED.labels(node).set(1 if self.link.up else 0)
            metrics.LEASE_OK.labels(node).set(
                1 if now - self.lease_ok_at < self.config.lease_ttl_s else 0
            )
            if now >= next_flush or self.reports.full():
                self._flush_steps()
                # At our own pace, or the controller's of a large cluster if longer.
                next_flush = now + max(self.config.report_flush_s, self.link.report_interval_s)
            if now >= next_status:
                # A status that did not change tells the controller nothing (it comes
                # again after every Hello): sent on a change, else every 10 s (longer
                # in a large cluster), so idle agents are not thousands of messages a second.
                status = self._status()
                if status != sent_status or now - status_sent_at >= status_refresh_s(
                    self.link.report_interval_s
                ):
                    self._send(status=status)
                    sent_status, status_sent_at = status, now
                next_status = now + STATUS_PERIOD_S
            if self._leave_done(now):
                self.stopping.set()

    # ========================================================= the main loop's events
    def _on_event_checkpoint(self, saved: keel_pb2.CheckpointSaved) -> None:
        """Every rank saved a checkpoint: the steps before it go first, then the
        commit, kept for replay."""
        self._flush_steps()
        self._send(checkpoint_saved=saved)
        self.reports.remember(keel_pb2.AgentMessage(checkpoint_saved=saved))

    def _on_event_memory_snapshot(self, saved: keel_pb2.MemorySnapshotSaved) -> None:
        """A memory snapshot every node committed: told to the controller, the newest
        kept for replay."""
        message = keel_pb2.AgentMessage(memory_snapshot_saved=saved)
        self.link.send(message)
        self.reports.remember(message)
        if self.started == (saved.job, saved.generation):
            self._newest_snapshot = saved
        self._replicate(saved)

    def _replicate(self, saved: keel_pb2.MemorySnapshotSaved) -> None:
        """Copy the snapshot ``saved`` reported to the partner (the newest committed,
        as fast as the bound lets)."""
        if (
            self.replicator is not None
            and self.partner is not None
            and self.started == (saved.job, saved.generation)
        ):
            self._offered[(self.started_id, saved.step)] = (saved.job, saved.generation)
            while len(self._offered) > 16:
                del self._offered[next(iter(self._offered))]
            self.replicator.offer(
                self.started_id,
                saved.step,
                self.memory.root / self.started_id / peer.snapshot_name(saved.step),
                *self.partner,
            )

    def _on_event_memory_replicated(self, done: tuple[str, int, str, int, float]) -> None:
        """A snapshot's copy is whole on the partner: told to the controller, which
        keeps it with the snapshot's record; the newest kept for replay."""
        job_id, step, partner, size, seconds = done
        metrics.REPLICATED_BYTES.labels(self.config.node).inc(size)
        metrics.REPLICATION_SECONDS.labels(self.config.node).inc(seconds)
        of = self._offered.pop((job_id, step), None)
        if of is None:
            return
        message = keel_pb2.AgentMessage(
            memory_snapshot_saved=keel_pb2.MemorySnapshotSaved(
                job=of[0],
                generation=of[1],
                step=step,
                bytes=size,
                replicated_to=partner,
                replicate_s=seconds,
            )
        )
        self.link.send(message)
        self.reports.remember(message)

    def _do_replica_partner(self, partner: keel_pb2.ReplicaPartner) -> None:
        """The running generation's partner was lost: its snapshots are copied to
        this one from now on, the newest at once."""
        if self.started != (partner.job, partner.generation) or not partner.address:
            return  # a generation that is no longer ours
        lost = self.partner[0] if self.partner else ""
        self.partner = (partner.node, partner.address)
        log.info(
            "memory snapshots now copied to another partner",
            job=partner.job,
            generation=partner.generation,
            lost=lost,
            partner=partner.node,
        )
        newest = self._newest_snapshot
        if newest is not None and (newest.job, newest.generation) == self.started:
            self._replicate(newest)

    def _do_release_replicas(self, release: keel_pb2.ReleaseReplicas) -> None:
        """A job ended: the copies of its snapshots held here for other nodes go."""
        self.replicas.release(release.job_id, "the job ended")

    def _on_event_leave(self, _payload: None) -> None:
        """SIGTERM with ranks running: tell the controller, which moves the job off."""
        log.info("draining the node before stopping", drain_timeout_s=self.config.drain_timeout_s)
        self.supervisor.parking.release_all("the node is draining", time.monotonic())
        self._send(leaving=self._leaving())

    def _on_event_problem(self, problem: keel_pb2.CheckpointProblem) -> None:
        """A rank would not use a checkpoint: the controller records why."""
        log.warning(
            "a rank would not use a checkpoint",
            kind=problem.kind,
            step=problem.step,
            path=problem.path,
            reason=problem.reason,
        )
        self._send(checkpoint_problem=problem)

    # ====================================================== the controller's messages
    def _on_controller(self, message: keel_pb2.ControllerMessage) -> None:
        """Do what ``message`` asks: the handler of its kind (``_commands``)."""
        kind = message.WhichOneof("kind")
        if kind is not None:
            self._commands[kind](getattr(message, kind))

    def _do_prepare_rendezvous(self, prep: keel_pb2.PrepareRendezvous) -> None:
        """Bind a free port for the generation's rendezvous and publish it."""
        port = net.free_port(self.config.host, self.config.rendezvous_ports)
        log.info("rendezvous port chosen", job=prep.job, generation=prep.generation, port=port)
        self._send(
            rendezvous_ready=keel_pb2.RendezvousReady(
                job=prep.job, generation=prep.generation, host=self.config.host, port=port
            )
        )

    def _do_stop_generation(self, stop: keel_pb2.StopGeneration) -> None:
        """Stop the generation's ranks here (their stacks first, if asked)."""
        ranks = self.supervisor.of_generation(stop.job, stop.generation)
        running = [r for r in ranks if r.phase is RankPhase.RUNNING]
        if stop.collect_stacks and running and not self.generation.hang_reported:
            self._report_stacks(stop.job, stop.generation, running, hang=None)
        self.supervisor.stop(ranks, time.monotonic())
        self.generation.stop(stop.job, stop.generation, f"the controller: {stop.reason}")

    def _do_resync(self, _resync: keel_pb2.Resync) -> None:
        """A new leader: replay what it may not have, then the status."""
        for replayed in self.reports.replay():
            self.link.send(replayed)
        self._send(status=self._status())

    def _do_checkpoint_recorded(self, recorded: keel_pb2.CheckpointRecorded) -> None:
        """The controller recorded a checkpoint: replays need nothing before it."""
        self.reports.recorded(recorded.generation, recorded.step)

    def _do_etcd_unreachable(self, unreachable: keel_pb2.EtcdUnreachable) -> None:
        """The leading controller cannot reach etcd either: no self-fencing for the
        hold it names, unless it renews it."""
        now = time.monotonic()
        first = self.held_until < now
        self.held_until = hold_until(now, unreachable.hold_s, self.config.lease_ttl_s)
        if first:
            log.warning(
                "the controller cannot reach etcd either: keeping the ranks while "
                "our lease cannot be renewed, for as long as it renews the hold",
                hold_s=round(self.held_until - now, 3),
            )

    def _do_read_log(self, request: keel_pb2.ReadLog) -> None:
        """Send a piece of a rank's output."""
        running = any(
            r.rank == request.rank and r.live
            for r in self.supervisor.of_generation(request.job, request.generation)
        )
        self._send(
            log_chunk=rank_logs.read(self.config.run_dir, self.config.node, request, running)
        )

    def _do_checkpoint_now(self, request: keel_pb2.CheckpointNow) -> None:
        """Ask the ranks for a checkpoint of a step after ``after_step``."""
        self.reports.want_checkpoint(request.generation, request.after_step)
        log.info(
            "checkpoint requested",
            job=request.job,
            generation=request.generation,
            after_step=request.after_step,
            reason=request.reason,
        )

    def _start(self, start: keel_pb2.StartGeneration) -> None:
        # A job submitted again under the same name (after `keel delete`) starts over at
        # generation 1 with a new id: that is no repeat.
        if self.started == (start.job, start.generation) and self.started_id == start.job_id:
            log.info(
                "generation already started here; ignoring the repeat",
                job=start.job,
                generation=start.generation,
            )
            return
        self.started, self.started_id = (start.job, start.generation), start.job_id
        # A node runs one generation at a time: anything older goes first.
        older = [
            r
            for r in self.supervisor.ranks
            if r.generation != start.generation or r.job != start.job
        ]
        if older:
            log.warning("stopping ranks of an older generation before starting", count=len(older))
            self.supervisor.stop_all(self.config.stop_grace_s + 2)
            for job, generation in {(r.job, r.generation) for r in older}:
                leftovers.kill_marked(
                    self.socket_path, job, generation, spare=self.supervisor.parking.pids()
                )
            self.supervisor.ranks.clear()
        if self.generation.phase is Phase.STOPPING:
            self._maybe_confirm_stop()  # nothing of it is left now
        self.generation.begin(start)
        self.reports.begin(start.job, start.generation)
        refused = self._foreign_lineage(start)
        if refused:
            self._refuse_start(start, refused)
            return
        self.partner = (
            (start.replica_node, start.replica_address) if start.replica_address else None
        )
        self._newest_snapshot = None
        copy = start.memory_copy if start.HasField("memory_copy") else None
        if copy is not None and self.memory.enabled and start.job_id:
            if copy.holder == self.config.node:
                self._take_copy(start)
            else:
                # Fetched beside the main loop; the ranks start once it is here (or
                # not: they then restore from storage).
                threading.Thread(
                    target=self._fetch_copy, args=(start,), name="memory-copy", daemon=True
                ).start()
                return
        self._launch(start)

    def _take_copy(self, start: keel_pb2.StartGeneration) -> None:
        """The copy of another node's snapshot this agent holds, moved into the job's
        memory, where the ranks restore it."""
        copy = start.memory_copy
        try:
            self.memory.hold(start.job_id)
            step = self.replicas.take(
                start.job_id, copy.node, copy.step, self.memory.root / start.job_id
            )
            if step is not None:
                self.memory.give_tree(start.job_id)
                log.info("memory snapshot copy taken", job=start.job, of_node=copy.node, step=step)
                return
            log.warning(
                "no copy of the memory snapshot here; the ranks restore from storage",
                job=start.job,
                of_node=copy.node,
                step=copy.step,
            )
        except OSError as exc:
            log.warning("cannot take the memory snapshot copy", job=start.job, error=str(exc))

    def _fetch_copy(self, start: keel_pb2.StartGeneration) -> None:
        """Another node's snapshot, fetched from the partner that holds its copy into
        the job's memory; then the ranks start (the main loop's ``memory_copied``)."""
        copy = start.memory_copy
        began = time.monotonic()
        try:
            self.memory.hold(start.job_id)
            step, size = peer.fetch_snapshot(
                copy.address,
                self.config.tls,
                start.job_id,
                copy.node,
                copy.step,
                self.memory.root / start.job_id,
                FETCH_TIMEOUT_S,
                copy.holder,
            )
            self.memory.give_tree(start.job_id)
            log.info(
                "memory snapshot copy fetched",
                job=start.job,
                of_node=copy.node,
                step=step,
                holder=copy.holder,
                bytes=size,
                seconds=round(time.monotonic() - began, 3),
            )
        except (peer.PeerError, OSError) as exc:
            log.warning(
                "memory snapshot copy not fetched; the ranks restore from storage",
                job=start.job,
                holder=copy.holder,
                error=str(exc),
            )
        self.events.put(("memory_copied", start))

    def _on_event_memory_copied(self, start: keel_pb2.StartGeneration) -> None:
        """The copy is here (or will not be): the ranks start, if their generation is
        still the one to run."""
        current = self.started == (start.job, start.generation) and self.started_id == start.job_id
        if not current or self.generation.phase is not Phase.RUNNING:
            log.info(
                "generation ended while its memory snapshot was fetched; not starting it",
                job=start.job,
                generation=start.generation,
            )
            return
        self._launch(start)

    def _launch(self, start: keel_pb2.StartGeneration) -> None:
        """Start the generation's ranks here."""
        try:
            chain = self._deadlines(start)
            self.hang_config = HangConfig(
                floor_s=chain.hang_floor_s,
                k=start.health.hang_k,
                first_step_timeout_s=chain.first_step_timeout_s,
                checkpoint_timeout_s=chain.checkpoint_timeout_s,
            )
            self.supervisor.start(start, self.socket_path, chain)
        except (ValueError, OSError) as exc:
            # A health budget that makes no sense, or a command that cannot be executed
            # at all: report it as the ranks' failure, with the reason.
            log.error("cannot start ranks", error=str(exc), command=list(start.command))
            self._not_started(start, 127, f"cannot start {list(start.command)}: {exc}")

    @staticmethod
    def _foreign_lineage(start: keel_pb2.StartGeneration) -> str:
        """Why the generation may not start here ("" if it may): this node runs its rank
        0, which claims the checkpoint directory, and the directory holds another
        lineage's checkpoints. Refused before any rank starts, so that nothing of the
        job touches them. A directory this node cannot read is the ranks' to report."""
        if not start.checkpoint_dir or not start.job_id or all(a.rank for a in start.ranks):
            return ""
        try:
            return lineage.refusal(start.checkpoint_dir, start.job_id, start.restore_from)
        except OSError:
            return ""

    def _refuse_start(self, start: keel_pb2.StartGeneration, why: str) -> None:
        """Tell the controller the generation cannot start (a foreign lineage: terminal),
        and that its ranks here failed with that reason."""
        log.error("refusing to start the generation", job=start.job, reason=why)
        self._send(
            checkpoint_problem=keel_pb2.CheckpointProblem(
                job=start.job,
                generation=start.generation,
                path=start.checkpoint_dir,
                kind=keel_pb2.CHECKPOINT_PROBLEM_KIND_FOREIGN_LINEAGE,
                reason=why,
            )
        )
        self._not_started(start, 1, f"not started: {why}")

    def _not_started(self, start: keel_pb2.StartGeneration, exit_code: int, why: str) -> None:
        """Report each of the generation's ranks here as failed before it started."""
        for assignment in start.ranks:
            self._send(
                rank_exited=keel_pb2.RankExited(
                    job=start.job,
                    generation=start.generation,
                    rank=assignment.rank,
                    exit_code=exit_code,
                    traceback=why,
                    exited_at=time.time(),
                )
            )

    def _deadlines(self, start: keel_pb2.StartGeneration) -> deadlines.Deadlines:
        """The generation's deadline chain as the controller resolved it, resolved and
        checked here too (what a controller of before a deadline was added leaves out,
        the stop deadline, is derived as it is there); raises DeadlineError."""
        if not start.HasField("deadlines"):
            raise deadlines.DeadlineError(["the start of the generation carries no deadlines"])
        return deadlines.resolve(
            **json_format.MessageToDict(start.deadlines, preserving_proto_field_name=True)
        )

    # =================================================================== fencing
    def _check_fence(self, now: float) -> None:
        """Stop the ranks if ``policy.fencing.self_fence`` says the node is fenced."""
        state = self.generation
        why = self_fence(
            running=state.phase is Phase.RUNNING,
            unrenewed_s=now - self.lease_ok_at,
            lease_ttl_s=self.config.lease_ttl_s,
            controller_up=self.link.up,
            hold_left_s=self.held_until - now,
        )
        if not why:
            return
        current = state.start
        ranks = [
            r
            for r in self.supervisor.of_generation(current.job, current.generation)
            if r.phase is RankPhase.RUNNING
        ]
        log.error(
            "stopping the ranks",
            job=current.job,
            generation=current.generation,
            ranks=[r.rank for r in ranks],
            reason=why,
        )
        self.supervisor.stop(ranks, now)
        state.stop(current.job, current.generation, why)

    # ===================================================================== hangs
    def _check_hang(self, now: float) -> None:
        state = self.generation
        if state.phase is not Phase.RUNNING or state.hang_reported:
            return
        current = state.start
        ranks = [
            r
            for r in self.supervisor.of_generation(current.job, current.generation)
            if r.phase is RankPhase.RUNNING
        ]
        if not ranks:
            return
        latest, recent = self.reports.progress()
        hang = hangs.check(now, ranks, latest, recent, self.hang_config)
        if hang is None:
            return
        log.warning(
            "hang detected",
            job=current.job,
            generation=current.generation,
            rank=hang.rank,
            reason=hang.reason,
        )
        self._report_stacks(current.job, current.generation, ranks, hang)
        # The hung rank is stopped; its peers, whose collectives then fail, may park.
        self.supervisor.stop([r for r in ranks if r.rank == hang.rank], now, leave=False)
        self.supervisor.stop(ranks, now)
        state.stop(current.job, current.generation, hang.reason)

    def _report_stacks(self, job: str, generation: int, ranks: list, hang) -> None:
        report = hangs.collect_stacks(job, generation, ranks, hang)
        self.generation.hang_reported = True
        metrics.HANGS.labels(self.config.node).inc()
        self._flush_steps()
        self._send(hang_detected=report)

    def _maybe_confirm_stop(self) -> None:
        if self.generation.phase is not Phase.STOPPING:
            return
        job, generation = self.generation.stopping
        if not self.supervisor.generation_done(job, generation):
            return
        # A parked process started for this generation still carries its marks.
        escaped = leftovers.kill_marked(
            self.socket_path, job, generation, spare=self.supervisor.parking.pids()
        )
        if escaped:
            log.warning(
                "killed processes the ranks had moved out of their process groups",
                job=job,
                generation=generation,
                count=escaped,
            )
        self.supervisor.forget(job, generation)
        if self.generation.running(job, generation):
            self.reports.end()
        self.generation.stopped()
        log.info("generation stopped", job=job, generation=generation)
        self._send(generation_stopped=keel_pb2.GenerationStopped(job=job, generation=generation))


def run(config: AgentConfig) -> None:
    """Run the agent until it is stopped; raises RankUserRefused if its rank user
    could reach what is the agent's alone (``agent.rank_user``)."""
    # Other uids (its ranks') may neither read /proc/AGENT/environ nor ptrace it.
    rank_user.make_undumpable()
    if config.rank_user is not None:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        rank_user.check(config.rank_user, config.run_dir, config.secret_files)
        log.info(
            "ranks run as their own user",
            rank_user=config.rank_user.name,
            uid=config.rank_user.uid,
            gid=config.rank_user.gid,
        )
    agent = Agent(config)
    signal.signal(signal.SIGTERM, agent.request_leave)
    signal.signal(signal.SIGINT, agent.request_stop)
    agent.run()


def detect_accelerator() -> str:
    """The first GPU ``nvidia-smi`` names (e.g. "NVIDIA H100 80GB HBM3"), else "cpu"."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:
        names = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    first = names.stdout.strip().splitlines()
    return first[0].strip() if first else "cpu"
