"""What the integration tests of the control plane share: a real controller and real
agents on a test's own etcd (the ``cluster`` fixture), and how they start and stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from common.etcd import connect
from orchestrator.controller.store import Store
from tests.conftest import keel, wait_for

TOKEN = "s3cret-token"
# A rank that does nothing for an hour once it said its pid (``Cluster.sleepers``).
SLEEPER = """\
import os, pathlib, sys, time
pathlib.Path(sys.argv[1], os.environ["RANK"]).write_text(str(os.getpid()))
time.sleep(3600)
"""
# The reference trainer at its smallest (a model that trains in milliseconds a step on
# gloo), for tests about what Keel does around it; add --steps, --checkpoint-every.
TINY_TRAINER = (
    sys.executable,
    "-u",
    "-m",
    "trainer.train",
    "--dim=32",
    "--layers=1",
    "--heads=2",
    "--vocab=64",
    "--seq-len=16",
    "--global-batch=4",
)


def spawn(args, log_path, env=None, prefix=()):
    """Start ``python ARGS`` (behind ``prefix``, a command that execs the rest)."""
    # The child keeps its own copy of the log's descriptor; ours is closed at once.
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [*prefix, sys.executable, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=None if env is None else {**os.environ, **env},
        )


def stop(proc, grace_s=10):
    """Stop a daemon now: SIGINT (SIGTERM would have an agent drain its node first)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def cluster(etcd, no_leaks):
    tmp = no_leaks
    (tmp / "token").write_text(TOKEN)
    started = []

    def controller(
        launcher=("-m", "orchestrator.cli", "controller"), env=None, name="controller", lead=True
    ):
        """Start a controller (``launcher``: what runs it, before its options; it logs
        to NAME.log) and, with ``lead``, wait for it to lead; returns its address."""
        address_file = tmp / ("address" if name == "controller" else f"{name}.address")
        address_file.unlink(missing_ok=True)
        proc = spawn(
            [
                *launcher,
                "--etcd-endpoints",
                ",".join(etcd.endpoints),
                "--token-file",
                str(tmp / "token"),
                "--address-file",
                str(address_file),
            ],
            tmp / f"{name}.log",
            env,
        )
        started.append(proc)
        Cluster.controllers.append(proc)
        wait_for(
            lambda: address_file.exists() or proc.poll() is not None, 30, what="controller address"
        )
        assert proc.poll() is None, (tmp / f"{name}.log").read_text()
        address = address_file.read_text().strip()
        if lead:
            wait_for(
                lambda: Cluster.store.controller_address() == address,
                30,
                what="the controller to lead",
            )
        return address

    def agent(node, token_file="token", ttl="2", slots="2", extra=(), prefix=()):
        """Start an agent for ``node`` (behind ``prefix``: a command that sets up its
        host, say a mount namespace, then execs it)."""
        proc = spawn(
            [
                "-m",
                "agent",
                "--node",
                node,
                "--slots",
                slots,
                "--etcd-endpoints",
                ",".join(etcd.endpoints),
                "--token-file",
                str(tmp / token_file),
                "--run-dir",
                str(tmp / node),
                "--lease-ttl-s",
                ttl,
                *extra,
            ],
            tmp / f"{node}.log",
            prefix=prefix,
        )
        started.append(proc)
        return proc

    class Cluster:
        store = Store(connect(etcd.endpoints, 5))
        path = tmp
        controllers: list[subprocess.Popen] = []

    def sleepers(name, world_size, spec_lines=""):
        """Submit job ``name`` of ``world_size`` ranks that each write their pid to
        ``PATH/pids/<rank>`` and sleep, and wait for them all to run; (that folder, its
        rank → pid). ``spec_lines``: more of the spec's top-level lines."""
        script, pids = tmp / "sleeper.py", tmp / "pids"
        script.write_text(SLEEPER)
        pids.mkdir()
        spec = tmp / f"{name}.toml"
        spec.write_text(
            f'name = "{name}"\nworld_size = {world_size}\n{spec_lines}'
            f'command = ["{sys.executable}", "{script}", "{pids}"]\n'
            f"[health]\npreflight_off = true\n"
        )
        common = ["--etcd-endpoints", ",".join(etcd.endpoints), "--token-file", str(tmp / "token")]
        submitted = keel("submit", str(spec), *common)
        assert submitted.returncode == 0, submitted.stderr
        wait_for(
            lambda: len(list(pids.iterdir())) == world_size, 60, 0.2, what="every rank running"
        )
        return pids, {p.name: int(p.read_text()) for p in pids.iterdir()}

    Cluster.controller, Cluster.agent = staticmethod(controller), staticmethod(agent)
    Cluster.sleepers = staticmethod(sleepers)
    yield Cluster
    for proc in reversed(started):
        stop(proc)
