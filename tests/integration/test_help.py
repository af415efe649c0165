"""Every entry point answers --help with exit 0 and lists what it takes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, keel

VERBS = (
    "up",
    "run",
    "logs",
    "plan",
    "controller",
    "agent",
    "status",
    "nodes",
    "jobs",
    "events",
    "cordon",
    "uncordon",
    "drain",
    "replace",
    "checkpoint",
    "submit",
    "stop",
    "delete",
    "restore-epoch",
    "certs",
    "etcd",
)


def test_keel_lists_every_verb():
    result = keel("--help", timeout_s=60)
    assert result.returncode == 0, result.stderr
    listed = {
        line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines() if line.strip()
    }
    assert listed == set(VERBS)


@pytest.mark.parametrize(
    "verb, flags",
    [
        (
            "up",
            (
                "--hang-floor-s",
                "--collective-timeout-s",
                "--inject",
                "--controllers",
                "--spares",
                "--tls",
                "--rank-user",
            ),
        ),
        ("controller", ("--node-lost-grace-s", "--finished-job-ttl-s", "--tls-dir", "--etcd-ca")),
        (
            "agent",
            ("--lease-ttl-s", "--stop-grace-s", "--tls-dir", "--etcd-password", "--rank-user"),
        ),
        ("drain", ("--wait", "--controller", "--etcd-endpoints")),
        (
            "run",
            (
                "--nnodes",
                "--nproc-per-node",
                "--nproc_per_node",
                "--max-restarts",
                "--module",
                "--no-python",
                "--etcd-endpoints",
                "--env",
            ),
        ),
        ("logs", ("--rank", "--generation", "--follow")),
        ("restore-epoch", ("--etcd-endpoints", "--epoch", "--etcd-ca", "--etcd-password")),
        ("etcd", ("setup",)),
    ],
)
def test_each_verb_documents_its_flags(verb, flags):
    result = keel(verb, "--help", timeout_s=60)
    assert result.returncode == 0, result.stderr
    for flag in flags:
        assert flag in result.stdout, f"keel {verb} --help lacks {flag}"


def test_keel_etcd_setup_documents_its_flags():
    result = keel("etcd", "setup", "--help", timeout_s=60)
    assert result.returncode == 0, result.stderr
    for flag in ("--etcd-endpoints", "--agent", "--etcd-cert", "root.pem"):
        assert flag in result.stdout, f"keel etcd setup --help lacks {flag}"
    result = keel("certs", "add", "--help", timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert "--agent" in result.stdout and "keel etcd setup" in result.stdout


def test_the_reference_trainer_answers_help_and_names_its_deadlines():
    result = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for text in ("--collective-timeout-s", "$KEEL_COLLECTIVE_TIMEOUT_S", "--startup-timeout-s"):
        assert text in result.stdout
