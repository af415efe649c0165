"""What ``keel up`` gives Prometheus: every daemon's metrics address as ``file_sd``
targets (``WORKDIR/prometheus/targets.json``, one target group per daemon kind), and a
``prometheus.yml`` that scrapes them, with Keel's alert and recording rules, so that

    prometheus --config.file WORKDIR/prometheus/prometheus.yml

watches the local cluster with no editing. Prometheus rereads the targets file when it
changes (an agent restarted on a new port), so the cluster rewrites it then."""

from __future__ import annotations

import json
from pathlib import Path

from common.paths import write_atomically
from common.tls import TlsFiles

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yml"
SCRAPE_INTERVAL_S = 2


def targets(controllers: list[str], agents: list[str]) -> list[dict]:
    """The ``file_sd`` target groups: label ``keel_kind`` says the daemon kind."""
    return [
        {"targets": sorted(addresses), "labels": {"keel_kind": kind}}
        for kind, addresses in (("controller", controllers), ("agent", agents))
        if addresses
    ]


def write_targets(directory: Path, controllers: list[str], agents: list[str]) -> bool:
    """Write ``targets.json`` if what it holds changed; whether it did."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "targets.json"
    text = json.dumps(targets(controllers, agents), indent=2) + "\n"
    if path.exists() and path.read_text() == text:
        return False
    write_atomically(path, text)
    return True


def config(targets_file: Path, tls: TlsFiles | None, rules: Path | None = RULES) -> str:
    """A ``prometheus.yml`` scraping the daemons listed in ``targets_file``; over HTTPS
    presenting ``tls`` (a client certificate of the cluster's CA) when given. JSON is
    YAML, and needs no YAML library here."""
    scrape: dict = {
        "job_name": "keel",
        "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
        "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}],
    }
    if tls is not None:
        scrape["scheme"] = "https"
        scrape["tls_config"] = {
            "ca_file": str(tls.ca),
            "cert_file": str(tls.cert),
            "key_file": str(tls.key),
        }
    document: dict = {
        "global": {
            "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
            "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        },
        "scrape_configs": [scrape],
    }
    if rules is not None and rules.is_file():
        document["rule_files"] = [str(rules)]
    return json.dumps(document, indent=2) + "\n"


def write_config(directory: Path, tls: TlsFiles | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "prometheus.yml"
    write_atomically(path, config(directory / "targets.json", tls))
    return path
