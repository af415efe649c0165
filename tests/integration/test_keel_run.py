"""`keel run`, torchrun's command line on Keel, and `keel logs`: unmodified torchrun
scripts on a local cluster and on a running one, with real etcd, controller, agents
and torch.distributed ranks."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import REPO, keel, torchrun, wait_for

SCRIPTS = REPO / "tests" / "integration" / "scripts"


def rank_starts(*logs: Path) -> list[dict]:
    """Every "rank started" record in the agents' ``logs``."""
    return [
        json.loads(line)
        for path in logs
        for line in path.read_text().splitlines()
        if '"rank started"' in line
    ]


def test_keel_run_gives_a_script_the_environment_torchrun_gives_it(no_leaks):
    """Each rank sees the variables torchrun sets (GROUP_RANK, ROLE_*,
    TORCHELASTIC_MAX_RESTARTS and the rest) with torchrun's values, save the launch's
    own ports, ids and error file."""
    under_torchrun, under_keel = no_leaks / "torchrun", no_leaks / "keel"
    under_torchrun.mkdir()
    under_keel.mkdir()
    ran = torchrun(2, str(SCRIPTS / "dump_env.py"), str(under_torchrun))
    assert ran.returncode == 0, ran.stderr[-3000:]
    ran = keel(
        "run",
        "--workdir",
        str(no_leaks / "run"),
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "dump_env.py"),
        str(under_keel),
        timeout_s=180,
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    # Where they differ, they must: ports and ids are the launch's own, the error file is
    # per launch, and under Keel rank 0 hosts the store where torchrun's agent would.
    own = {
        "MASTER_PORT",
        "MASTER_ADDR",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE",
        "TORCHELASTIC_USE_AGENT_STORE",
    }
    for rank in (0, 1):
        theirs = json.loads((under_torchrun / f"env-{rank}.json").read_text())
        ours = json.loads((under_keel / f"env-{rank}.json").read_text())
        assert sorted(ours) == sorted(theirs), sorted(set(theirs) ^ set(ours))
        assert {k: v for k, v in ours.items() if k not in own} == {
            k: v for k, v in theirs.items() if k not in own
        }
        assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_a_script_whose_first_step_outlasts_every_timeout_runs_to_its_end(no_leaks):
    """A plain torchrun script is not held to the agent's first-step timeout, so no node
    of a healthy job is excluded for it: only a rank that said it reports steps
    (trainer.runtime attaches) is."""
    markers = no_leaks / "markers"
    markers.mkdir()
    ran = keel(
        "run",
        "--workdir",
        str(no_leaks / "run"),
        "--nnodes",
        "2",
        "--hang-floor-s",
        "2",
        "--first-step-timeout-s",
        "3",
        str(SCRIPTS / "slow_first_step.py"),
        str(markers),
        "5",
        timeout_s=180,
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert "succeeded in 1 generation(s), 0 restart(s)" in ran.stderr
    assert "event:" not in ran.stderr, ran.stderr
    assert [(markers / f"done-{r}").read_text() for r in (0, 1)] == ["world=2\n"] * 2


def test_a_script_that_fails_once_resumes_from_its_own_snapshot(no_leaks):
    """Two nodes of one rank each; rank 1 dies at the start of epoch 3. The restarted
    ranks resume from the script's own snapshot of epoch 2 and end with the weights of
    an uninterrupted torchrun run of the same script."""
    reference, out = no_leaks / "reference", no_leaks / "out"
    reference.mkdir()
    out.mkdir()
    ran = torchrun(2, str(SCRIPTS / "snapshot_trainer.py"), str(reference), "6", "-1")
    if ran.returncode != 0 and "terminate called without an active exception" in ran.stderr:
        # The reference, plain torchrun with nothing of Keel's, once had a rank abort in
        # gloo's own threads (std::terminate) on CI: the baseline is run again, once.
        for stale in reference.iterdir():
            stale.unlink()
        ran = torchrun(2, str(SCRIPTS / "snapshot_trainer.py"), str(reference), "6", "-1")
    assert ran.returncode == 0, ran.stderr[-3000:]
    ran = keel(
        "run",
        "--workdir",
        str(no_leaks / "run"),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "1",
        str(SCRIPTS / "snapshot_trainer.py"),
        str(out),
        "6",
        "3",
        timeout_s=180,
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert "succeeded in 2 generation(s), 1 restart(s)" in ran.stderr
    for rank in (0, 1):
        assert (out / f"epochs-{rank}").read_text().splitlines() == [
            f"restart 0 epoch {e}" for e in range(3)
        ] + [f"restart 1 epoch {e}" for e in range(3, 6)]
    final, expected = torch.load(out / "final.pt"), torch.load(reference / "final.pt")
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final)
    # Every rank's output, on this terminal, as torchrun prints it with --tee.
    assert "[rank0]:epoch 0 loss" in ran.stdout and "[rank1]:epoch 5 loss" in ran.stdout
    assert "[rank0]:resuming from snapshot at epoch 3" in ran.stdout
    assert "[rank1]:rank 1 failing on purpose at epoch 3" in ran.stderr
    assert "generation 1 failed: rank 1 on node-1 exited 7" in ran.stderr


def test_keel_run_on_a_running_cluster_and_keel_logs_from_the_node(cluster, etcd):
    """--etcd-endpoints: the job is submitted to the cluster there and followed; each
    node runs --nproc-per-node ranks even where it has more slots; `keel logs` reads a
    rank's output from whichever node ran it."""
    cluster.controller()
    # Warm processes are refilled at once after ranks start (not 10 s later), so the
    # restarted generation starts from them.
    for node in ("node-a", "node-b"):
        cluster.agent(node, slots="2", extra=("--warm-refill-delay-s", "0"))
    wait_for(lambda: len(cluster.store.nodes()) == 2, 30, what="both agents")
    markers = cluster.path / "markers"
    markers.mkdir()
    reach = ["--etcd-endpoints", etcd.endpoint, "--token-file", str(cluster.path / "token")]
    ran = keel(
        "run",
        *reach,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "1",
        "--rdzv-id",
        "plain",
        str(SCRIPTS / "plain_allreduce.py"),
        str(markers),
        "3",
        timeout_s=180,
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert [(markers / f"done-{r}").read_text() for r in (0, 1)] == ["restart=1 world=2\n"] * 2
    # One rank per node: rank 0 on node-a, rank 1 on node-b, in both generations.
    for generation in (1, 2):
        assert (cluster.path / "node-a" / "plain" / f"gen{generation}" / "rank0.out").exists()
        assert (cluster.path / "node-b" / "plain" / f"gen{generation}" / "rank1.out").exists()
        assert not (cluster.path / "node-a" / "plain" / f"gen{generation}" / "rank1.out").exists()
    assert "[rank1]:rank 1 failing on purpose" in ran.stderr

    logs = keel("logs", "plain", "--rank", "1", "--generation", "1", *reach)
    assert logs.returncode == 0, logs.stderr
    assert logs.stderr.strip() == "rank 1 failing on purpose"
    (cluster.path / "node-b" / "plain" / "gen2" / "rank1.out").write_text("line one\nline two\n")
    logs = keel("logs", "plain", "--rank", "1", "-f", *reach)  # the job ended: -f returns
    assert logs.returncode == 0 and logs.stdout == "line one\nline two\n", logs.stderr
    for args, message in [
        (["--rank", "5"], "generation 2 of job plain has no rank 5 (ranks 0-1)"),
        (["--generation", "9"], "generation 9 of job plain has not started"),
        (["--job-typo"], "No such option"),
    ]:
        logs = keel("logs", "plain", *args, *reach)
        assert logs.returncode != 0 and message in logs.stderr, logs.stderr

    # A failing program: keel run exits 1 and says why; the job then can be deleted.
    ran = keel("run", *reach, "--rdzv-id", "fails", "--no-python", "false")
    assert ran.returncode == 1, ran.stderr
    assert "job fails failed: FAILED" in ran.stderr and "exited 1" in ran.stderr
    # A program, not a Python script: no warm process can become it; it started cold.
    starts = rank_starts(cluster.path / "node-a.log", cluster.path / "node-b.log")
    assert [s["warm"] for s in starts if s["job"] == "fails"] == [False]
    # The first generation started cold (no rank had started before), the restarted one
    # in processes that had imported torch, and the script saw no difference.
    assert sorted(
        (s["generation"], s["rank"], s["warm"]) for s in starts if s["job"] == "plain"
    ) == [(1, 0, False), (1, 1, False), (2, 0, True), (2, 1, True)], starts
    deleted = keel("delete", "fails", *reach)
    assert deleted.returncode == 0 and "job fails deleted" in deleted.stdout, deleted.stderr
    assert "fails" not in keel("jobs", "--json", *reach).stdout

    # torchrun's per-node rendezvous flags have no place here: refused, saying why.
    refused = keel("run", *reach, "--node-rank", "1", str(SCRIPTS / "plain_allreduce.py"))
    assert refused.returncode == 2 and "run it once, without them" in refused.stderr
