"""Monitoring end to end: a real Prometheus (Debian's package) scrapes a running
``keel up`` through the targets and the ``prometheus.yml`` it writes, with Keel's rules
loaded, while the job crashes once, loses its leader and has a straggler replaced.

One run serves every check: what Prometheus holds afterwards (the step, a goodput ratio,
restarts by cause, every metric the dashboard and the rules name), the new leader's
first scrape, and the goodput breakdown ``keel up --json`` reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from common.net import free_port
from orchestrator.policy.lifecycle import JobState
from tests.conftest import REPO, wait_for
from tests.promql import dashboard_exprs, metric_names, rule_exprs

DASHBOARD = REPO / "deploy" / "grafana" / "keel.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
# Exported only where the accelerators' peak FLOP/s is known: never on CPU (its value
# is checked in tests/unit/orchestrator/controller/test_metrics.py).
NOT_ON_CPU = {"keel_job_mfu_ratio"}
# Exported for a job whose memory snapshots the controller records, and by agents that
# copy them to a partner (a job on a single node: one across nodes makes no copies); this
# run has no memory tier (checked in tests/unit/orchestrator/controller/test_metrics.py;
# the record and the copies in tests/integration/test_memory_tier.py).
NOT_ACROSS_NODES = {
    "keel_memory_snapshot_last_step",
    "keel_memory_snapshot_age_seconds",
    "keel_memory_snapshot_replica_step",
    "keel_agent_replicated_bytes_total",
    "keel_agent_replication_seconds_total",
}
JOB = "keel-up"
# The run (three generations, a failover) happens in the first test's fixture.
pytestmark = pytest.mark.timeout(600)


class Prometheus:
    """A Prometheus server on a free port, and its HTTP API."""

    def __init__(self, binary: str, config: Path, data: Path, log: Path):
        self.url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={data}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
            )
        wait_for(self._ready, 60, 0.2, "prometheus ready")

    def _ready(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def samples(self, selector: str, window: str = "30m") -> dict[float, float]:
        """The raw samples of one series: scrape timestamp -> value."""
        result = self.query(f"{selector}[{window}]")
        assert len(result) == 1, (selector, result)
        return {float(t): float(v) for t, v in result[0]["values"]}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def monitored_run(tmp_path_factory, prometheus_binary):
    """A ``keel up`` run watched by Prometheus: its summary, and the server (still up)."""
    base = tmp_path_factory.mktemp("monitored")
    workdir = base / "run"
    with open(base / "up.err", "wb") as up_err:  # the child keeps its own descriptor
        up = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "up",
                "--json",
                "--workdir",
                str(workdir),
                "--timeout-s",
                "420",
                # Three scrapes after the end: what Prometheus holds last is the job's end
                # state, however fast the machine ran its last steps.
                "--linger-s",
                "6",
                "--controllers",
                "2",
                "--nodes",
                "2",
                "--spares",
                "1",
                "--slots-per-node",
                "1",
                "--steps",
                "60",
                "--checkpoint-every",
                "5",
                "--inject",
                "crash:rank=0,step=12",
                "--inject",
                "kill_leader:step=20",
                "--inject",
                "slow:rank=1,step=22,factor=5",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=up_err,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    server = None
    try:
        config = workdir / "prometheus" / "prometheus.yml"
        wait_for(lambda: config.exists() or up.poll() is not None, 120, 0.1, "prometheus.yml")
        assert config.exists(), (base / "up.err").read_text()[-4000:]
        server = Prometheus(prometheus_binary, config, base / "tsdb", base / "prometheus.log")
        stdout, _ = up.communicate(timeout=480)
        summary = json.loads(stdout)
        summary["_rc"] = up.returncode
        summary["_stderr"] = (base / "up.err").read_text()
        summary["_workdir"] = workdir
        yield summary, server
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if server is not None:
            server.stop()


def test_the_run_itself_went_as_injected(monitored_run):
    summary, _ = monitored_run
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["state"], summary["steps"]) == ("SUCCEEDED", 60)
    assert summary["leader_changes"] == 1 and summary["restarts"] == 1
    # The crash, then the straggler replaced (rank 1 stays slow wherever it runs: it
    # may be flagged and moved again before the end).
    kinds = [e["kind"] for e in summary["events"]]
    assert summary["generations"] >= 3 and "replaced" in kinds, kinds


def test_prometheus_holds_the_step_the_goodput_and_the_restarts_by_cause(monitored_run):
    _, prometheus = monitored_run
    window = "30m"
    # keel up lingered after the end: Prometheus scraped the job's last step and its end.
    step = prometheus.value(f'max(max_over_time(keel_job_step{{job_name="{JOB}"}}[{window}]))')
    assert step == 60, step
    succeeded = prometheus.value(
        f'max(max_over_time(keel_job_state{{job_name="{JOB}",state="SUCCEEDED"}}[{window}]))'
    )
    assert succeeded == 1, succeeded
    ratio = prometheus.value(
        f'max(last_over_time(keel_goodput_ratio{{job_name="{JOB}"}}[{window}]))'
    )
    assert ratio is not None and 0 < ratio < 1
    for cause in ("crash", "straggler"):
        counted = prometheus.value(
            f"max(max_over_time(keel_job_restarts_total"
            f'{{job_name="{JOB}",cause="{cause}"}}[{window}]))'
        )
        assert counted is not None and counted >= 1, cause
    # Counted by cause from the job's start: the causes that did not happen are 0.
    assert (
        prometheus.value(
            f"max(max_over_time(keel_job_restarts_total"
            f'{{job_name="{JOB}",cause="hang"}}[{window}]))'
        )
        == 0
    )


def test_every_metric_the_dashboard_and_the_rules_name_is_exported(monitored_run):
    _, prometheus = monitored_run
    recorded = {
        name for name, _ in rule_exprs(RULES) if ":" in name
    }  # recording rules are named level:metric:operations
    names = set()
    for expr in dashboard_exprs(DASHBOARD) + [expr for _, expr in rule_exprs(RULES)]:
        names |= metric_names(expr)
    names -= recorded | NOT_ON_CPU | NOT_ACROSS_NODES | {"up"}
    assert len(names) > 40, sorted(names)
    missing = [
        name
        for name in sorted(names)
        if not prometheus.query(f'count(last_over_time({{__name__="{name}"}}[30m]))')
    ]
    assert not missing, f"named in deploy/ but never exported: {missing}"
    # Keel's rules evaluated on the run's data without an error.
    groups = prometheus.api("rules")["groups"]
    broken = [
        (r["name"], r.get("lastError"))
        for g in groups
        for r in g["rules"]
        if r["health"] not in ("ok", "unknown")
    ]
    assert groups and not broken, broken


def test_no_series_is_labelled_by_step_pid_or_generation(monitored_run):
    _, prometheus = monitored_run
    # Keel's series (the Python client's own GC series count by GC generation, 0-2).
    labels = set(prometheus.api("labels", **{"match[]": '{__name__=~"keel_.+"}'}))
    assert {"job_name", "node", "cause", "phase"} <= labels, labels
    assert not labels & {"step", "pid", "generation", "rank_pid"}, labels


def test_the_new_leader_exports_the_job_at_its_first_scrape(monitored_run):
    summary, prometheus = monitored_run
    targets = json.loads((summary["_workdir"] / "prometheus" / "targets.json").read_text())
    (controllers,) = [
        group["targets"] for group in targets if group["labels"]["keel_kind"] == "controller"
    ]
    assert len(controllers) == 2, targets
    leading = {}
    for address in controllers:
        samples = prometheus.samples(f'keel_controller_leader{{instance="{address}"}}')
        leading[address] = sorted(t for t, v in samples.items() if v == 1)
    old, new = sorted(controllers, key=lambda a: leading[a][0] if leading[a] else 1e18)
    assert leading[old] and leading[new], leading
    first = leading[new][0]
    step = prometheus.samples(f'keel_job_step{{instance="{new}",job_name="{JOB}"}}')
    # One series a state, 1 for the job's: which one the first scrape sees is a race
    # (the slow rank injected from step 22 can be flagged and replaced by the new leader
    # within a second of its takeover), that there is exactly one is not.
    states = {}
    for name in (state.value for state in JobState):
        samples = prometheus.samples(
            f'keel_job_state{{instance="{new}",job_name="{JOB}",state="{name}"}}'
        )
        states[name] = samples.get(first)
    # In the very scrape where it first says it leads, the job's state and step are
    # there: the step etcd knows (stored at the last transition, the step the crash's
    # restart restored, or the newest checkpoint's if later), and by the next scrape the
    # step the ranks are at (rank 0 had passed step 20 when the old leader died).
    assert first in step and None not in states.values(), (first, sorted(step)[:3], states)
    assert sum(states.values()) == 1 and step[first] >= 5, (states, sorted(step.items())[:4])
    following = min(t for t in step if t > first)
    assert step[following] >= 20, sorted(step.items())[:4]
    # While it stood by, it exported no job series at all.
    assert min(step) >= first


def test_goodput_adds_up_to_the_wall_time_and_blames_the_crash_and_the_straggler(monitored_run):
    summary, prometheus = monitored_run
    goodput = summary["goodput"]
    seconds, wall = goodput["seconds"], goodput["wall_s"]
    assert wall > 0 and goodput["at_risk_s"] == 0
    assert abs(sum(seconds.values()) - wall) <= 0.01 * wall, goodput
    assert goodput["ratio"] == pytest.approx(seconds["productive"] / wall, abs=1e-3)
    # The crash's downtime is a restart; the steps after the checkpoint it restored
    # from were done again; the slow rank held its peers back.
    assert seconds["restart"] > 0 and seconds["recompute"] > 0, goodput
    assert seconds["recompute"] < seconds["restart"], goodput
    assert seconds["straggler"] > 0 and seconds["startup"] > 0, goodput
    # The controller's own record of the job's life, apart from the accounting: the
    # parts add up to it; and it lies within what keel up saw of the job.
    life = goodput["ended_at"] - goodput["submitted_at"]
    assert abs(sum(seconds.values()) - life) <= 0.01 * life, (life, goodput)
    assert life <= summary["wall_s"]
