"""Checkpoint lineage on a real controller, agents and trainer ranks: a directory
holding another job's checkpoints is never written, a job with checkpoints never starts
over from step 0, and a checkpoint one node cannot read is that node's problem."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from google.protobuf import json_format

from orchestrator.local.faults import parse_schedule
from tests.conftest import keel, wait_for
from tests.integration.conftest import TINY_TRAINER

TRAINER = list(TINY_TRAINER)


def spec_file(path: Path, name: str, checkpoints: Path, steps: int, **more) -> Path:
    """A spec of the reference trainer on one rank, checkpointing every 2 steps;
    ``faults``: --inject texts; ``max_restarts``, ``hang_floor_s``."""
    faults = more.pop("faults", ())
    command = [*TRAINER, "--steps", str(steps), "--checkpoint-every", "2"]
    env = {}
    if faults:
        schedule = parse_schedule(list(faults), world_size=1, nodes=3)
        env["KEEL_FAULTS"] = json_format.MessageToJson(schedule, indent=None)
    text = "\n".join(
        [
            f'name = "{name}"',
            "world_size = 1",
            f"max_restarts = {more.pop('max_restarts', 0)}",
            f"steps = {steps}",
            f'checkpoint_dir = "{checkpoints}"',
            f"command = {json.dumps(command)}",
            f"env = {{ {', '.join(f'{k} = {json.dumps(v)}' for k, v in env.items())} }}",
            "[health]",
            "preflight_off = true",
            f"hang_floor_s = {more.pop('hang_floor_s', 30)}",
            'straggler_policy = "alert"',
        ]
    )
    assert not more, more
    out = path / f"{name}.toml"
    out.write_text(text + "\n")
    return out


def digest(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (but the fence's lock) and its SHA-256."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def corrupt(checkpoint: Path) -> None:
    """Flip a byte in the middle of each shard file of ``checkpoint`` (sizes kept)."""
    for shard in checkpoint.glob("*.distcp"):
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))


class Cli:
    def __init__(self, cluster, etcd):
        self.common = [
            "--etcd-endpoints",
            etcd.endpoint,
            "--token-file",
            str(cluster.path / "token"),
        ]

    def __call__(self, *args, ok=True):
        result = keel(*args, *self.common, timeout_s=120)
        assert (result.returncode == 0) == ok, result.stderr + result.stdout
        return result

    def job(self, name: str) -> dict:
        return next(j for j in json.loads(self("jobs", "--json").stdout) if j["job"] == name)

    def ended(self, name: str, timeout_s: float = 180) -> dict:
        return wait_for(
            lambda: (
                (found := self.job(name))["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and found
            ),
            timeout_s,
            0.5,
            what=f"job {name} to end",
        )


def test_a_directory_of_another_lineage_is_never_written_and_nothing_starts_over(cluster, etcd):
    cluster.controller()
    for node in ("node-a", "node-b"):
        cluster.agent(node, slots="1")
    wait_for(lambda: len(cluster.store.nodes()) == 2, 30, what="two nodes registered")
    cli = Cli(cluster, etcd)
    shared = cluster.path / "shared"

    cli("submit", str(spec_file(cluster.path, "first", shared, steps=6)))
    first = cli.ended("first")
    assert first["state"] == "SUCCEEDED", first
    before = digest(shared)
    assert "step_00000006/manifest.json" in before
    first_id = first["job_id"]
    assert len(first_id) == 32

    # Two jobs naming one directory: the second is refused at submit.
    refused = cli("submit", str(spec_file(cluster.path, "second", shared, steps=6)), ok=False)
    assert f"checkpoint_dir {shared} is job first's (id {first_id}, SUCCEEDED)" in refused.stderr
    assert "resume_from" in refused.stderr
    assert "second" not in cluster.store.job_names()

    # Re-submitted after `keel delete`: a new job (a new id) finds the old lineage's
    # checkpoints there and fails before any of its ranks starts, naming the owner.
    cli("delete", "first")
    cli("submit", str(spec_file(cluster.path, "first", shared, steps=6)))
    again = cli.ended("first")
    assert again["state"] == "FAILED" and again["job_id"] != first_id
    assert f"holds checkpoints of job first (id {first_id}" in again["reason"], again["reason"]
    assert "a new checkpoint directory" in again["reason"]
    assert f"--resume-from {shared}" in again["reason"]
    assert int(again["restarts"]) == 0, "what no restart can mend is not retried"
    assert digest(shared) == before, "the first lineage's files changed"

    # Every candidate damaged: the job ends FAILED listing each, never back at step 0.
    third = cluster.path / "third"
    cli(
        "submit",
        str(
            spec_file(
                cluster.path,
                "third",
                third,
                steps=10,
                max_restarts=3,
                hang_floor_s=3,
                # Step 7 is the first after step 6's save; it is judged by the checkpoint
                # budget, step 8 by the hang timeout.
                faults=["hang:rank=0,step=8"],
            )
        ),
    )
    wait_for(
        lambda: {r.step for r in cluster.store.checkpoints("third")} >= {6},
        120,
        0.2,
        what="the checkpoint of step 6 recorded",
    )
    recorded = cluster.store.checkpoints("third")
    for record in recorded:
        corrupt(Path(record.path))
    ended = cli.ended("third")
    assert ended["state"] == "FAILED", ended
    reason = ended["reason"]
    assert reason.startswith("no verifiable checkpoint: step 6 ("), reason
    for record in recorded:
        assert f"step {record.step} ({record.path}): " in reason, (record.step, reason)
        assert (third / f".quarantine.step_{record.step:08d}.g2").is_dir()
    assert "does not match its checksum" in reason
    # Generation 2 found them damaged and failed; no generation started from step 0.
    assert int(ended["generation"]) == 2, ended
    assert all(r.quarantined for r in cluster.store.checkpoints("third"))


def test_a_checkpoint_missing_on_rank_0s_node_only_moves_the_job_and_quarantines_nothing(
    cluster, etcd
):
    """node-b's agent runs in a mount namespace of its own in which the checkpoint
    directory is an empty directory bound over the real one: a mount missing there."""
    cluster.controller()
    checkpoints, empty = cluster.path / "checkpoints", cluster.path / "empty"
    checkpoints.mkdir()
    empty.mkdir()
    missing_mount = (
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount --bind "$0" "$1" && shift && exec "$@"',
        str(empty),
        str(checkpoints),
    )
    cluster.agent("node-a", slots="1")
    cluster.agent("node-b", slots="1", prefix=missing_mount)
    cluster.agent("node-c", slots="1")
    wait_for(lambda: len(cluster.store.nodes()) == 3, 30, what="three nodes registered")
    cli = Cli(cluster, etcd)

    # Generation 1 on node-a hangs after its checkpoint of step 4 (in step 6, the one
    # after the first step past the save): node-a is suspected,
    # and generation 2 goes to node-b, which cannot see the checkpoint.
    cli(
        "submit",
        str(
            spec_file(
                cluster.path,
                "moves",
                checkpoints,
                steps=8,
                max_restarts=3,
                hang_floor_s=3,
                faults=["hang:rank=0,step=6"],
            )
        ),
    )
    ended = cli.ended("moves", timeout_s=240)
    assert ended["state"] == "SUCCEEDED", ended
    events = [json.loads(line) for line in cli("events", "moves", "--json").stdout.splitlines()]
    suspected = [e for e in events if e["kind"] == "suspected"]
    assert any(e["node"] == "node-b" for e in suspected), events
    assert any("cannot be read" in e["reason"] or "missing" in e["reason"] for e in suspected)
    # Nothing was quarantined: not the record, not the directory.
    assert not any(r.quarantined for r in cluster.store.checkpoints("moves"))
    assert not [p for p in os.listdir(checkpoints) if p.startswith(".quarantine")]
    assert not any(e["kind"] == "quarantined" for e in events)
    # Generation 2 failed on node-b for want of the checkpoint; generation 3, on
    # another node, resumed from it.
    assert int(ended["generation"]) == 3, ended
    second = next(f for f in ended["failures"] if int(f["generation"]) == 2)
    assert second["node"] == "node-b" and "no verifiable checkpoint" in second["traceback"]
