"""Saves checkpoints on every rank and checks damaged, whole, unmanifested and
unreachable copies of them, split between the ranks (``verify.check``) and on rank 0
alone (``verify.check_alone``), in one torchrun launch.

Usage, under torchrun with 4 ranks: ``verify_cases.py ROOT SEED``. Ranks 0 and 3 each
re-execute themselves first in a mount namespace of their own in which
``ROOT/hidden-<rank>`` is covered by an empty directory: that checkpoint directory is
missing on their node only, as when a mount is absent there. Rank ``r`` calls itself
node ``node<r // 2>``.

Every rank saves with ``Checkpointer`` (a tensor of its own, so each writes a shard
file), synchronously into ``ROOT/sync`` and asynchronously into ``ROOT/async``. Rank 0
prints ``SAVED {...}`` for each: the manifest's files and owner fields, and whether
every sum in it equals the file's bytes read back. It then makes the cases, copies of
the synchronous checkpoint changed as each case says, and the ranks check each; rank
0 prints ``RESULT {...}`` per case: ``name``, ``expected`` (a verdict kind, or null
for the seeded random cases), ``check`` (each rank's verdict kind), ``alone``,
``nodes``, ``reasons`` (rank 0's ``check`` and ``check_alone`` reasons).
"""

import functools
import json
import os
import random
import shlex
import shutil
import sys

import torch
import torch.distributed as dist

from protos import keel_pb2
from trainer import manifest, verify
from trainer.checkpoint import Checkpointer
from trainer.checkpoint_dir import METADATA_FILE, committed_path
from trainer.ledger import Ledger
from trainer.runtime import Identity, Runtime

HIDDEN_RANKS = (0, 3)


def hide(root: str, rank: int) -> None:
    """Re-executes this rank in a mount namespace where ``ROOT/hidden-<rank>`` is an
    empty directory (the environment, hence the rank, stays)."""
    if os.environ.get("VERIFY_CASES_HIDDEN") or rank not in HIDDEN_RANKS:
        return
    hidden, empty = os.path.join(root, f"hidden-{rank}"), os.path.join(root, f"empty-{rank}")
    os.makedirs(hidden, exist_ok=True)
    os.makedirs(empty, exist_ok=True)
    os.environ["VERIFY_CASES_HIDDEN"] = "1"
    mount = f"mount --bind {empty} {hidden} && exec {shlex.join([sys.executable, *sys.argv])}"
    os.execvp("unshare", ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount])


def runtime(rank: int, world_size: int) -> Runtime:
    return Runtime(
        Identity(
            rank=rank,
            world_size=world_size,
            local_rank=rank,
            generation=3,
            job="verify-job",
            mesh={"dp_shard": world_size},
            checkpoint_dir=None,
            restore_from=None,
            restart_count=0,
            agent_socket=None,
            restore_fallbacks=(),
            job_id="job-b",
        ),
        faults=keel_pb2.FaultSchedule(),
    )


def saved(directory: str) -> dict:
    """What rank 0 reports of a committed checkpoint."""
    found = manifest.read(directory)
    names = sorted(n for n in os.listdir(directory) if n != manifest.MANIFEST_FILE)
    return {
        "files": sorted(found.files),
        "on_disk": names,
        "sums_match": manifest.checksum(directory, names) == dict(found.files),
        "job_id": found.job_id,
        "job": found.job,
        "lineage": list(found.lineage),
        "generation": found.generation,
        "step": found.step,
    }


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def truncate(path: str, size: int) -> None:
    os.truncate(path, size)


def schema_one(directory: str) -> None:
    """Rewrites the manifest as a schema-1 one (``{"step", "files"}``), as written
    before manifests named their owner."""
    found = manifest.read(directory)
    files = {n: {"bytes": s.size_bytes, "crc32": s.crc32} for n, s in found.files.items()}
    with open(os.path.join(directory, manifest.MANIFEST_FILE), "w") as out:
        json.dump({"step": found.step, "files": files}, out)


CHANGES = {
    "flip a byte of": lambda path, at: flip(path, int(at * os.path.getsize(path))),
    "truncate": lambda path, at: truncate(path, int(at * os.path.getsize(path))),
    "extend": lambda path, at: open(path, "ab").write(b"\0" * (1 + int(at * 100))),
    "remove": lambda path, at: os.remove(path),
}


def changed(directory: str, target: str, how: str, at: float) -> None:
    """Changes ``target`` in ``directory`` as ``how`` says (``at``: where, as a fraction
    of its length); half the time, removes the manifest first."""
    if at < 0.5 and target != manifest.MANIFEST_FILE:
        os.remove(os.path.join(directory, manifest.MANIFEST_FILE))
    CHANGES[how](os.path.join(directory, target), at)


def make_cases(root: str, source: str, seed: int) -> list[tuple[str, str, str | None]]:
    """(name, path, expected kind) for every case, made by rank 0."""
    shard = "__2_0.distcp"
    size = os.path.getsize(os.path.join(source, shard))
    cases = []

    def case(name: str, expected: str | None, change=None, parent: str = "cases") -> None:
        path = os.path.join(root, parent, name, "step_00000001")
        shutil.copytree(source, path)
        if change:
            change(path)
        cases.append((name, path, expected))

    def remove(name):
        return lambda p: os.remove(os.path.join(p, name))

    case("whole", "OK")
    case("whole, schema-1 manifest", "OK", schema_one)
    case("a flipped byte", "DAMAGED", lambda p: flip(os.path.join(p, shard), size // 2))
    case("truncated", "DAMAGED", lambda p: truncate(os.path.join(p, shard), size - 1))
    case("a shard file gone", "DAMAGED", remove("__1_0.distcp"))
    case(".metadata gone", "DAMAGED", remove(METADATA_FILE))
    case(
        "malformed manifest",
        "DAMAGED",
        lambda p: open(os.path.join(p, manifest.MANIFEST_FILE), "w").write('{"step": 1, "fi'),
    )
    case("no manifest", "UNVERIFIED", remove(manifest.MANIFEST_FILE))

    def unmanifested(change):
        return lambda p: (os.remove(os.path.join(p, manifest.MANIFEST_FILE)), change(p))

    case(
        "no manifest, a flipped byte (nothing proves it)",
        "UNVERIFIED",
        unmanifested(lambda p: flip(os.path.join(p, shard), size // 2)),
    )
    case(
        "no manifest, truncated",
        "DAMAGED",
        unmanifested(lambda p: truncate(os.path.join(p, shard), size // 2)),
    )
    case(
        "no manifest, .metadata garbage",
        "DAMAGED",
        unmanifested(lambda p: open(os.path.join(p, METADATA_FILE), "wb").write(b"\x80junk")),
    )
    case("no manifest, .metadata gone", "DAMAGED", unmanifested(remove(METADATA_FILE)))
    case("missing everywhere", "UNREACHABLE", lambda p: shutil.rmtree(p))
    case(
        "a symlink loop for a directory",
        "UNREACHABLE",
        lambda p: (shutil.rmtree(p), os.symlink(p, p)),
    )
    # Seeded random changes: check and check_alone must agree whatever they find.
    rng = random.Random(seed)
    names = sorted(os.listdir(source))
    for index in range(12):
        target, how, at = rng.choice(names), rng.choice(sorted(CHANGES)), rng.random()
        case(
            f"random {index}: {how} {target}",
            None,
            functools.partial(changed, target=target, how=how, at=at),
        )
    return cases


def hidden_cases(root: str, source: str) -> list[tuple[str, str, str]]:
    """Whole copies, each covered on one node by an empty directory (see ``hide``);
    made by a rank that sees every one."""
    cases = []
    for rank in HIDDEN_RANKS:
        path = os.path.join(root, f"hidden-{rank}", "step_00000001")
        shutil.copytree(source, path)
        cases.append((f"missing on rank {rank}'s node", path, "UNREACHABLE"))
    return cases


def main() -> None:
    root, seed = sys.argv[1], int(sys.argv[2])
    hide(root, int(os.environ["RANK"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rt = runtime(rank, world_size)
    node = f"node{rank // 2}"
    state = {"model": {f"w{rank}": torch.arange(20_000.0) + rank}, "step": torch.tensor(1)}
    for name, use_async, lineage in (("sync", False, ()), ("async", True, ("job-a", "job-b"))):
        saver = Checkpointer(
            os.path.join(root, name),
            rt,
            use_async=use_async,
            keep=0,
            restored_from=None,
            lineage=lineage,
        )
        saver.save(1, 16, state, Ledger([[1, 0, 16]]), 16)
        saver.wait()
        if rank == 0:
            print(
                "SAVED "
                + json.dumps({"name": name, **saved(committed_path(saver.checkpoint_dir, 1))})
            )
        saver.settle(10)
    source = committed_path(os.path.join(root, "sync"), 1)
    made: list = [None]
    hidden: list = [None]
    if rank == 0:
        made[0] = make_cases(root, source, seed)
    if rank == 1:
        hidden[0] = hidden_cases(root, source)
    dist.broadcast_object_list(made, src=0)
    dist.broadcast_object_list(hidden, src=1)
    for name, path, expected in made[0] + hidden[0]:
        verdict = verify.check(path, node=node)
        kinds: list = [None] * world_size
        dist.all_gather_object(kinds, (verdict.kind.value, verdict.nodes))
        if rank == 0:
            alone = verify.check_alone(path)
            result = {
                "name": name,
                "expected": expected,
                "check": [kind for kind, _ in kinds],
                "nodes": [list(nodes) for _, nodes in kinds],
                "alone": alone.kind.value,
                "reasons": [verdict.reason, alone.reason],
            }
            print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
