"""A rank that SIGKILL cannot end costs its node, not the job: a real filesystem that
stops answering (FUSE, ``hung_fs``) holds one rank in uninterruptible sleep; the
generation is stopped, that node never confirms, and past the stop deadline it is
counted lost and cordoned with the reason its agent found (real etcd, controller, three
agents and their rank processes). Root only: it mounts a filesystem."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from common.procs import process_state, process_wchan
from protos import keel_pb2
from tests.conftest import keel, wait_for
from tests.integration.hung_fs import HungFilesystem

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="mounting FUSE needs root"
    ),
]

# Rank 1 of generation 1 reads the hung file; every rank says where it runs.
RANK = """\
import os, pathlib, sys, time
marks, hung = pathlib.Path(sys.argv[1]), sys.argv[2]
generation, rank = os.environ["KEEL_GENERATION"], os.environ["RANK"]
mark = f"{os.environ['KEEL_NODE']} {os.getpid()}"
(marks / f"gen{generation}-rank{rank}").write_text(mark)
if (generation, rank) == ("1", "1"):
    with open(hung, "rb", buffering=0) as stuck:
        (marks / "reading").write_text(mark)
        stuck.read(1)  # never returns: the filesystem stopped answering
time.sleep(600)
"""
NODES = ("node-a", "node-b", "node-c")


def test_a_rank_stuck_in_a_hung_filesystem_costs_its_node_and_the_job_goes_on(cluster, etcd):
    marks = cluster.path / "marks"
    marks.mkdir()
    with HungFilesystem(cluster.path / "hung-mount") as fs:
        cluster.controller()
        for node in NODES:
            cluster.agent(node, slots="1", extra=("--no-warm-processes",))
        wait_for(lambda: set(NODES) <= set(cluster.store.nodes()), 30, what="three agents")
        script, spec = cluster.path / "rank.py", cluster.path / "stuck.toml"
        script.write_text(RANK)
        spec.write_text(
            f'name = "stuck"\nworld_size = 2\nmax_restarts = 3\n'
            f'command = ["{sys.executable}", "{script}", "{marks}", "{fs.file}"]\n'
            f"[health]\npreflight_off = true\nstop_grace_s = 1\n"
        )
        submitted = keel(
            "submit",
            str(spec),
            "--etcd-endpoints",
            ",".join(etcd.endpoints),
            "--token-file",
            str(cluster.path / "token"),
        )
        assert submitted.returncode == 0, submitted.stderr
        wait_for(
            lambda: (
                (marks / "reading").exists() and fs.reads_taken and (marks / "gen1-rank0").exists()
            ),
            90,
            0.2,
            what="rank 1 blocked reading the hung filesystem",
        )
        hung_node, hung_pid = (marks / "reading").read_text().split()
        hung_pid = int(hung_pid)
        wait_for(lambda: process_wchan(hung_pid) == "request_wait_answer", 30, what="its read")
        # Rank 0 dies: the generation is stopped. Rank 1 gets SIGTERM, then SIGKILL,
        # and stays: its read waits in the kernel for an answer that never comes.
        other_node, rank0 = (marks / "gen1-rank0").read_text().split()
        os.kill(int(rank0), signal.SIGKILL)

        cordon = wait_for(
            lambda: cluster.store.cordons().get(hung_node), 90, 0.2, what="the stuck node cordoned"
        )
        assert f"pid {hung_pid} (rank 1) in uninterruptible sleep (wchan request_wait_answer)" in (
            cordon.reason
        ), cordon.reason
        assert cordon.by == "stop deadline" and not cordon.drain
        assert process_state(hung_pid) == "D"  # SIGKILLed long ago, and still there

        def generation_2_running():
            state = cluster.store.job_state("stuck").value
            return state.generation == 2 and state.state.value == "RUNNING"

        wait_for(generation_2_running, 90, 0.2, what="generation 2 running")
        wait_for(
            lambda: (marks / "gen2-rank0").exists() and (marks / "gen2-rank1").exists(),
            60,
            0.2,
            what="generation 2's ranks",
        )
        ran_on = {(marks / f"gen2-rank{r}").read_text().split()[0] for r in (0, 1)}
        assert ran_on == set(NODES) - {hung_node}, ran_on
        (timeout,) = [
            e.event
            for e in cluster.store.events("stuck")
            if e.event.kind == keel_pb2.EVENT_KIND_STOP_TIMEOUT
        ]
        assert timeout.node == hung_node and timeout.generation == 1
        assert "in uninterruptible sleep (wchan request_wait_answer)" in timeout.reason
        assert "counted lost for generation 1 past the 15 s stop deadline" in timeout.reason
        assert f"cordoned until `keel uncordon {hung_node}`" in timeout.reason
        agent_log = (cluster.path / f"{hung_node}.log").read_text()
        assert "rank did not exit after SIGKILL" in agent_log
        assert other_node != hung_node
    # The connection aborted, the read fails and the pending signal ends the rank.
    wait_for(lambda: process_state(hung_pid) in (None, "Z"), 30, what="the rank to die")
