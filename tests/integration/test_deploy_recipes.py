"""deploy/ recipes as their own tools read them: bash parses the sbatch script,
systemd-analyze verifies the units (every key known, every setting valid) and rates
their sandboxing, and kustomize renders the Kubernetes manifests into the namespace.
Each tool that is missing skips its test, saying what to install."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

SBATCH = REPO / "deploy" / "slurm" / "keel.sbatch"
SYSTEMD = REPO / "deploy" / "systemd"
KUBERNETES = REPO / "deploy" / "kubernetes"
INSTALLED_KEEL = "/opt/keel/bin/keel"
# systemd-analyze security's 0-10 exposure (lower is safer): at most "OK" for the
# controller, which needs nothing but the network; the agent keeps devices and W+X
# memory for its ranks, and may score a little higher.
EXPOSURE = {"controller": 4.0, "agent": 5.0}


def tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not found: install {package}")
    return found


def run(*command: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, check=False, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_bash_parses_the_sbatch_script():
    result = run("bash", "-n", str(SBATCH))
    assert result.returncode == 0, result.stderr


@pytest.fixture
def units(tmp_path) -> Path:
    """The units, with ExecStart's /opt/keel/bin/keel (absent here) replaced by this
    checkout's keel, so that verify checks that the command exists as it would on a
    machine with Keel installed."""
    keel = Path(sys.executable).with_name("keel")
    assert keel.is_file(), f"{keel}: install this checkout (pip install -e .)"
    for unit in SYSTEMD.glob("*.service"):
        text = unit.read_text()
        assert INSTALLED_KEEL in text, f"{unit.name}: ExecStart runs {INSTALLED_KEEL}"
        (tmp_path / unit.name).write_text(text.replace(INSTALLED_KEEL, str(keel)))
    return tmp_path


@pytest.mark.parametrize("name", ["controller", "agent"])
def test_systemd_analyze_verifies_the_unit(units, name):
    analyze = tool("systemd-analyze", "systemd")
    result = run(analyze, "verify", "--man=no", f"./keel-{name}.service", cwd=units)
    # verify exits 0 on an unknown key or a bad value, with a line on stderr for it:
    # any output is a finding.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        f"systemd-analyze verify keel-{name}.service:\n{result.stdout}{result.stderr}"
    )


@pytest.mark.parametrize("name", ["controller", "agent"])
def test_systemd_rates_the_unit_sandbox(units, name):
    analyze = tool("systemd-analyze", "systemd")
    result = run(
        analyze,
        "security",
        "--offline=yes",
        f"--threshold={EXPOSURE[name] * 10:.0f}",
        "--no-pager",
        f"./keel-{name}.service",
        cwd=units,
    )
    if "--offline" in result.stderr and "unrecognized" in result.stderr:
        pytest.skip("systemd-analyze security --offline needs systemd 250 or later")
    assert result.returncode == 0, (
        f"keel-{name}.service is more exposed than {EXPOSURE[name]}:\n{result.stdout[-3000:]}"
    )


def test_kustomize_renders_every_object_into_the_keel_namespace():
    kubectl = tool("kubectl", "kubectl (its kustomize is built in)")
    result = run(kubectl, "kustomize", str(KUBERNETES))
    assert result.returncode == 0, result.stderr
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    cluster_wide = {"Namespace"}
    for doc in objects:
        if doc["kind"] not in cluster_wide:
            assert doc["metadata"].get("namespace") == "keel", (
                f"{doc['kind']} {doc['metadata']['name']}"
            )
    images = {
        c["image"]
        for doc in objects
        if "template" in doc.get("spec", {})
        for c in [
            *doc["spec"]["template"]["spec"].get("initContainers", []),
            *doc["spec"]["template"]["spec"]["containers"],
        ]
    }
    assert "keel" not in images, "kustomization.yaml's images: must rename the keel image"
    assert len(objects) == sum(
        1
        for path in KUBERNETES.glob("*.yaml")
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    )
