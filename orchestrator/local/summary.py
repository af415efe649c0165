"""What ``keel up`` shows: live progress on stderr while the job runs, and the summary
at the end (text, or one JSON object with ``--json``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common.wire_kinds import WIRE_COLLECTIVES
from orchestrator.local.ledger_check import audit_checkpoint
from orchestrator.policy.event_kind import WIRE_EVENT_KINDS, EventKind
from orchestrator.policy.lifecycle import WIRE_STATES
from protos import keel_pb2


class Progress:
    """Live progress on stderr: one rewritten line on a terminal, else a line per change."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.last = ""
        # Both lists are bounded (the oldest go): what is new is told by generation
        # (one root cause each) and by sequence number.
        self.failures_shown = 0  # generation
        self.events_shown = 0  # seq

    def show(self, status: keel_pb2.JobStatus) -> None:
        for failure in [f for f in status.failures if f.generation > self.failures_shown]:
            self._line(
                f"generation {failure.generation} failed: rank {failure.rank} on "
                f"{failure.node} "
                + (
                    f"killed by signal {failure.signal}"
                    if failure.signal
                    else f"exited {failure.exit_code}"
                )
                + f" after step {failure.last_step}"
                + (
                    f" — {failure.traceback.strip().splitlines()[-1]}"
                    if failure.traceback.strip()
                    else ""
                )
            )
        self.failures_shown = max([self.failures_shown, *(f.generation for f in status.failures)])
        for event in [e for e in status.events if e.seq > self.events_shown]:
            kind = WIRE_EVENT_KINDS.text(event.kind)
            if kind != EventKind.CRASH:  # crashes are shown above with their traceback
                self._line(
                    f"event: {kind} {event.node} — {event.reason}"
                    + (
                        f"; {event.root_cause.splitlines()[0]}"
                        if kind == EventKind.HANG and event.root_cause
                        else ""
                    )
                )
        self.events_shown = max([self.events_shown, *(e.seq for e in status.events)])
        target = f"/{status.target_steps}" if status.target_steps else ""
        loss = f"{status.loss:.4f}" if status.has_loss else "-"
        state = WIRE_STATES.text(status.state)
        text = (
            f"{state:<9} gen {status.generation} world {status.world_size} "
            f"step {status.step}{target} loss {loss} "
            f"{status.tokens_per_s:,.0f} tok/s restarts {status.restarts}"
        )
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
            self.last = text
        elif self._key(text) != self._key(self.last):
            self._line(text)
            self.last = text

    @staticmethod
    def _key(text: str) -> str:
        # Off a terminal, print on state/generation changes and every 5th step only.
        parts = text.split()
        if len(parts) < 7:
            return text
        step = parts[6].split("/")[0]
        return " ".join(parts[:6]) + f" {int(step) // 5 if step.isdigit() else step}"

    def note(self, text: str) -> None:
        self._line(text)

    def _line(self, text: str) -> None:
        if self.tty and self.last:
            sys.stderr.write("\r\033[K")
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")
            sys.stderr.flush()


def summarize(
    status: keel_pb2.JobStatus | None, wall_s: float, workdir: Path, error: str = ""
) -> dict:
    if status is None:
        return {
            "state": "NOT_STARTED",
            "reason": error,
            "steps": 0,
            "initial_loss": None,
            "final_loss": None,
            "world_size": 0,
            "layout": "",
            "generations": 0,
            "restarts": 0,
            "data": None,
            "events": [],
            "preflight": [],
            "goodput": None,
            "wall_s": round(wall_s, 2),
            "workdir": str(workdir),
            "failures": [],
        }
    return {
        "job": status.job,
        "state": WIRE_STATES.text(status.state),
        "reason": error or status.reason,
        "steps": status.step,
        "target_steps": status.target_steps,
        "initial_loss": status.initial_loss if status.has_loss else None,
        "final_loss": status.loss if status.has_loss else None,
        "world_size": status.world_size,
        "layout": status.mesh,
        "generations": status.generation,
        "restarts": status.restarts,
        "tokens": status.tokens,
        "wall_s": round(wall_s, 2),
        "last_checkpoint": (
            {"step": status.last_checkpoint.step, "path": status.last_checkpoint.path}
            if status.HasField("last_checkpoint")
            else None
        ),
        "last_memory_snapshot": (
            {
                "step": status.last_memory_snapshot.step,
                "generation": status.last_memory_snapshot.generation,
                "nodes": list(status.last_memory_snapshot.nodes),
                "replica_step": status.last_memory_snapshot.replica_step,
                "replica_node": status.last_memory_snapshot.replica_node,
            }
            if status.HasField("last_memory_snapshot")
            else None
        ),
        "failures": [
            {
                "generation": f.generation,
                "node": f.node,
                "rank": f.rank,
                "pid": f.pid,
                "exit_code": f.exit_code,
                "signal": f.signal,
                "last_step": f.last_step,
                "traceback": f.traceback,
            }
            for f in status.failures
        ],
        "data": _data_audit(status),
        "goodput": {
            "ratio": round(status.goodput.ratio, 4),
            "wall_s": round(status.goodput.accounted_s, 3),
            "at_risk_s": round(status.goodput.at_risk_s, 3),
            "submitted_at": status.submitted_at,
            "ended_at": status.ended_at,
            "seconds": {k: round(v, 3) for k, v in sorted(status.goodput.seconds.items())},
        },
        "events": [_event_json(e) for e in status.events],
        "preflight": [
            {
                "node": p.node,
                "generation": p.generation,
                "slow": p.slow,
                "results": [
                    {
                        "collective": WIRE_COLLECTIVES.text(r.collective),
                        "size_bytes": r.size_bytes,
                        "time_s": r.time_s,
                        "algbw_gbps": r.algbw_gbps,
                        "busbw_gbps": r.busbw_gbps,
                    }
                    for r in p.results
                ],
            }
            for p in status.preflight
        ],
        "workdir": str(workdir),
    }


def _event_json(event: keel_pb2.Event) -> dict:
    kind = WIRE_EVENT_KINDS.text(event.kind)
    out = {
        "kind": kind,
        "node": event.node,
        "rank": event.rank if event.HasField("rank") else None,
        "step": event.step,
        "generation": event.generation,
        "reason": event.reason,
    }
    if kind in (EventKind.CRASH, EventKind.HANG, EventKind.NODE_LOST):
        out["detected_after_s"] = round(event.detected_after_s, 3)
    if kind == EventKind.STRAGGLER:
        out["detected_after_steps"] = event.detected_after_steps
    if event.root_cause:
        out["root_cause"] = event.root_cause
    if event.stacks:
        out["stacks"] = {str(rank): stack for rank, stack in sorted(event.stacks.items())}
    return out


def _data_audit(status: keel_pb2.JobStatus) -> dict | None:
    """The final checkpoint's data ledger audited, or None without one (e.g. a script)."""
    if not status.HasField("last_checkpoint"):
        return None
    try:
        return audit_checkpoint(Path(status.last_checkpoint.path))
    except (FileNotFoundError, KeyError, ValueError):
        return None


def succeeded(summary: dict) -> bool:
    return summary["state"] == "SUCCEEDED" and summary["steps"] >= summary.get("target_steps", 0)


def print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
        return
    loss = ""
    if summary["initial_loss"] is not None:
        loss = f", loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}"
    print(
        f"{summary['state']}: {summary['steps']} steps at world size "
        f"{summary['world_size']} ({summary.get('layout') or '-'}){loss}; "
        f"{summary['generations']} generation(s), {summary['restarts']} restart(s), "
        f"{summary['wall_s']:.1f} s"
    )
    if summary.get("goodput") and summary["goodput"]["wall_s"] > 0:
        goodput = summary["goodput"]
        lost = ", ".join(
            f"{cause} {seconds:.1f} s"
            for cause, seconds in sorted(goodput["seconds"].items(), key=lambda kv: -kv[1])
            if cause != "productive" and seconds >= 0.05
        )
        print(
            f"  goodput: {goodput['ratio']:.1%} of {goodput['wall_s']:.1f} s"
            + (f"; lost to {lost}" if lost else "")
        )
    if summary.get("data"):
        data = summary["data"]
        print(
            f"  data: {data['consumed']}/{data['expected']} samples consumed, "
            f"{data['duplicates']} duplicated, {data['missing']} missing"
        )
    for failure in summary["failures"]:
        how = (
            f"signal {failure['signal']}"
            if failure["signal"]
            else f"exit code {failure['exit_code']}"
        )
        print(
            f"  generation {failure['generation']}: rank {failure['rank']} on "
            f"{failure['node']} (pid {failure['pid']}) {how} after step "
            f"{failure['last_step']}"
        )
    if summary.get("reason"):
        print(f"  reason: {summary['reason']}")
    print(f"  logs and checkpoints: {summary['workdir']}")
