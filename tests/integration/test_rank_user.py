"""Ranks under their own user (``keel agent --rank-user``), with a real etcd, a real
mutual-TLS controller and real agents: a job that tries to read the agent's
credentials, the cluster's TLS directory, an etcd password file and its agent's
environment is refused each, and still runs as any job does.

Needs root (the agent starts ranks as another user). The rank user is a fixed system
user, ``keel-rank-test``, created here if missing and left in place (no home, no
shell), so that repeated runs do not each add and remove one.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from common.etcd import connect
from common.permissions import SEARCH, first_barrier
from common.tls import call_metadata
from orchestrator.controller.store import Store
from orchestrator.security import certs
from protos import keel_pb2, keel_pb2_grpc
from tests.conftest import REPO, wait_for
from tests.integration.conftest import spawn, stop

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="starting ranks as another user needs root"
)

RANK_USER = "keel-rank-test"
SCRIPT = REPO / "tests" / "integration" / "scripts" / "reads_agent_secrets.py"


def rank_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(RANK_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", RANK_USER],
            check=True,
        )
        return pwd.getpwnam(RANK_USER)


def passable(path: Path) -> None:
    """Let anyone pass (not list) ``path`` and the directories above it: pytest makes
    its temporary directories root's alone, and the rank user must reach its run
    directory inside one."""
    for step in [path, *path.parents]:
        mode = step.stat().st_mode & 0o777
        if mode & 0o001 == 0:
            os.chmod(step, mode | 0o011)


def interpreter_view(user: pwd.struct_passwd, staging: Path) -> tuple[str, ...]:
    """A prefix that runs the agent where the rank user can run this Python: () if it
    can here; else a mount namespace of the agent's own in which the directory that
    stops it (this machine's /root, 0700, holds the interpreter of the venv) is a
    passable one holding only the way to the interpreter."""
    interpreter = Path(os.path.realpath(sys.executable))
    if first_barrier(interpreter, user.pw_uid, frozenset({user.pw_gid}), SEARCH) is None:
        return ()
    closed = next(
        d
        for d in reversed(interpreter.parents)
        if first_barrier(d, user.pw_uid, frozenset({user.pw_gid}), SEARCH) is not None
    )
    kept = closed / interpreter.relative_to(closed).parts[0]
    staging.mkdir()
    return (
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount --bind "$1" "$0" && mount -t tmpfs -o mode=0711 tmpfs "$2" && mkdir "$1" '
        '&& mount --move "$0" "$1" && shift 2 && exec "$@"',
        str(staging),
        str(kept),
        str(closed),
    )


def test_a_rank_reads_none_of_its_agents_secrets_and_runs_as_usual(etcd, no_leaks):
    user = rank_user()
    tmp = no_leaks
    passable(tmp)
    tls = tmp / "tls"
    certs.init(tls, agents=("node-a", "node-b"))
    # An env file of the kind systemd's EnvironmentFile reads, with etcd's password.
    env_file = tmp / "agent.env"
    env_file.write_text("KEEL_ETCD_PASSWORD=etcd-s3cret\n")
    os.chmod(env_file, 0o600)
    findings = tmp / "findings"
    findings.mkdir()
    os.chown(findings, user.pw_uid, user.pw_gid)
    view = interpreter_view(user, tmp / "interpreter")
    started = []
    try:
        controller = spawn(
            [
                *("-m", "orchestrator.cli", "controller", "--etcd-endpoints", etcd.endpoint),
                *("--tls-dir", str(tls), "--address-file", str(tmp / "address")),
            ],
            tmp / "controller.log",
        )
        started.append(controller)
        wait_for(lambda: (tmp / "address").exists(), 30, what="the controller's address")

        def agent(node, *extra):
            proc = spawn(
                [
                    *("-m", "agent", "--node", node, "--slots", "2"),
                    *("--etcd-endpoints", etcd.endpoint, "--tls-dir", str(tls)),
                    *("--run-dir", str(tmp / node), "--lease-ttl-s", "2"),
                    *("--rank-user", RANK_USER, "--warm-refill-delay-s", "0", *extra),
                ],
                tmp / f"{node}.log",
                prefix=view,
                # A secret in the agent's environment, as systemd's env file leaves it.
                env={"KEEL_ETCD_PASSWORD_TEST": "etcd-s3cret"},
            )
            started.append(proc)
            return proc

        # A token file the rank user could read: the agent will not start on it.
        open_token = tmp / "open.token"
        open_token.write_text((tls / "join.token").read_text())
        os.chmod(open_token, 0o644)
        refused = agent("node-b", "--token-file", str(open_token))
        assert refused.wait(30) != 0
        log = (tmp / "node-b.log").read_text()
        assert f"the rank user {RANK_USER} can read {open_token}; make it the agent's alone" in (
            log
        ), log

        agent("node-a")
        store = Store(connect([etcd.endpoint], 5))
        wait_for(lambda: "node-a" in store.nodes(), 30, what="node-a to register")
        secrets = [
            tls / "ca.key",
            tls / "operator.key",
            tls / "operator.token",
            tls / "join.token",
            tls / "agent-node-a.key",
            env_file,
        ]
        spec = keel_pb2.JobSpec(
            name="secrets",
            world_size=2,
            command=[sys.executable, "-u", str(SCRIPT), str(findings), "3", *map(str, secrets)],
            working_dir=str(REPO),
            env={"PYTHONPATH": str(REPO), "FAIL_FIRST": "1"},
            max_restarts=1,
        )
        channel_credentials = grpc.ssl_channel_credentials(
            root_certificates=(tls / "ca.pem").read_bytes(),
            private_key=(tls / "operator.key").read_bytes(),
            certificate_chain=(tls / "operator.pem").read_bytes(),
        )
        address = (tmp / "address").read_text().strip()
        with grpc.secure_channel(address, channel_credentials) as channel:
            keel_pb2_grpc.ControllerStub(channel).SubmitJob(
                keel_pb2.SubmitJobRequest(spec=spec),
                metadata=call_metadata((tls / "operator.token").read_text().strip()),
                timeout=10,
            )

        def state():
            versioned = store.job_state("secrets")
            return versioned.value if versioned else None

        wait_for(
            lambda: state() and state().state in ("SUCCEEDED", "FAILED"), 120, 0.2, what="the job"
        )
        final = state()
        assert final.state == "SUCCEEDED", (final, (tmp / "node-a.log").read_text()[-4000:])
        # Its steps reached the agent, and through it the controller.
        assert (final.step, final.generation) == (3, 2), final
        # Generation 2 restarted from warm processes, which ran as the rank user too.
        starts = [
            json.loads(line)
            for line in (tmp / "node-a.log").read_text().splitlines()
            if '"rank started"' in line
        ]
        assert [(e["generation"], e["warm"]) for e in starts] == [
            (1, False),
            (1, False),
            (2, True),
            (2, True),
        ], starts
        for rank, generation in ((0, 1), (1, 1), (0, 2), (1, 2)):
            found = json.loads((findings / f"rank{rank}-g{generation}.json").read_text())
            assert (found["uid"], found["gid"], found["groups"]) == (
                user.pw_uid,
                user.pw_gid,
                [],
            ), found
            reads = found["reads"]
            assert {Path(p).name: why for p, why in reads.items()} == {
                **{path.name: "PermissionError" for path in secrets},
                "environ": "PermissionError",
            }, reads
            # Its rank directory and output are its own.
            gen = tmp / "node-a" / "secrets" / f"gen{generation}"
            for path in (gen, gen / f"rank{rank}.out", gen / f"rank{rank}.err"):
                assert (path.stat().st_uid, path.stat().st_gid) == (user.pw_uid, user.pw_gid)
        assert (tmp / "node-a" / "pool").stat().st_uid == user.pw_uid
        # The run directory is passable but not listable, the socket the ranks' group's.
        assert (tmp / "node-a").stat().st_mode & 0o777 == 0o711
    finally:
        for proc in reversed(started):
            stop(proc)


def test_keel_up_with_tls_runs_its_ranks_as_the_rank_user(no_leaks):
    """The measured case: a job of ``keel up --tls`` that opens the files it finds in
    the cluster's TLS directory; with --rank-user, it reads none of them."""
    user = rank_user()
    tmp = no_leaks
    passable(tmp)
    workdir = tmp / "run"
    findings = tmp / "findings"
    findings.mkdir()
    os.chown(findings, user.pw_uid, user.pw_gid)
    tls = workdir / "tls"
    secrets = [
        tls / name
        for name in (
            "ca.key",
            "controller.key",
            "agent.key",
            "operator.key",
            "operator.token",
            "join.token",
            "reader.token",
        )
    ]
    view = interpreter_view(user, tmp / "interpreter")
    result = subprocess.run(
        [
            *view,
            *(sys.executable, "-m", "orchestrator.cli", "up", "--json", "--tls"),
            *("--workdir", str(workdir), "--timeout-s", "120", "--no-preflight"),
            *("--nodes", "1", "--slots-per-node", "2", "--rank-user", RANK_USER),
            *("--script", str(SCRIPT), "--", str(findings), "3", *map(str, secrets)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    assert (summary["state"], summary["steps"]) == ("SUCCEEDED", 3), summary
    assert "ranks run as" not in result.stderr  # the line said without a rank user
    for rank in (0, 1):
        found = json.loads((findings / f"rank{rank}-g1.json").read_text())
        assert (found["uid"], found["groups"]) == (user.pw_uid, []), found
        assert set(found["reads"].values()) == {"PermissionError"}, found["reads"]
        assert len(found["reads"]) == len(secrets) + 1
    assert (workdir / "checkpoints").stat().st_uid == user.pw_uid
    for private in (tls, workdir / "logs"):
        assert private.stat().st_mode & 0o077 == 0, private


def test_the_reference_trainer_checkpoints_and_restarts_in_place_as_the_rank_user(no_leaks):
    """keel up --rank-user with the reference trainer and a crash: the ranks write
    their checkpoints as the rank user, and the survivor of the crash restarts in place
    (parked, then given its rank of the next generation and that generation's output
    files) as the rank user."""
    user = rank_user()
    tmp = no_leaks
    passable(tmp)
    workdir = tmp / "run"
    view = interpreter_view(user, tmp / "interpreter")
    result = subprocess.run(
        [
            *view,
            *(sys.executable, "-m", "orchestrator.cli", "up", "--json", "--no-preflight"),
            *("--workdir", str(workdir), "--timeout-s", "200", "--rank-user", RANK_USER),
            *("--nodes", "1", "--slots-per-node", "2", "--steps", "10"),
            *("--checkpoint-every", "3", "--inject", "crash:rank=1,step=6"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=320,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    assert (summary["state"], summary["steps"], summary["restarts"]) == ("SUCCEEDED", 10, 1), (
        summary
    )
    starts = {}
    for line in (workdir / "logs" / "agent-node-0.log").read_text().splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("event") == "rank started":
            starts[(record["generation"], record["rank"])] = record
    assert starts[(2, 0)]["in_place"] and starts[(2, 0)]["pid"] == starts[(1, 0)]["pid"], starts
    gen2 = workdir / "nodes" / "node-0" / "keel-up" / "gen2"
    for path in (gen2, gen2 / "rank0.out", gen2 / "rank0.err"):
        assert path.stat().st_uid == user.pw_uid, path
    assert "step" in (gen2 / "rank0.err").read_text()  # the parked process wrote there
    written = [p for p in (workdir / "checkpoints").rglob("*") if p.is_file()]
    assert written and {p.stat().st_uid for p in written} == {user.pw_uid}
