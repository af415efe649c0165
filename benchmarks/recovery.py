"""Keel's time to recover from a killed rank, phase by phase, against baselines measured
in the same run.

A. A plain torchrun script (``benchmarks/recovery_script.py``), world size 2 on one
node: epochs of fixed work, its own snapshot after each, and rank 1 SIGKILLs itself
once at the start of epoch ``FAIL_EPOCH``, about 20 s into the job, once the agents
have filled their warm pools (``EARLY_FAIL_EPOCH`` where no pool is at stake; see
there). Arms, interleaved round by round:

* ``keel``: ``keel run --nproc-per-node 2 --max-restarts 1`` on a local cluster, whose
  agents keep warm processes (Python started, torch imported) by default, filled at
  their start and right after each is taken (``--warm-fill eager``);
* ``keel, early kill, eager fill`` and ``keel, early kill, lazy fill``: the same, the
  kill at ``EARLY_FAIL_EPOCH``, seconds after the job started, with the agents' pools
  filled eagerly or lazily (``KEEL_WARM_FILL``; lazy: only once ranks have run for 10 s,
  so a failure this early restarts cold);
* ``keel run --cold-start``: the same without warm processes;
* ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node 2
  --max-restarts 1``; a run that has not ended ``RECOVERY_TIMEOUT_S`` after the kill
  did not recover, nor did one that failed its restart;
* ``cold start``: no orchestrator. The script first runs to its failure, launched
  directly (two ranks with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``),
  then, from the snapshot the failure left, the two ranks are started again
  (``TORCHELASTIC_RESTART_COUNT=1``), and that launch is what is timed.

Recovery is the kill (the time rank 1 wrote just before ``SIGKILL``) to the end of the
first epoch of restart 1 on rank 0; for the cold start, the launch to that epoch's end.
The script's own timestamps split it: ``start`` (to the script's first line: the spawn
and the interpreter), ``imports`` (``import torch``), ``rendezvous``
(``init_process_group``), ``setup`` (the model and its optimizer made), ``restore`` (the
snapshot loaded) and ``first step`` (the first epoch). Keel's part before ``start``
comes from the controller's ``job state`` log lines: ``detect`` (kill to
RUNNING→STOPPING), ``stop`` (to STOPPING→PENDING: every rank gone), ``plan`` (to
PENDING→STARTING) and ``port`` (to STARTING→RUNNING: rank 0's agent chose the
rendezvous port and the controller sent the start); torchrun's (detection, stopping
the survivor, its own rendezvous and the spawn) is one figure, kill to the restarted
script's first line.

B. The reference trainer at world size 4 (``keel up --nodes 2 --slots-per-node 2
--steps 400 --checkpoint-every 5 --no-preflight``): once every agent has said its warm
processes are ready (the state a failure hours into a job finds), rank 1 is SIGKILLed
by this script at a step ``KILL_AFTER_SAVE_STEPS`` past a checkpoint's start; recovery
is the kill to the next generation's first completed step (rank 0's ``step`` event),
split by the controller's state changes, the agent's ``rank started``, the trainer's
``resumed from`` line and its restore time (``restore_s`` of the step report, read
from the controller's ``keel_recovery_phase_seconds`` once recovered). Under Keel the
survivors restart in place and rank 1's slot takes a warm process; each run's note
says how every rank of the next generation started. Baseline: the checkpoint that
generation restored, copied, and the same 4 ranks (``keel up``'s exact trainer command
and job environment) started directly, with no orchestrator: launch to the first
completed step.

Prints a table per scenario (the median of each phase per arm, each run's total), and
last the figures as ratios of medians::

    python -m benchmarks.recovery [--runs 2] [--keep] [--scenario both|plain|trainer]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from common import env as keel_env
from common.net import free_port
from common.procs import terminate
from orchestrator.local.options import UpOptions, job_spec

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "recovery_script.py"
# Epochs of about 0.2 s here. Where a warm pool is at stake (keel, and torchrun, which
# it is compared with), the kill comes about 20 s into the job, when the agents' pools
# are full and idle (a lazy fill would have filled them too, 10 s after ranks start):
# the state a failure hours into a job finds.
FAIL_EPOCH = 85
# Arms that keep nothing ready for a failure fail early, to keep the benchmark short:
# the cold start's failing run, and keel --cold-start (its agents never fill a pool
# for a job that opted out). Nothing of the restart they time depends on how long the
# run before it lasted.
EARLY_FAIL_EPOCH = 4
ITERS = 12
# Long enough that the kill, which waits for the warm processes, comes well before the end.
TRAINER = UpOptions(nodes=2, slots_per_node=2, steps=400, checkpoint_every=5, preflight=False)
# Rank 1 is killed at a step this far past a checkpoint's start, once every warm
# process is ready: its save has had as long to commit as at step 12 of 5-step saves.
KILL_AFTER_SAVE_STEPS = 2
MARKER = "KEEL_BENCH_LAUNCH"  # in the environment of everything an arm starts
RUN_TIMEOUT_S = 60.0  # the direct launches
RECOVERY_TIMEOUT_S = 15.0  # torchrun, from the kill to its end
KEEL_TIMEOUT_S = 180.0  # a keel run / keel up, cluster start and stop included
GRACE_S = 5.0


class Failed(Exception):
    """A run that did not do what it claims; the message says what happened."""


# --- processes ------------------------------------------------------------------------


def marked(pattern: str) -> list[int]:
    """Live processes whose environment holds ``pattern`` (the arm's marker)."""
    needle, found = pattern.encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (
                needle in (entry / "environ").read_bytes()
                and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            ):
                found.append(int(entry.name))
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return found


class Launch:
    """The processes of one arm's run, each in a session of its own, all carrying a
    marker in their environment, so that what they start (torchrun's ranks, which get
    sessions of their own) is found and killed too."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.marker = f"{MARKER}={uuid.uuid4().hex}"
        self.procs: list[subprocess.Popen] = []
        self.leftovers = 0

    def env(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
        name, value = self.marker.split("=")
        return base | {"PYTHONPATH": str(REPO), name: value} | extra

    def start(self, argv: list[str], log: str, env: dict[str, str]) -> subprocess.Popen:
        with (
            open(self.directory / f"{log}.out", "ab") as out,
            open(self.directory / f"{log}.err", "ab") as err,
        ):
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=REPO,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def wait(self, timeout_s: float) -> bool:
        """Whether every process exited within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def close(self) -> None:
        """Stop every process (SIGTERM, a grace, SIGKILL to the groups) and SIGKILL
        whatever else carries the marker; ``leftovers`` counts those that outlived their
        launcher's own exit."""
        running = any(p.poll() is None for p in self.procs)
        terminate(self.procs, GRACE_S)
        left = marked(self.marker)
        if not running:
            self.leftovers += len(left)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs.clear()


# --- records --------------------------------------------------------------------------


def json_lines(path: Path) -> list[dict]:
    """The JSON objects of a log, one a line; other lines (tracebacks, warnings) skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def unix(record: dict) -> float:
    """A log record's ``timestamp`` (ISO 8601, UTC) in unix seconds."""
    return datetime.fromisoformat(record["timestamp"]).timestamp()


def transitions(controller_log: Path) -> list[tuple[str, str, float, str]]:
    """The controller's job-state changes: (from, to, unix time, reason), in order."""
    return [
        (r["from"], r["to"], unix(r), r.get("reason", ""))
        for r in json_lines(controller_log)
        if r.get("event") == "job state"
    ]


def after(
    changes: list[tuple[str, str, float, str]], source: str, target: str, since: float
) -> tuple[float, str]:
    """The first change from ``source`` to ``target`` at or after ``since``: its time
    and reason."""
    for old, new, at, reason in changes:
        if old == source and new == target and at >= since:
            return at, reason
    raise Failed(
        f"the controller logged no {source}→{target} after the kill "
        f"(changes: {', '.join(f'{c[0]}→{c[1]}' for c in changes) or 'none'})"
    )


def controller_phases(changes, kill: float) -> tuple[dict[str, float], float]:
    """detect, stop, plan and port from the state changes after ``kill``; and the time
    of STARTING→RUNNING, where they end."""
    stopping, why = after(changes, "RUNNING", "STOPPING", kill)
    if "rank 1 " not in why or "signal 9" not in why:
        raise Failed(f"the generation stopped for another reason: {why}")
    pending, _ = after(changes, "STOPPING", "PENDING", stopping)
    starting, _ = after(changes, "PENDING", "STARTING", pending)
    running, _ = after(changes, "STARTING", "RUNNING", starting)
    return {
        "detect": stopping - kill,
        "stop": pending - stopping,
        "plan": starting - pending,
        "port": running - starting,
    }, running


def script_times(out: Path, rank: int, restart: int) -> dict:
    """The script's timestamps of ``restart`` on ``rank``: start, imported, pg, built,
    restored, the first epoch's end (``epoch``) and the epoch restored at (``from_epoch``)."""
    times: dict = {}
    for record in json_lines(out / f"times-rank{rank}.jsonl"):
        if record["restart"] != restart:
            continue
        if record["event"] == "epoch":
            times.setdefault("epoch", record["t"])
        else:
            times[record["event"]] = record["t"]
            if record["event"] == "restored":
                times["from_epoch"] = record["from_epoch"]
    missing = [
        k for k in ("start", "imported", "pg", "built", "restored", "epoch") if k not in times
    ]
    if missing:
        raise Failed(f"rank {rank} logged no {', '.join(missing)} in restart {restart}")
    return times


def script_phases(times: dict, launched: float) -> dict[str, float]:
    """From ``launched`` (whatever started the script's process) to its first epoch."""
    return {
        "start": times["start"] - launched,
        "imports": times["imported"] - times["start"],
        "rendezvous": times["pg"] - times["imported"],
        "setup": times["built"] - times["pg"],
        "restore": times["restored"] - times["built"],
        "first step": times["epoch"] - times["restored"],
    }


def kill_time(out: Path, fail_epoch: int) -> float:
    """When rank 1 killed itself, checking that the snapshot it left is the epoch before."""
    if not (out / "kill.json").exists():
        raise Failed("rank 1 never killed itself")
    kill = json.loads((out / "kill.json").read_text())["t"]
    restored = script_times(out, 0, 1)
    if restored["from_epoch"] != fail_epoch:
        raise Failed(f"restart 1 resumed at epoch {restored['from_epoch']}, not {fail_epoch}")
    return kill


# --- scenario A: the plain script -----------------------------------------------------


@dataclass
class Run:
    arm: str
    total: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    problem: str = ""
    note: str = ""


def script_args(fail_epoch: int) -> list[str]:
    """The script's arguments: rank 1 killed at ``fail_epoch``, one epoch after it."""
    return ["--epochs", str(fail_epoch + 1), "--fail-epoch", str(fail_epoch), "--iters", str(ITERS)]


def run_keel(directory: Path, cold: bool, early: bool = False, fill: str = "eager") -> Run:
    """``keel run`` of the script on a local cluster: kill to restart 1's first epoch.
    ``early``: the kill comes at ``EARLY_FAIL_EPOCH``, seconds after the job started;
    ``fill``: the agents' ``--warm-fill``."""
    arm = "keel --cold-start" if cold else "keel"
    if early and not cold:
        arm = f"keel, early kill, {fill} fill"
    fail_epoch = EARLY_FAIL_EPOCH if cold or early else FAIL_EPOCH
    work, out = directory / "keel", directory / "out"
    out.mkdir(parents=True)
    launch = Launch(directory)
    try:
        launch.start(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "run",
                "--workdir",
                str(work),
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "1",
                "--quiet",
                *(["--cold-start"] if cold else []),
                str(SCRIPT),
                str(out),
                *script_args(fail_epoch),
            ],
            "keel-run",
            launch.env(**{keel_env.WARM_FILL: fill}),
        )
        if not launch.wait(KEEL_TIMEOUT_S):
            raise Failed(f"keel run did not end within {KEEL_TIMEOUT_S:.0f} s")
        code = launch.procs[0].returncode
        if code != 0:
            tail = (directory / "keel-run.err").read_text(errors="replace")[-600:]
            raise Failed(f"keel run exited {code}: {tail.strip()}")
        kill = kill_time(out, fail_epoch)
        phases, running = controller_phases(transitions(work / "logs" / "controller.log"), kill)
        times = script_times(out, 0, 1)
        phases |= script_phases(times, running)
        starts = [
            r
            for r in json_lines(work / "logs" / "agent-node-0.log")
            if r.get("event") == "rank started"
        ]
        warm = sorted({str(r.get("warm")).lower() for r in starts if r.get("generation") == 2})
        return Run(
            arm,
            times["epoch"] - kill,
            phases,
            note=f"the kill {kill - unix(starts[0]):.1f} s after generation 1 started; "
            f"generation 2 warm={'/'.join(warm)}, its rank 0's start "
            f"{phases['start']:.2f} s",
        )
    except Failed as exc:
        return Run(arm, problem=str(exc))
    finally:
        launch.close()
        if launch.leftovers:
            print(f"  {arm}: {launch.leftovers} process(es) outlived keel run", flush=True)


def last_error(path: Path) -> str:
    """The last line of a log that names a RuntimeError (else any error), shortened."""
    lines = path.read_text(errors="replace").splitlines()
    named = [line for line in lines if "RuntimeError" in line] or [
        line for line in lines if "Error" in line
    ]
    return named[-1].strip()[:240] if named else ""


def run_torchrun(directory: Path) -> Run:
    """torchrun --max-restarts 1 of the script: kill to restart 1's first epoch."""
    arm = "torchrun"
    out = directory / "out"
    out.mkdir(parents=True)
    launch = Launch(directory)
    try:
        proc = launch.start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "1",
                str(SCRIPT),
                str(out),
                *script_args(FAIL_EPOCH),
            ],
            "torchrun",
            launch.env(OMP_NUM_THREADS="1"),
        )
        wait_for(
            lambda: (out / "kill.json").exists(), [proc], KEEL_TIMEOUT_S, "torchrun's first run"
        )
        if not launch.wait(RECOVERY_TIMEOUT_S):
            raise Failed(f"torchrun did not recover within {RECOVERY_TIMEOUT_S:.0f} s of the kill")
        if proc.returncode != 0:
            raise Failed(
                f"torchrun exited {proc.returncode}: {last_error(directory / 'torchrun.err')}"
            )
        kill = kill_time(out, FAIL_EPOCH)
        times = script_times(out, 0, 1)
        return Run(arm, times["epoch"] - kill, script_phases(times, kill))
    except Failed as exc:
        return Run(arm, problem=str(exc))
    finally:
        launch.close()


def start_ranks(
    launch: Launch, argv: list[str], world: int, per_node: int, restart: int, log: str, **env: str
) -> None:
    """``world`` ranks of ``argv`` started directly, as torchrun would start them."""
    port = str(free_port("127.0.0.1"))
    for rank in range(world):
        launch.start(
            argv,
            f"{log}-rank{rank}",
            launch.env(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank % per_node),
                LOCAL_WORLD_SIZE=str(per_node),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
                TORCHELASTIC_RESTART_COUNT=str(restart),
                **env,
            ),
        )


def wait_for(done, procs: list[subprocess.Popen], timeout_s: float, what: str):
    """Polls ``done()`` until it returns something; raises Failed when a process exits
    non-zero first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = done()
        if found:
            return found
        if any(p.poll() not in (None, 0) for p in procs):
            raise Failed(f"{what}: a rank exited {[p.poll() for p in procs]}")
        time.sleep(0.05)
    raise Failed(f"{what}: not within {timeout_s:.0f} s")


def run_cold(directory: Path) -> Run:
    """The script to its failure, launched directly; then, from the snapshot the failure
    left, both ranks launched again: launch to the first epoch's end (then stopped)."""
    out = directory / "out"
    out.mkdir(parents=True)
    argv = [sys.executable, "-u", str(SCRIPT), str(out), *script_args(EARLY_FAIL_EPOCH)]
    launch = Launch(directory)
    try:
        start_ranks(launch, argv, 2, 2, 0, "failing")
        if not launch.wait(RUN_TIMEOUT_S):
            raise Failed(f"the failing launch did not end within {RUN_TIMEOUT_S:.0f} s")
        launch.close()
        if not (out / "kill.json").exists():
            raise Failed("rank 1 never killed itself in the failing launch")
        launched = time.time()
        start_ranks(launch, argv, 2, 2, 1, "restart")

        def first_epoch():
            try:
                return script_times(out, 0, 1)
            except Failed:
                return None

        times = wait_for(first_epoch, launch.procs, RUN_TIMEOUT_S, "the restart")
        kill_time(out, EARLY_FAIL_EPOCH)
        return Run("cold start", times["epoch"] - launched, script_phases(times, launched))
    except Failed as exc:
        return Run("cold start", problem=str(exc))
    finally:
        launch.close()


# --- scenario B: the reference trainer ------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float | None:
    """A sample's value in Prometheus text, matched by name and a subset of labels."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def trainer_records(path: Path) -> list[dict]:
    return [r for r in json_lines(path) if r.get("component") == "trainer"]


def first_step(path: Path) -> dict | None:
    return next((r for r in trainer_records(path) if r.get("event") == "step"), None)


def resumed(path: Path) -> dict | None:
    return next(
        (r for r in trainer_records(path) if str(r.get("event", "")).startswith("resumed from ")),
        None,
    )


def recovery_metrics(address_file: Path) -> dict[str, float]:
    """The controller's own figures of the job's recovery (``keel_recovery_seconds``
    and its phases), once it has observed one; else {}."""
    try:
        url = f"http://{address_file.read_text().strip()}/metrics"
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return {}
    if (metric(text, "keel_recovery_seconds_count", job_name="keel-up") or 0) < 1:
        return {}
    found = {"total": metric(text, "keel_recovery_seconds_sum", job_name="keel-up")}
    for phase in ("detect", "stop", "start", "restore", "first_step"):
        found[phase] = metric(
            text, "keel_recovery_phase_seconds_sum", job_name="keel-up", phase=phase
        )
    return found


def warm_ready(work: Path) -> int:
    """How many warm processes the agents of a keel up have said are ready."""
    return sum(
        1
        for log in (work / "logs").glob("agent-*.log")
        for r in json_lines(log)
        if r.get("event") == "warm process ready"
    )


def rank_pid(agent_log: Path, generation: int, rank: int) -> int | None:
    return next(
        (
            r["pid"]
            for r in json_lines(agent_log)
            if r.get("event") == "rank started"
            and r.get("generation") == generation
            and r.get("rank") == rank
        ),
        None,
    )


def run_keel_up(directory: Path) -> tuple[Run, Path | None]:
    """``keel up`` of the reference trainer, rank 1 SIGKILLed once every warm process
    is ready: kill to generation 2's first step; and the checkpoint generation 2
    restored (for the baseline). Once generation 2 has stepped and the controller's
    recovery metrics are read, the job is stopped."""
    work = directory / "keel"
    launch = Launch(directory)
    node0 = work / "nodes" / "node-0" / "keel-up"
    slots = TRAINER.nodes * TRAINER.slots_per_node
    try:
        launch.start(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "up",
                "--nodes",
                str(TRAINER.nodes),
                "--slots-per-node",
                str(TRAINER.slots_per_node),
                "--steps",
                str(TRAINER.steps),
                "--checkpoint-every",
                str(TRAINER.checkpoint_every),
                "--no-preflight",
                "--json",
                "--workdir",
                str(work),
            ],
            "keel-up",
            launch.env(),
        )
        proc = launch.procs[0]
        wait_for(
            lambda: warm_ready(work) >= slots,
            [proc],
            KEEL_TIMEOUT_S,
            "every agent's warm processes",
        )

        def kill_step():
            """The generation running a step just after a checkpoint's start, if one is."""
            newest = max((int(d.name[3:]) for d in node0.glob("gen*")), default=0)
            steps = [
                r["step"]
                for r in trainer_records(node0 / f"gen{newest}" / "rank0.err")
                if r.get("event") == "step"
            ]
            return (
                newest
                if steps and steps[-1] % TRAINER.checkpoint_every == KILL_AFTER_SAVE_STEPS
                else None
            )

        # Generation 1 may have failed by itself (a port taken between its choice and
        # its use, on a busy machine): the kill is in whichever generation runs.
        killed = wait_for(kill_step, [proc], KEEL_TIMEOUT_S, "a step just after a checkpoint")
        victim = rank_pid(work / "logs" / "agent-node-0.log", killed, 1)
        if victim is None:
            raise Failed(f"the agent logged no start of generation {killed}'s rank 1")
        kill = time.time()
        os.kill(victim, signal.SIGKILL)
        after = killed + 1
        wait_for(
            lambda: first_step(node0 / f"gen{after}" / "rank0.err"),
            [proc],
            KEEL_TIMEOUT_S,
            f"keel up's generation {after}",
        )
        # The step reaches the controller with the agent's next batch of reports.
        address = work / "prometheus" / "controller-0.address"
        scraped, deadline = {}, time.monotonic() + 5
        while not scraped and time.monotonic() < deadline:
            scraped = recovery_metrics(address)
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(KEEL_TIMEOUT_S / 2)
        except subprocess.TimeoutExpired:
            raise Failed("keel up did not stop on SIGINT") from None
        changes = transitions(work / "logs" / "controller.log")
        phases, running = controller_phases(changes, kill)
        started = [
            r
            for log in sorted((work / "logs").glob("agent-*.log"))
            for r in json_lines(log)
            if r.get("event") == "rank started"
        ]
        err = node0 / f"gen{after}" / "rank0.err"
        back, step = resumed(err), first_step(err)
        gen2 = [r for r in started if r.get("generation") == after]
        rank0 = [r for r in gen2 if r.get("rank") == 0]
        if not rank0 or back is None or step is None:
            raise Failed(f"generation {after}'s rank 0 logged no start, resume or step")
        phases["start"] = unix(rank0[0]) - running
        to_resumed = unix(back) - unix(rank0[0])
        if scraped.get("restore") is not None:
            phases["setup"] = to_resumed - scraped["restore"]
            phases["restore"] = scraped["restore"]
        else:
            phases["setup + restore"] = to_resumed
        phases["first step"] = unix(step) - unix(back)
        restored = Path(back["event"].split()[2])
        how = ", ".join(
            f"rank {r['rank']} "
            + ("in place" if r.get("in_place") else "warm" if r.get("warm") else "cold")
            for r in sorted(gen2, key=lambda r: r["rank"])
        )
        first = unix(started[0]) if started else kill
        note = (
            f"the kill {kill - first:.1f} s after generation 1 started, in generation {killed}; "
            f"generation {after}: {how}; "
            f"resumed at step {step['step']} from {restored.name}"
            + (
                f"; Keel's own keel_recovery_seconds {scraped['total']:.2f} s"
                if scraped
                else "; the controller's recovery metrics were not read in time"
            )
        )
        return Run("keel", unix(step) - kill, phases, note=note), restored
    except Failed as exc:
        return Run("keel", problem=str(exc)), None
    finally:
        launch.close()
        if launch.leftovers:
            print(f"  keel up: {launch.leftovers} process(es) outlived it", flush=True)


def run_trainer_cold(directory: Path, checkpoint: Path | None) -> Run:
    """The 4 ranks of keel up's job started directly, restoring a copy of ``checkpoint``:
    launch to their first completed step (then stopped)."""
    arm = "cold start"
    if checkpoint is None or not checkpoint.is_dir():
        return Run(arm, problem="no checkpoint to restore: the keel up run of this round failed")
    checkpoints = directory / "checkpoints"
    shutil.copytree(checkpoint, checkpoints / checkpoint.name)
    spec = job_spec(TRAINER, checkpoints)
    env = {k: v for k, v in spec.env.items() if k != "KEEL_FAULTS"}
    env |= {"KEEL_CHECKPOINT_DIR": str(checkpoints), "KEEL_MESH": spec.mesh, "KEEL_PREFLIGHT": "0"}
    launch = Launch(directory)
    try:
        launched = time.time()
        start_ranks(
            launch, list(spec.command), spec.world_size, TRAINER.slots_per_node, 0, "trainer", **env
        )
        step = wait_for(
            lambda: first_step(directory / "trainer-rank0.err"),
            launch.procs,
            RUN_TIMEOUT_S,
            "the cold start",
        )
        back = resumed(directory / "trainer-rank0.err")
        if back is None or checkpoint.name not in back["event"]:
            raise Failed(f"it did not resume from {checkpoint.name}")
        phases = {
            "start + setup + restore": unix(back) - launched,
            "first step": unix(step) - unix(back),
        }
        return Run(arm, unix(step) - launched, phases, note=f"resumed at step {step['step']}")
    except Failed as exc:
        return Run(arm, problem=str(exc))
    finally:
        launch.close()


# --- report ---------------------------------------------------------------------------


def median(runs: list[Run], phase: str | None = None) -> float | None:
    """The median total (or ``phase``) over the runs that have a total."""
    values = [
        r.total if phase is None else r.phases.get(phase) for r in runs if r.total is not None
    ]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def median_total(runs: list[Run]) -> float | None:
    return median(runs)


def table(
    title: str,
    rows: list[tuple[str, str]],
    results: dict[str, list[Run]],
    notes: list[str] = (),
    outcome: str = "recovered",
) -> None:
    """Phases (rows, with a description) by arm (columns): medians over the runs that
    have a total (``outcome``: what such a run did); then every run's total and note."""
    arms = list(results)
    width = max(len(f"{name} ({what})") for name, what in rows) + 2
    column = max(14, *(len(arm) + 2 for arm in arms))
    print(f"\n{title}")
    print(" " * width + "".join(f"{arm:>{column}}" for arm in arms))
    for name, what in [*rows, ("total", "")]:
        cells = []
        for arm in arms:
            value = median(results[arm], None if name == "total" else name)
            cells.append(f"{value:>{column - 2}.2f} s" if value is not None else f"{'—':>{column}}")
        label = f"{name} ({what})" if what else name
        print(f"{label:<{width}}" + "".join(cells))
    for arm in arms:
        runs = results[arm]
        totals = ", ".join(f"{r.total:.2f}" if r.total is not None else "failed" for r in runs)
        ok = sum(1 for r in runs if r.total is not None)
        print(f"  {arm}: {outcome} {ok}/{len(runs)}; totals {totals} s")
        for i, run in enumerate(runs, 1):
            if run.problem:
                print(f"    run {i} failed: {run.problem}")
            elif run.note:
                print(f"    run {i}: {run.note}")
    for note in notes:
        print(f"  {note}")


def ratio(
    numerator: float | None, denominator: float | None, missing: str = "n/a (no run recovered)"
) -> str:
    if numerator is None or not denominator:
        return missing
    return f"{numerator / denominator:.2f}"


def seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="runs per arm")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    parser.add_argument(
        "--scenario",
        choices=("both", "plain", "trainer"),
        default="both",
        help="A (the plain script), B (the reference trainer) or both",
    )
    options = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="keel-bench-recovery-"))
    began = time.monotonic()
    arms = {
        "keel": lambda d: run_keel(d, cold=False),
        "keel --cold-start": lambda d: run_keel(d, cold=True),
        "keel, early kill, eager fill": lambda d: run_keel(d, cold=False, early=True),
        "keel, early kill, lazy fill": lambda d: run_keel(d, cold=False, early=True, fill="lazy"),
        "torchrun": run_torchrun,
        "cold start": run_cold,
    }
    plain: dict[str, list[Run]] = {name: [] for name in arms}
    trainer: dict[str, list[Run]] = {"keel": [], "cold start": []}
    try:
        for round_index in range(options.runs if options.scenario != "trainer" else 0):
            names = list(arms)
            names = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in names:
                directory = root / f"plain-{round_index}-{re.sub('[^a-z]+', '', name)}"
                directory.mkdir()
                plain[name].append(arms[name](directory))
                run = plain[name][-1]
                print(
                    f"plain script, round {round_index + 1}, {name}: "
                    f"{seconds(run.total) if run.total is not None else 'failed: ' + run.problem}",
                    flush=True,
                )
        for round_index in range(options.runs if options.scenario != "plain" else 0):
            run, checkpoint = run_keel_up(root / f"trainer-{round_index}-keel")
            trainer["keel"].append(run)
            print(
                f"reference trainer, round {round_index + 1}, keel: "
                f"{seconds(run.total) if run.total is not None else 'failed: ' + run.problem}",
                flush=True,
            )
            (root / f"trainer-{round_index}-cold").mkdir()
            run = run_trainer_cold(root / f"trainer-{round_index}-cold", checkpoint)
            trainer["cold start"].append(run)
            print(
                f"reference trainer, round {round_index + 1}, cold start: "
                f"{seconds(run.total) if run.total is not None else 'failed: ' + run.problem}",
                flush=True,
            )
    finally:
        if options.keep:
            print(f"runs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    if options.scenario != "trainer":
        table(
            f"A. plain torchrun script (benchmarks/recovery_script.py), world size 2 on one node, "
            f"rank 1 SIGKILLed at epoch {FAIL_EPOCH} (keel --cold-start and the cold start's "
            f"failing run: epoch {EARLY_FAIL_EPOCH}); medians in seconds",
            [
                ("detect", "kill → RUNNING→STOPPING"),
                ("stop", "→ STOPPING→PENDING"),
                ("plan", "→ PENDING→STARTING"),
                ("port", "→ STARTING→RUNNING"),
                ("start", "→ the script's first line"),
                ("imports", "→ torch imported"),
                ("rendezvous", "init_process_group"),
                ("setup", "model and optimizer made"),
                ("restore", "snapshot loaded"),
                ("first step", "the first epoch"),
            ],
            plain,
            [
                (
                    "torchrun's start is kill → the restarted script's first line (its detection, "
                    "stopping the survivor, its rendezvous and the spawn); the cold start's is "
                    "launch → first line"
                )
            ],
        )
    if options.scenario != "plain":
        table(
            f"B. reference trainer, world size 4 (2 nodes × 2), rank 1 SIGKILLed once the warm "
            f"processes are ready, {KILL_AFTER_SAVE_STEPS} steps after a checkpoint's start "
            f"(every {TRAINER.checkpoint_every}); medians in seconds",
            [
                ("detect", "kill → RUNNING→STOPPING"),
                ("stop", "→ STOPPING→PENDING"),
                ("plan", "→ PENDING→STARTING"),
                ("port", "→ STARTING→RUNNING"),
                ("start", "→ the agent started rank 0"),
                ("setup", "→ restore began: rendezvous, model"),
                ("restore", "restore_s: verify and load"),
                ("setup + restore", "when restore_s was not read"),
                ("start + setup + restore", "launch → resumed"),
                ("first step", "→ its first step's end"),
            ],
            trainer,
            [],
        )
    print(f"\nbenchmark wall time {time.monotonic() - began:.0f} s")
    if options.scenario != "trainer":
        keel, torchrun = median_total(plain["keel"]), median_total(plain["torchrun"])
        cold = median_total(plain["cold start"])
        recovered = sum(1 for r in plain["torchrun"] if r.total is not None)
        print(
            f"plain script: keel {seconds(keel)} vs torchrun {seconds(torchrun)} "
            f"(recovered {recovered}/{len(plain['torchrun'])}) -> {ratio(keel, torchrun)}"
        )
        print(
            f"plain script: keel {seconds(keel)} vs cold start {seconds(cold)} "
            f"-> {ratio(keel, cold)}"
        )
        for fill in ("eager", "lazy"):
            early = median_total(plain[f"keel, early kill, {fill} fill"])
            print(
                f"plain script, killed at epoch {EARLY_FAIL_EPOCH}: keel ({fill} warm fill) "
                f"{seconds(early)} vs cold start {seconds(cold)} -> {ratio(early, cold)}"
            )
    if options.scenario != "plain":
        keel_up, trainer_cold = median_total(trainer["keel"]), median_total(trainer["cold start"])
        print(
            f"reference trainer, world 4: keel {seconds(keel_up)} vs cold start with restore "
            f"{seconds(trainer_cold)} -> {ratio(keel_up, trainer_cold)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
