"""Shared fixtures and helpers: a real etcd on free ports, a guard against leaked
processes, the agent's real AgentLocal service with a recorder, and torchrun launches."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf import json_format

from agent.local_server import AgentLocalService, LocalCallbacks, RankIdentity, serve
from common import env
from common.procs import poll
from orchestrator.local.etcd_server import EmbeddedEtcd, etcd_binary, memory_backed_dir
from protos import keel_pb2

REPO = Path(__file__).resolve().parent.parent
INTEGRATION = REPO / "tests" / "integration"

# The agents the tests start (through keel up and keel run too) fill their warm
# processes lazily (agent.pool): on two cores, an eager refill beside every generation
# that starts would cost the suite minutes. The tests of the eager fill ask for it.
os.environ.setdefault(env.WARM_FILL, "lazy")

# The reference trainer with a learning rate that changes every step, so that a resume
# at the wrong position shows in the losses; deeper than its default, so that pipeline
# layouts have blocks to split.
SCHEDULED_MODEL = (
    *("--layers", "4", "--seq-len", "32"),
    *("--warmup-steps", "4", "--lr-schedule", "cosine"),
)


def pytest_collection_modifyitems(items):
    """Every test under tests/integration starts real processes: it is marked, so that
    ``pytest -m "not integration"`` runs only the pure tests, in seconds."""
    for item in items:
        if INTEGRATION in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_processes(request, monkeypatch):
    """A test not marked integration that starts a process fails, saying where it
    belongs."""
    if request.node.get_closest_marker("integration") is None:

        def refuse(*args, **kwargs):
            raise AssertionError("a unit test starts no process; move it to tests/integration")

        monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.fixture
def etcd():
    # Its data in memory where there is room: the tests' agents hold 2 s leases, and on
    # a shared disk under the suite's load etcd's fsync stalled past them (two agents'
    # leases lost at once, their job failed). What is tested is Keel, not the disk.
    with EmbeddedEtcd(data_parent=memory_backed_dir()) as server:
        yield server


def etcdctl(endpoint: str, *flags: str) -> list[str]:
    """The etcdctl command line for ``endpoint`` (with its scheme if not plain http),
    plus ``flags`` (TLS files), up to its subcommand."""
    return [str(etcd_binary().with_name("etcdctl")), "--endpoints", endpoint, *flags]


def enable_etcd_auth(ctl: list[str]) -> None:
    """Turns on authentication in the etcd that ``ctl`` (see ``etcdctl``) reaches: user
    ``root`` (password ``root-pw``) with the root role, and user ``keel`` (password
    ``keel-pw``) whose role may read and write only keys under /keel/."""
    for command in (
        ["user", "add", "root:root-pw"],
        ["user", "grant-role", "root", "root"],
        ["role", "add", "keel"],
        ["role", "grant-permission", "keel", "--prefix=true", "readwrite", "/keel/"],
        ["user", "add", "keel:keel-pw"],
        ["user", "grant-role", "keel", "keel"],
        ["auth", "enable"],
    ):
        subprocess.run([*ctl, *command], check=True, capture_output=True)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until truthy; return its value or fail after ``timeout_s``."""
    value = poll(predicate, timeout_s, interval_s)
    if not value:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
    return value


def processes_mentioning(text: str) -> list[int]:
    """PIDs (other than ours) whose command line or environment contains ``text``."""
    found = []
    needle = text.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (
                needle in (entry / "cmdline").read_bytes()
                or needle in (entry / "environ").read_bytes()
            ):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return found


@pytest.fixture
def no_leaks(tmp_path):
    """Fails the test if any process that mentions ``tmp_path`` outlives it."""
    yield tmp_path
    leaked = processes_mentioning(str(tmp_path))
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not leaked, f"processes outlived the test: {leaked}"


def keel(*args: str, timeout_s: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run the keel CLI as a user would, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def torchrun(
    nproc: int, *command: str, env: dict | None = None, timeout_s: float = 240
) -> subprocess.CompletedProcess:
    """Runs ``command`` (``"-m", "trainer.train", ...`` or a script and its arguments)
    under torchrun with ``nproc`` ranks on this host, from the repository root, without
    the caller's ``KEEL_*`` variables, plus ``env``.

    torchrun starts each rank in a session of its own, so a timeout, which kills only
    torchrun, would leave the ranks behind: every process still carrying this launch's
    marker variable is SIGKILLed on the way out, however the launch ended."""
    marker = uuid.uuid4().hex
    full_env = {key: value for key, value in os.environ.items() if not key.startswith("KEEL_")}
    full_env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env or {}))
    full_env["KEEL_TEST_LAUNCH"] = marker
    try:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                *command,
            ],
            cwd=REPO,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    finally:
        for pid in processes_mentioning(f"KEEL_TEST_LAUNCH={marker}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def step_events(stderr: str) -> dict[int, dict]:
    """step → rank 0's ``step`` log event (fields ``step``, ``loss``, ``tokens_per_s``,
    ``rank`` ...) among the JSON lines of a trainer's ``stderr``. Lines that are not
    JSON (torch's, torchrun's, a traceback) are passed over, but one that starts as JSON
    must parse, and no step may be logged twice."""
    events = {}
    for line in stderr.splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AssertionError(f"a log line that is not JSON ({exc}): {line!r}") from None
        if event.get("event") == "step":
            assert event["step"] not in events, f"step {event['step']} logged twice: {line}"
            assert event["rank"] == 0 and event["tokens_per_s"] >= 0, line
            events[event["step"]] = event
    return events


def crash_in_2d(flags: list[str], ckpt: Path, **env: str) -> tuple[dict[int, float], object]:
    """``flags`` (the reference trainer's) on one rank, as the reference, then on four in
    ``dp_shard=2,tp=2`` checkpointing into ``ckpt`` (and ``env``), rank 3 crashing as step
    9 begins: the reference's losses by step, and the crashed launch."""
    faults = json_format.MessageToJson(
        keel_pb2.FaultSchedule(
            faults=[keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_CRASH, rank=3, step=9)]
        )
    )
    reference = step_losses(torchrun(1, *flags))
    crashed = torchrun(
        4,
        *flags,
        env={
            "KEEL_MESH": "dp_shard=2,tp=2",
            "KEEL_CHECKPOINT_DIR": str(ckpt),
            "KEEL_FAULTS": faults,
            **env,
        },
    )
    assert crashed.returncode != 0
    assert "injected crash at step 9 on rank 3" in crashed.stderr
    return reference, crashed


def step_losses(
    run: subprocess.CompletedProcess, check: bool = True, only_steps: bool = False
) -> dict[int, float]:
    """step → loss from rank 0's ``step`` events on stderr (``step_events``). ``check``:
    the launch must have succeeded; ``only_steps``: stdout must be empty (the trainer
    says everything in log lines)."""
    if check:
        assert run.returncode == 0, (
            f"trainer failed ({run.returncode}):\n{run.stdout}\n{run.stderr[-4000:]}"
        )
    assert not (only_steps and run.stdout), f"unexpected stdout {run.stdout[:2000]!r}"
    return {step: float(event["loss"]) for step, event in step_events(run.stderr).items()}


def committed_steps(ckpt: Path) -> list[int]:
    """The steps of the checkpoints committed in ``ckpt`` (its ``step_N`` directories)."""
    return sorted(
        int(path.name.removeprefix("step_"))
        for path in ckpt.iterdir()
        if path.name.startswith("step_")
    )


class AgentRecorder:
    """Keeps what the agent's real local service (``local_agent``) was told, in arrival
    order: ``events`` holds ("step", StepReport), ("checkpoint", CheckpointSaved),
    ("problem", CheckpointProblem) and ("preflight", PreflightReport); ``calls`` holds
    each ReportSteps call as (generation, reports).

    It asks for a checkpoint in an ack when ``ask(call_number, reports)`` says so
    (``call_number`` counts ReportSteps calls with reports from 1; a rank's pings,
    calls without reports, are answered and not counted), and, with
    ``ask_from_step``, once, in the ack of the first call that reports step
    ``ask_from_step`` or later."""

    def __init__(
        self, ask_from_step: int | None = None, ask: Callable[[int, list], bool] | None = None
    ) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, object]] = []
        self.calls: list[tuple[int, list[keel_pb2.StepReport]]] = []
        self.asked = False
        self._ask_from_step = ask_from_step
        self._ask = ask
        self.identities: dict[str, RankIdentity] = {}
        # Restart in place: tokens asked to leave, why a park is refused (None: kept),
        # and the NextGeneration answer by token.
        self.leaving_tokens: set[str] = set()
        self.refuse_park: str | None = None
        self.answers: dict[str, keel_pb2.NextGenerationAnswer] = {}

    def token_for(self, generation: int, world_size: int, checkpoint_dir="", job="") -> str:
        """A rank token (KEEL_RANK_TOKEN) for every rank of one torchrun launch (its
        ranks share one environment), in ``generation``."""
        token = secrets.token_urlsafe(16)
        self.identities[token] = RankIdentity(
            job=job,
            generation=generation,
            ranks=frozenset(range(world_size)),
            checkpoint_dir=str(checkpoint_dir),
        )
        return token

    def on_steps(self, generation: int, reports: list) -> int | None:
        """The agent's answer: a checkpoint of a step after the newest reported, or
        None."""
        if not reports:
            return None  # a rank's ping: the agent answers, nothing to record
        with self.lock:
            self.calls.append((generation, list(reports)))
            self.events.extend(("step", report) for report in reports)
            newest = max(report.step for report in reports)
            if self._ask is not None and self._ask(len(self.calls), reports):
                return newest
            if self._ask_from_step is not None and not self.asked and newest >= self._ask_from_step:
                self.asked = True
                return newest
            return None

    def on_checkpoint(self, saved: keel_pb2.CheckpointSaved) -> None:
        with self.lock:
            self.events.append(("checkpoint", saved))

    def on_memory_snapshot(self, saved: keel_pb2.MemorySnapshotSaved) -> None:
        with self.lock:
            self.events.append(("memory_snapshot", saved))

    def on_problem(self, problem: keel_pb2.CheckpointProblem) -> None:
        with self.lock:
            self.events.append(("problem", problem))

    def on_preflight(self, report: keel_pb2.PreflightReport) -> None:
        with self.lock:
            self.events.append(("preflight", report))

    def on_attach(self, who: RankIdentity, rank: int, restart_in_place: bool = False) -> None:
        with self.lock:
            self.events.append(("attach", (who.generation, rank)))
            if restart_in_place:
                self.events.append(("restart_in_place", (who.generation, rank)))

    def on_park(self, token: str, request: keel_pb2.RankPark) -> str | None:
        with self.lock:
            self.events.append(("park", request))
        return self.refuse_park

    def of(self, kind: str) -> list:
        """The payloads of ``kind`` ("step", "checkpoint", "memory_snapshot", "problem",
        "preflight" or "attach": the (generation, rank) of each) so far."""
        with self.lock:
            return [payload for what, payload in self.events if what == kind]

    def steps(self) -> list[tuple[int, keel_pb2.StepReport]]:
        """(generation, report) for every step report so far."""
        with self.lock:
            return [
                (generation, report) for generation, reports in self.calls for report in reports
            ]


@pytest.fixture
def agent(request):
    """An ``AgentRecorder`` behind the agent's real AgentLocal service; yields (socket
    path, recorder). Parametrize it indirectly with the recorder's keyword arguments
    to have it ask for checkpoints, e.g. ``@pytest.mark.parametrize("agent",
    [{"ask_from_step": 3}], indirect=True)``."""
    recorder = AgentRecorder(**getattr(request, "param", {}))
    with local_agent(recorder) as socket_path:
        yield socket_path, recorder


@contextlib.contextmanager
def local_agent(recorder):
    """The agent's real AgentLocal service on a Unix socket, calling ``recorder``'s
    ``on_steps``, ``on_checkpoint`` and (if it has them) ``on_problem`` and
    ``on_preflight``; yields the socket path for KEEL_AGENT_SOCKET."""
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    directory = tempfile.mkdtemp(prefix="keel-agent-")
    socket_path = os.path.join(directory, "agent.sock")
    server = serve(
        socket_path,
        AgentLocalService(
            LocalCallbacks(
                identify=recorder.identities.get,
                on_steps=recorder.on_steps,
                on_checkpoint=recorder.on_checkpoint,
                on_memory_snapshot=getattr(recorder, "on_memory_snapshot", lambda _saved: None),
                on_problem=getattr(recorder, "on_problem", lambda _problem: None),
                on_preflight=getattr(recorder, "on_preflight", lambda _report: None),
                on_attach=recorder.on_attach,
                leaving=recorder.leaving_tokens.__contains__,
                on_park=recorder.on_park,
                next_generation=recorder.answers.get,
                parked=recorder.answers.__contains__,
            )
        ),
    )
    try:
        yield socket_path
    finally:
        server.stop(grace=None)
        shutil.rmtree(directory, ignore_errors=True)


def _from_debian_prometheus(name: str) -> str:
    """The path of ``name`` (promtool, prometheus), from Debian's prometheus package:
    installed first if it is missing and we are root with apt-get; the test is skipped,
    saying how to get it, if it still cannot be had."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin"])
    found = shutil.which(name, path=search)
    why = ""
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
        try:
            result = subprocess.run(
                install, env=apt_env, capture_output=True, text=True, timeout=600
            )
            if result.returncode != 0:  # a fresh machine may have no package lists yet
                subprocess.run(["apt-get", "update"], env=apt_env, capture_output=True, timeout=600)
                result = subprocess.run(
                    install, env=apt_env, capture_output=True, text=True, timeout=600
                )
            why = f" (apt-get install prometheus: {result.stderr.strip()[-300:] or 'done'})"
        except subprocess.TimeoutExpired:
            why = " (apt-get install prometheus took over 600 s)"
        found = shutil.which(name, path=search)
    if found is None:
        pytest.skip(
            f"{name} not found{why}: install Debian's prometheus package "
            f"(apt-get install prometheus), which provides {name}"
        )
    return found


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of promtool (Debian's prometheus package)."""
    return _from_debian_prometheus("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """Path of the prometheus server binary (Debian's prometheus package)."""
    return _from_debian_prometheus("prometheus")
