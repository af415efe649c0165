"""Keel's failure detection: how long it takes to decide that a rank crashed or hung,
how many steps it takes to flag a slow node, and how often it flags anything on a
clean run; against baselines measured in the same run.

Every Keel run is ``keel up`` of the reference trainer on 2 nodes of 1 slot each (world
size 2, ``--no-preflight``, no checkpoint before the last step, ``--straggler-policy
alert`` so that a flag changes nothing, ``--max-restarts 0`` so that a failure ends the
job instead of restarting it), with one fault injected into rank 1 (``--inject``),
interrupted once what it measures is in the logs. Every torchrun run is ``python -m
torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1`` of the same
trainer with the same arguments, the same fault (``KEEL_FAULTS``, which the trainer
applies under any launcher) and ``LOGLEVEL=INFO``, stopped once it has logged its
restart decision. Ranks run with ``OMP_NUM_THREADS=1``. Times come from the logs: the
trainer's and the controller's JSON lines (UTC) and torchrun's own lines (local time,
milliseconds).

* **Crash**: rank 1 SIGKILLs itself at the start of step ``FAULT_STEP`` (the ``kill``
  fault: the exit is the fault's log line, to the microsecond; a ``crash``, an exception,
  spends a variable few seconds in the rank's own teardown before it exits, which no
  launcher sees). Keel: the kill to the controller's RUNNING→STOPPING (its decision),
  split at the agent's ``rank exited``. torchrun: the kill to its first line about it
  (it sends the survivor SIGTERM, then logs the failed worker and ``Worker group FAILED
  ... will restart``).
* **Hang**: rank 1 stops at the start of step ``FAULT_STEP`` (the ``hang`` fault: alive,
  silent), the peer blocks in the step's first collective. Keel, with ``--hang-floor-s
  HANG_FLOOR_S`` and ``--collective-timeout-s COLLECTIVE_TIMEOUT_S``: the hang to
  RUNNING→STOPPING, split at the first agent's ``hang detected``; and that minus the
  timeout the agent applied (``max(floor, k × median step)``, read from its verdict).
  torchrun, with the trainer's ``--collective-timeout-s COLLECTIVE_TIMEOUT_S``: the
  hang to its first line about the failure, once rank 0's collective timed out; and
  that minus the collective timeout.
* **Straggler**: rank 1's steps stretched by a factor from step ``SLOW_STEP`` (the
  ``slow`` fault: the rank sleeps ``factor − 1`` times its compute after each step,
  before its peers wait for it), for ``SLOW_STEPS`` steps, at each of ``FACTORS``: the step the
  controller's ``straggler`` event names (the end of the window that flagged it) and
  the step rank 0 had logged when the controller logged the flag, each counted from the
  slowdown; and the seconds between. ``SLOW_STEP`` is the first step of a window, so
  the least it can take is the detector's window times its patience. torchrun has no
  straggler detector: the baseline is that least.
* **Clean**: one run of ``CLEAN_STEPS`` steps without faults: the straggler flags and
  the hang and crash verdicts it raised, per 1000 rank-steps and per minute of
  stepping, and the highest window score (a node's slowest rank over the others'
  median) the controller exported in the run (``keel_job_straggler_score``, scraped
  every ``SCRAPE_S``), against the flagging threshold.

With ``--runs`` above 1, the crash and hang arms alternate round by round, the order
rotated each round; medians are over the rounds. Prints a table per scenario (medians,
then each run), and last the figures::

    python -m benchmarks.detection [--runs 1] [--clean-steps 150] [--keep]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from benchmarks import recovery
from benchmarks.recovery import (
    Failed,
    Launch,
    Run,
    json_lines,
    median,
    metric,
    seconds,
    table,
    transitions,
    unix,
)
from orchestrator.local.options import JOB_NAME, UpOptions, job_spec
from orchestrator.spec.health import DEFAULTS

FAULT_STEP = 6  # crash and hang: at the start of this step
HANG_FLOOR_S = 4.0
COLLECTIVE_TIMEOUT_S = 20.0  # both arms' collective timeout (it must exceed 1.2 x (floor + 5 s))
WINDOW, PATIENCE = DEFAULTS.straggler_window, DEFAULTS.straggler_patience
SLOW_STEP = WINDOW + 1  # the first step of the second window
SLOW_STEPS = 30
FACTORS = (1.2, 1.5, 2.0)
CLEAN_STEPS = 150
SCRAPE_S = 0.25
BASE = UpOptions(
    nodes=2,
    slots_per_node=1,
    steps=FAULT_STEP + 10,
    checkpoint_every=1000,
    preflight=False,
    straggler_policy="alert",
    max_restarts=0,
)
RUN_TIMEOUT_S = 240.0  # one run, cluster start and stop included
STOP_TIMEOUT_S = 60.0  # keel up's shutdown after SIGINT
POLL_S = 0.05
# torchrun's own lines: "W1201 18:34:08.437000 18919 path/api.py:1028] message".
TORCHRUN_LINE = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) +\d+ \S+\] (.*)$")
TORCHRUN_REACTIONS = ("closing signal SIGTERM", "failed (exitcode", "Worker group FAILED")


# --- runs -----------------------------------------------------------------------------


def wait_until(
    done: Callable[[], object],
    proc: subprocess.Popen,
    timeout_s: float,
    what: str,
    tick: Callable[[], None] | None = None,
):
    """Polls ``done()`` until it returns something, and returns it; None if ``proc``
    exits first. ``tick`` runs on every poll. Raises Failed after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = done()
        if found:
            return found
        if proc.poll() is not None:
            return done() or None
        if tick is not None:
            tick()
        time.sleep(POLL_S)
    raise Failed(f"{what}: nothing within {timeout_s:.0f} s")


def up_flags(options: UpOptions) -> list[str]:
    """``keel up``'s flags for ``options`` (the fields this benchmark sets)."""
    flags = [
        "--nodes",
        str(options.nodes),
        "--slots-per-node",
        str(options.slots_per_node),
        "--steps",
        str(options.steps),
        "--checkpoint-every",
        str(options.checkpoint_every),
        "--straggler-policy",
        options.straggler_policy,
        "--max-restarts",
        str(options.max_restarts),
        "--hang-floor-s",
        str(options.hang_floor_s),
    ]
    if options.collective_timeout_s:
        flags += ["--collective-timeout-s", str(options.collective_timeout_s)]
    if not options.preflight:
        flags.append("--no-preflight")
    for fault in options.inject:
        flags += ["--inject", fault]
    return flags


@dataclass
class KeelRun:
    work: Path
    found: object  # what ``done`` returned; None if keel up ended first
    summary: dict


def keel_up(
    directory: Path,
    options: UpOptions,
    done: Callable[[Path], object],
    tick: Callable[[Path], None] | None = None,
) -> KeelRun:
    """``keel up`` with ``options`` until ``done(workdir)`` returns something (then it
    is interrupted) or it ends; every process it started is stopped before returning."""
    work = directory / "keel"
    launch = Launch(directory)
    try:
        proc = launch.start(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "up",
                *up_flags(options),
                "--json",
                "--workdir",
                str(work),
            ],
            "keel-up",
            launch.env(OMP_NUM_THREADS="1"),
        )
        found = wait_until(
            lambda: done(work),
            proc,
            RUN_TIMEOUT_S,
            "keel up",
            (lambda: tick(work)) if tick else None,
        )
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Failed(f"keel up did not stop within {STOP_TIMEOUT_S:.0f} s of SIGINT") from None
        lines = [
            line
            for line in (directory / "keel-up.out").read_text().splitlines()
            if line.startswith("{")
        ]
        return KeelRun(work, found, json.loads(lines[-1]) if lines else {})
    finally:
        launch.close()
        if launch.leftovers:
            print(f"  keel up: {launch.leftovers} process(es) outlived it", flush=True)


def rank_log(work: Path, rank: int) -> Path:
    """Generation 1's stderr of ``rank``, on whichever node it ran."""
    found = sorted(work.glob(f"nodes/*/{JOB_NAME}/gen1/rank{rank}.err"))
    if not found:
        raise Failed(f"no log of rank {rank} in generation 1")
    return found[0]


def fault_time(records: list[dict], prefix: str) -> float:
    """When the trainer logged the fault whose message starts with ``prefix``."""
    for record in records:
        if str(record.get("event", "")).startswith(prefix):
            return unix(record)
    raise Failed(f"rank 1 logged no {prefix!r}")


def stopping(work: Path, since: float) -> tuple[float, str] | None:
    """The controller's first RUNNING→STOPPING at or after ``since``: time and reason."""
    for old, new, at, reason in transitions(work / "logs" / "controller.log"):
        if (old, new) == ("RUNNING", "STOPPING") and at >= since:
            return at, reason
    return None


def controller_events(work: Path, kind: str | None = None) -> list[dict]:
    return [
        r
        for r in json_lines(work / "logs" / "controller.log")
        if r.get("event") == "event" and (kind is None or r.get("kind") == kind)
    ]


def agent_records(work: Path, event: str) -> list[dict]:
    return sorted(
        (
            r
            for path in sorted((work / "logs").glob("agent-*.log"))
            for r in json_lines(path)
            if r.get("event") == event
        ),
        key=unix,
    )


def torchrun(directory: Path, options: UpOptions, done: Callable[[Path], object]) -> Path:
    """The trainer of ``options`` under torchrun --max-restarts 1, with its faults,
    until ``done(its stderr)`` returns something; then stopped. Its stderr (torchrun's
    lines and the ranks' logs) is the result."""
    spec = job_spec(options, directory / "checkpoints")
    argv = list(spec.command)[3:]  # after "python -u -m": trainer.train and its flags
    if options.collective_timeout_s:
        argv.insert(1, f"--collective-timeout-s={options.collective_timeout_s}")
    launch = Launch(directory)
    try:
        proc = launch.start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(options.world_size),
                "--max-restarts",
                "1",
                "--log-dir",
                str(directory / "torchelastic"),
                "-m",
                *argv,
            ],
            "torchrun",
            launch.env(
                **spec.env,
                KEEL_MESH=spec.mesh,
                KEEL_PREFLIGHT="0",
                LOGLEVEL="INFO",
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
            ),
        )
        err = directory / "torchrun.err"
        if not wait_until(lambda: done(err), proc, RUN_TIMEOUT_S, "torchrun"):
            raise Failed(f"torchrun exited {proc.returncode} before reacting to the fault")
        return err
    finally:
        launch.close()


def torchrun_lines(err: Path, year: int) -> list[tuple[float, str]]:
    """torchrun's own log lines: (unix time, message). They carry no year, and local
    time: ``year`` is the run's."""
    lines = []
    for line in err.read_text(errors="replace").splitlines():
        match = TORCHRUN_LINE.match(line)
        if match:
            month, day, clock, message = match.groups()
            at = datetime.strptime(f"{year}-{month}-{day} {clock}", "%Y-%m-%d %H:%M:%S.%f")
            lines.append((at.timestamp(), message))
    return lines


def torchrun_reaction(
    err: Path, prefix: str
) -> tuple[float, float, list[tuple[float, str]]] | None:
    """The fault's time (the trainer's line starting with ``prefix``), the time of
    torchrun's first line reacting to it, and its lines from then on; None before both."""
    records = [r for r in json_lines(err) if r.get("component") == "trainer"]
    try:
        fault = fault_time(records, prefix)
    except Failed:
        return None
    after = [
        (at, message)
        for at, message in torchrun_lines(err, datetime.now().year)
        if at >= fault - 0.001
    ]  # torchrun's times are in milliseconds
    reactions = [
        (at, message)
        for at, message in after
        if any(mark in message for mark in TORCHRUN_REACTIONS)
    ]
    if not reactions:
        return None
    return fault, reactions[0][0], after


def restart_decided(after: list[tuple[float, str]]) -> float | None:
    """When torchrun logged its decision to restart the worker group."""
    return next((at for at, message in after if "Worker group FAILED" in message), None)


def torchrun_decided(err: Path, prefix: str):
    """``torchrun_reaction`` once torchrun has also logged its restart decision."""
    found = torchrun_reaction(err, prefix)
    return found if found and restart_decided(found[2]) is not None else None


# --- crash ----------------------------------------------------------------------------

CRASH = replace(BASE, inject=(f"kill:rank=1,step={FAULT_STEP}",))


def crash_keel(directory: Path) -> Run:
    """Kill → the controller's RUNNING→STOPPING, split at the agent's ``rank exited``."""
    try:
        run = keel_up(directory, CRASH, lambda work: stopping(work, 0.0))
        if run.found is None:
            raise Failed(f"the controller never stopped the job ({run.summary.get('reason')})")
        kill = fault_time(json_lines(rank_log(run.work, 1)), "injecting kill")
        decided = stopping(run.work, kill)
        if decided is None:
            raise Failed("no RUNNING→STOPPING after the kill")
        at, reason = decided
        if "rank 1 " not in reason or "signal 9" not in reason:
            raise Failed(f"the job stopped for another reason: {reason}")
        exited = [
            r
            for r in agent_records(run.work, "rank exited")
            if r.get("rank") == 1 and unix(r) >= kill
        ]
        phases = {"reaped": unix(exited[0]) - kill} if exited else {}
        phases["decided"] = at - kill - phases.get("reaped", 0.0)
        return Run("keel", at - kill, phases, note=f"decision: {reason[:90]}")
    except Failed as exc:
        return Run("keel", problem=str(exc))


def crash_torchrun(directory: Path) -> Run:
    """Kill → torchrun's first line about it, then to ``Worker group FAILED``."""
    try:
        err = torchrun(directory, CRASH, lambda err: torchrun_decided(err, "injecting kill"))
        kill, reacted, after = torchrun_reaction(err, "injecting kill")
        phases = {"reaction": reacted - kill}
        failed = restart_decided(after)
        if failed is not None:
            phases["restart decided"] = failed - reacted
        first = next(message for at, message in after if at == reacted)
        return Run("torchrun", reacted - kill, phases, note=f"first line: {first[:90]}")
    except Failed as exc:
        return Run("torchrun", problem=str(exc))


# --- hang -----------------------------------------------------------------------------

HANG = replace(
    BASE,
    inject=(f"hang:rank=1,step={FAULT_STEP}",),
    hang_floor_s=HANG_FLOOR_S,
    collective_timeout_s=COLLECTIVE_TIMEOUT_S,
)


def hang_keel(directory: Path) -> Run:
    """Hang → the controller's RUNNING→STOPPING, split at the first agent's verdict;
    ``beyond timeout`` is that minus the timeout the agent applied."""
    try:
        run = keel_up(directory, HANG, lambda work: stopping(work, 0.0))
        if run.found is None:
            raise Failed(f"the controller never stopped the job ({run.summary.get('reason')})")
        hung = fault_time(json_lines(rank_log(run.work, 1)), "injecting hang")
        decided = stopping(run.work, hung)
        if decided is None:
            raise Failed("no RUNNING→STOPPING after the hang")
        at, reason = decided
        timeout = re.search(r"\(timeout ([\d.]+) ?s", reason)
        if "made no progress" not in reason or timeout is None:
            raise Failed(f"the job stopped for another reason: {reason}")
        timeout_s = float(timeout.group(1))
        verdicts = [r for r in agent_records(run.work, "hang detected") if unix(r) >= hung]
        phases = {"verdict": unix(verdicts[0]) - hung} if verdicts else {}
        phases["decided"] = at - hung - phases.get("verdict", 0.0)
        phases["timeout"] = timeout_s
        phases["beyond timeout"] = at - hung - timeout_s
        event = next((e for e in run.summary.get("events", []) if e.get("kind") == "hang"), {})
        named = re.match(r"rank (\d+)", reason)
        refused = [
            r
            for r in json_lines(run.work / "logs" / "controller.log")
            if r.get("event") == "refusing an agent message"
        ]
        note = (
            f"{len(verdicts)} agent verdict(s), {len(refused)} agent message(s) refused; the "
            f"decision names rank {named.group(1) if named else '?'}, the event (after the "
            f"stacks) rank {event.get('rank', '?')}: {event.get('root_cause', '')[:70]}"
        )
        return Run("keel", at - hung, phases, note=note)
    except Failed as exc:
        return Run("keel", problem=str(exc))


def hang_torchrun(directory: Path) -> Run:
    """Hang → torchrun's first line about the failure (rank 0's collective timed out)."""
    try:
        err = torchrun(directory, HANG, lambda err: torchrun_decided(err, "injecting hang"))
        hung, reacted, after = torchrun_reaction(err, "injecting hang")
        text = err.read_text(errors="replace")
        why = re.findall(r"\[rank0\]: (RuntimeError: .*Timed out.*)", text)
        phases = {
            "reaction": reacted - hung,
            "timeout": COLLECTIVE_TIMEOUT_S,
            "beyond timeout": reacted - hung - COLLECTIVE_TIMEOUT_S,
        }
        failed = restart_decided(after)
        note = (
            ("rank 0: " + why[0].split("] ", 1)[-1][:80])
            if why
            else "rank 0 logged no collective timeout"
        )
        if failed is not None:
            note += f"; Worker group FAILED {failed - reacted:.2f} s after its first line"
        return Run("torchrun", reacted - hung, phases, note=note)
    except Failed as exc:
        return Run("torchrun", problem=str(exc))


# --- stragglers -----------------------------------------------------------------------


@dataclass
class Straggler:
    factor: float
    flagged_at_step: int | None = None  # the window end the flag names
    trainer_step: int | None = None  # rank 0's last logged step when it was flagged
    seconds: float | None = None  # slowdown → the flag's log line
    ratio: float | None = None  # the score the flag gave
    others: int = 0  # flags on another node (false)
    problem: str = ""


def straggler_run(directory: Path, factor: float) -> Straggler:
    """Rank 1 slowed by ``factor`` from ``SLOW_STEP``: until the controller flags its
    node (then interrupted), or for ``SLOW_STEPS`` steps."""
    options = replace(
        BASE,
        steps=SLOW_STEP + SLOW_STEPS - 1,
        inject=(f"slow:rank=1,step={SLOW_STEP},factor={factor:g}",),
    )
    result = Straggler(factor)

    def flags_of_slow_node(work: Path) -> list[dict]:
        if not list(work.glob(f"nodes/*/{JOB_NAME}/gen1/rank1.err")):
            return []
        node = rank_log(work, 1).parts[-4]
        return [f for f in controller_events(work, "straggler") if f.get("node") == node]

    try:
        run = keel_up(directory, options, flags_of_slow_node)
        slowed = fault_time(json_lines(rank_log(run.work, 1)), "injected slow-down")
        mine = flags_of_slow_node(run.work)
        result.others = len(controller_events(run.work, "straggler")) - len(mine)
        if not mine:
            if run.summary.get("state") != "SUCCEEDED":
                raise Failed(
                    f"the job ended {run.summary.get('state')} before a flag: "
                    f"{run.summary.get('reason')}"
                )
            return result
        flag = mine[0]
        steps = [r for r in json_lines(rank_log(run.work, 0)) if r.get("event") == "step"]
        result.flagged_at_step = flag["step"]
        result.trainer_step = max((r["step"] for r in steps if unix(r) <= unix(flag)), default=0)
        result.seconds = unix(flag) - slowed
        score = re.search(r"step time ([\d.]+)x", flag.get("reason", ""))
        result.ratio = float(score.group(1)) if score else None
    except Failed as exc:
        result.problem = str(exc)
    return result


# --- clean ----------------------------------------------------------------------------


@dataclass
class Clean:
    rank_steps: int = 0
    minutes: float = 0.0
    flags: int = 0
    hangs: int = 0  # the controller's hang events
    verdicts: int = 0  # the agents' hang verdicts (each agent judges its own ranks)
    crashes: int = 0
    stops: int = 0
    top_score: float | None = None
    scores_seen: int = 0
    reasons: list[str] = field(default_factory=list)  # of every flag and verdict
    problem: str = ""


def clean_run(directory: Path, steps: int) -> Clean:
    """``steps`` steps without a fault, to the end, scraping the straggler scores."""
    result = Clean()
    seen: set[tuple[float, ...]] = set()
    scraped = [0.0]

    def scrape(work: Path) -> None:
        if time.monotonic() - scraped[0] < SCRAPE_S:
            return
        scraped[0] = time.monotonic()
        try:
            address = (work / "prometheus" / "controller-0.address").read_text().strip()
            text = urllib.request.urlopen(f"http://{address}/metrics", timeout=1).read().decode()
        except OSError:
            return
        scores = tuple(
            metric(text, "keel_job_straggler_score", job_name=JOB_NAME, node=node)
            for node in ("node-0", "node-1")
        )
        if None not in scores:
            seen.add(scores)

    try:
        run = keel_up(directory, replace(BASE, steps=steps), lambda work: None, scrape)
        if run.summary.get("state") != "SUCCEEDED":
            raise Failed(
                f"the clean run ended {run.summary.get('state')}: {run.summary.get('reason')}"
            )
        result.rank_steps = run.summary["steps"] * run.summary["world_size"]
        logged = [unix(r) for r in json_lines(rank_log(run.work, 0)) if r.get("event") == "step"]
        result.minutes = (max(logged) - min(logged)) / 60
        result.flags = len(controller_events(run.work, "straggler"))
        result.reasons = [
            f"{e['kind']}: {e.get('reason', '')}" for e in controller_events(run.work)
        ]
        result.hangs = len(controller_events(run.work, "hang"))
        result.verdicts = len(agent_records(run.work, "hang detected"))
        result.crashes = len(controller_events(run.work, "crash"))
        result.stops = sum(
            1
            for old, new, _, _ in transitions(run.work / "logs" / "controller.log")
            if (old, new) == ("RUNNING", "STOPPING")
        )
        result.scores_seen = len(seen)
        result.top_score = max((max(s) for s in seen), default=None)
    except Failed as exc:
        result.problem = str(exc)
    return result


# --- report ---------------------------------------------------------------------------


def score(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def ratio(numerator: float | None, denominator: float | None) -> str:
    return recovery.ratio(numerator, denominator, "n/a (a side has no figure)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="crash and hang runs per arm (each round adds about a minute and a half)",
    )
    parser.add_argument(
        "--clean-steps", type=int, default=CLEAN_STEPS, help="steps of the clean run"
    )
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    options = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="keel-bench-detection-"))
    began = time.monotonic()
    arms = {
        ("crash", "keel"): crash_keel,
        ("crash", "torchrun"): crash_torchrun,
        ("hang", "keel"): hang_keel,
        ("hang", "torchrun"): hang_torchrun,
    }
    results: dict[str, dict[str, list[Run]]] = {
        "crash": {"keel": [], "torchrun": []},
        "hang": {"keel": [], "torchrun": []},
    }
    stragglers: list[Straggler] = []
    clean = Clean()
    try:
        for round_index in range(options.runs):
            names = list(arms)
            names = names[round_index % len(names) :] + names[: round_index % len(names)]
            for scenario, arm in names:
                directory = root / f"{scenario}-{round_index}-{arm}"
                directory.mkdir()
                run = arms[scenario, arm](directory)
                results[scenario][arm].append(run)
                print(
                    f"{scenario}, round {round_index + 1}, {arm}: "
                    f"{seconds(run.total) if run.total is not None else 'failed: ' + run.problem}",
                    flush=True,
                )
        for factor in FACTORS:
            directory = root / f"straggler-{factor:g}"
            directory.mkdir()
            stragglers.append(straggler_run(directory, factor))
            s = stragglers[-1]
            print(
                f"straggler x{factor:g}: "
                + (
                    f"failed: {s.problem}"
                    if s.problem
                    else f"flagged at step {s.flagged_at_step}"
                    if s.flagged_at_step
                    else f"not flagged in {SLOW_STEPS} steps"
                ),
                flush=True,
            )
        (root / "clean").mkdir()
        clean = clean_run(root / "clean", options.clean_steps)
        print(
            f"clean, {options.clean_steps} steps: "
            + (
                f"failed: {clean.problem}"
                if clean.problem
                else f"{clean.flags + clean.hangs + clean.crashes} flag(s) or verdict(s)"
            ),
            flush=True,
        )
    finally:
        if options.keep:
            print(f"runs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    table(
        f"A. crash: rank 1 SIGKILLed at step {FAULT_STEP}, world size 2; medians in seconds",
        [
            ("reaped", "kill → the agent's rank exited"),
            ("decided", "→ RUNNING→STOPPING"),
            ("reaction", "kill → torchrun's first line"),
            ("restart decided", "→ Worker group FAILED"),
        ],
        results["crash"],
        outcome="detected",
    )
    table(
        f"B. hang: rank 1 stopped at step {FAULT_STEP}, hang floor {HANG_FLOOR_S:g} s, collective "
        f"timeout {COLLECTIVE_TIMEOUT_S:g} s in both arms; medians in seconds",
        [
            ("verdict", "hang → the first agent's hang detected"),
            ("decided", "→ RUNNING→STOPPING"),
            ("reaction", "hang → torchrun's first line"),
            ("timeout", "the one applied"),
            ("beyond timeout", "total − timeout"),
        ],
        results["hang"],
        outcome="detected",
    )
    least = WINDOW * PATIENCE
    print(
        f"\nC. straggler: rank 1 slowed from step {SLOW_STEP} for {SLOW_STEPS} steps; detector "
        f"window {WINDOW} steps, patience {PATIENCE} windows, threshold "
        f"{DEFAULTS.straggler_slowdown:g}x (so at least {least} slow steps)"
    )
    print(
        f"{'factor':>8}{'flagged at':>12}{'slow steps':>12}{'trainer at':>12}{'steps run':>11}"
        f"{'seconds':>9}{'score':>8}{'other flags':>13}"
    )
    for s in stragglers:
        if s.problem:
            print(f"{s.factor:>8g}  failed: {s.problem}")
        elif s.flagged_at_step is None:
            print(f"{s.factor:>8g}  not flagged in {SLOW_STEPS} steps{'':>36}{s.others:>13}")
        else:
            print(
                f"{s.factor:>8g}{s.flagged_at_step:>12}{s.flagged_at_step - SLOW_STEP + 1:>12}"
                f"{s.trainer_step:>12}{s.trainer_step - SLOW_STEP + 1:>11}{s.seconds:>8.2f}s"
                f"{s.ratio:>7.2f}x{s.others:>13}"
            )
    print(
        "  flagged at: the window end the flag names; slow steps: from the slowdown through it; "
        "trainer at: rank 0's last step logged when the controller logged the flag"
    )
    print(f"\nD. clean: {options.clean_steps} steps, world size 2, no fault")
    if clean.problem:
        print(f"  failed: {clean.problem}")
    else:
        print(
            f"  {clean.rank_steps} rank-steps over {clean.minutes:.2f} min of stepping: "
            f"{clean.flags} straggler flag(s), {clean.hangs} hang event(s) ({clean.verdicts} agent "
            f"verdict(s)), {clean.crashes} crash event(s), {clean.stops} stop(s); highest window "
            f"score {score(clean.top_score)} over {clean.scores_seen} distinct scrapes"
        )
        for reason in clean.reasons:
            print(f"    {reason}")
    print(f"\nbenchmark wall time {time.monotonic() - began:.0f} s")
    keel, plain = median(results["crash"]["keel"]), median(results["crash"]["torchrun"])
    print(
        f"crash (kill → decision): keel {seconds(keel)} vs torchrun {seconds(plain)} "
        f"-> {ratio(keel, plain)}"
    )
    keel, plain = median(results["hang"]["keel"]), median(results["hang"]["torchrun"])
    beyond = median(results["hang"]["keel"], "beyond timeout")
    plain_beyond = median(results["hang"]["torchrun"], "beyond timeout")
    timeout = median(results["hang"]["keel"], "timeout")
    print(
        f"hang (hang → decision): keel {seconds(keel)} (timeout {seconds(timeout)}, "
        f"{seconds(beyond)} beyond) vs torchrun {seconds(plain)} (collective timeout "
        f"{COLLECTIVE_TIMEOUT_S:.2f} s, {seconds(plain_beyond)} beyond) -> {ratio(keel, plain)}"
    )
    for s in stragglers:
        if s.problem:
            print(f"straggler x{s.factor:g}: n/a (the run failed)")
        elif s.flagged_at_step is None:
            print(f"straggler x{s.factor:g}: not flagged in {SLOW_STEPS} steps")
        else:
            slow = s.flagged_at_step - SLOW_STEP + 1
            print(
                f"straggler x{s.factor:g}: flagged after {slow} slow steps vs the least "
                f"{least} (window {WINDOW} x patience {PATIENCE}) -> {slow / least:.2f}; "
                f"{s.trainer_step - SLOW_STEP + 1} steps run, {s.seconds:.2f} s, score "
                f"{score(s.ratio)}"
            )
    if clean.problem:
        print("false flags: n/a (the clean run failed)")
    else:
        false = clean.flags + clean.hangs + clean.crashes
        per_minute = false / clean.minutes if clean.minutes else float("nan")
        print(
            f"false flags: {false} in {clean.rank_steps} rank-steps ({clean.minutes:.2f} "
            f"run-minutes) -> "
            f"{1000 * false / max(clean.rank_steps, 1):.2f} per 1000 rank-steps, "
            f"{per_minute:.2f} per run-minute; highest clean window score "
            f"{score(clean.top_score)} vs threshold {DEFAULTS.straggler_slowdown:g}x "
            f"-> {ratio(clean.top_score, DEFAULTS.straggler_slowdown)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
