"""What Keel's checkpoints cost the reference trainer: the time a save blocks the
training loop, synchronously and asynchronously, the save's throughput against a raw
write of the same bytes, a resharded restore against a same-layout one, the
verification of a checkpoint of over 2 GB on 4 ranks against rank 0 alone, and the
commit against the read-back it no longer makes, each against a baseline measured in
the same run.

The ranks (``benchmarks/checkpoint_ranks.py``, which says exactly what each
measurement times) run the trainer's own code: the model built by
``trainer.train.setup`` in a ``trainer.mesh.Layout`` and stepped once (so AdamW holds
its moments), ``checkpoint.state_dict``, ``Checkpointer.save``/``wait`` (DCP save or
async save, then rank 0's commit: manifest from the sums taken while writing, fsyncs,
generation fence, rename), ``restore.choose`` (verify) with ``checkpoint.load``, and
``trainer.verify``'s ``check`` and ``check_alone``. Three launches, each of its own
ranks (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, gloo, one CPU thread
each, ``OMP_NUM_THREADS=1``), each measuring everything it does round after round in
an order that rotates every round, after one untimed round:

1. world 4: a raw write (every rank writes its share of a checkpoint's bytes to a file
   of its own and fsyncs it, in parallel, as the save writes its shard files), the
   synchronous save and the asynchronous one, all of ``dp_shard=4``'s state; and
   restores of a ``dp_shard=4`` and a ``dp_shard=2,tp=2`` checkpoint into
   ``dp_shard=2,tp=2``;
2. world 2: restores of a ``dp_shard=2`` checkpoint saved there and of launch 1's
   ``dp_shard=4`` one into ``dp_shard=2``;
3. world 4, a larger model (``VERIFY_DIM``, ``VERIFY_LAYERS``: a 2.4 GB checkpoint),
   at most ``VERIFY_ROUNDS`` rounds: ``verify.check`` on 4 ranks and
   ``verify.check_alone`` on rank 0 of one ``dp_shard=4`` checkpoint, and a synchronous
   save of the same state with its commit, followed by rank 0's ``check_alone`` of what
   it committed, at once: the read-back (every file read again and summed, as warm as
   the commit found them) that the commit made before it took the sums while writing.

Each restore and each verification first drops the checkpoint's files from the page
cache. Every time is
the slowest rank's, and the tables give medians over the rounds with rank 0's phases.
The figures, last, are ratios of medians: the time an async save blocks the loop (the
save, and the next step's wait for its staging copy before the optimizer step) against
the synchronous save's; what each costs the loop in all (the save and the next
optimizer step, beside which an async save's copy and write run, less that step
alone); the save's throughput (bytes committed / sync save time) against the
raw write's; ``checkpoint.load`` of a checkpoint of another layout (and world)
against one of the same layout, into the same layout; ``verify.check`` on 4 ranks
against ``check_alone``; and the commit against the commit plus that read-back::

    python -m benchmarks.checkpoint [--rounds 8] [--dim 1024] [--layers 2] [--dir /tmp]

Checkpoints go to a temporary directory under ``--dir`` (the filesystem is printed),
removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.net import free_port
from common.procs import terminate

REPO = Path(__file__).resolve().parents[1]
HEADS = 8
LAUNCH_TIMEOUT_S = 240.0
GRACE_S = 5.0
SAVE_LAYOUT = "dp_shard=4"
RESHARD_LAYOUT = "dp_shard=2,tp=2"
SMALL_LAYOUT = "dp_shard=2"
# Verification is timed on a checkpoint of at least 2 GB: 201 M parameters, 2.4 GB of
# fp32 weights and AdamW moments. Each of its rounds moves about 10 GB through the
# disk (a save, its read-back, two reads with the page cache dropped), hence fewer
# rounds and a longer launch.
VERIFY_DIM = 2048
VERIFY_LAYERS = 4
VERIFY_ROUNDS = 3
VERIFY_LAUNCH_TIMEOUT_S = 900.0
TARGETS = {"async_over_sync": 0.1, "save_over_raw": 0.7}


class Failed(Exception):
    """A launch that did not finish; the message names the first rank that failed."""


def launch(
    workdir: Path,
    world_size: int,
    options: argparse.Namespace,
    extra: list[str],
    timeout_s: float = LAUNCH_TIMEOUT_S,
) -> dict:
    """Runs ``world_size`` ranks of ``benchmarks.checkpoint_ranks`` (the model and
    rounds of ``options``), each launch within ``timeout_s``; their results."""
    port = free_port("127.0.0.1")
    base = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    argv = [
        sys.executable,
        "-m",
        "benchmarks.checkpoint_ranks",
        "--workdir",
        str(workdir),
        "--rounds",
        str(options.rounds),
        "--dim",
        str(options.dim),
        "--layers",
        str(options.layers),
        "--heads",
        str(HEADS),
        *extra,
    ]
    procs, logs = [], []
    for rank in range(world_size):
        env = base | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "KEEL_LOG_FORMAT": "console",
        }
        logs.append(workdir / f"w{world_size}-rank{rank}.log")
        with open(logs[-1], "wb") as out:
            procs.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    cwd=REPO,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + timeout_s
    first = None  # the first rank seen to fail, and its exit status
    try:
        while (
            first is None and any(p.poll() is None for p in procs) and time.monotonic() < deadline
        ):
            first = next(
                ((rank, p.returncode) for rank, p in enumerate(procs) if p.poll() not in (None, 0)),
                None,
            )
            time.sleep(0.2)
    finally:
        running = [rank for rank, p in enumerate(procs) if p.poll() is None]
        terminate(procs, GRACE_S)
    first = first or next(
        ((rank, p.returncode) for rank, p in enumerate(procs) if p.returncode), None
    )
    if first or running:
        rank, code = first or (running[0], None)
        why = (
            f"still running after {timeout_s:g} s"
            if code is None
            else f"exited {code}"
            if code > 0
            else f"was killed by signal {-code}"
        )
        tail = logs[rank].read_text(errors="replace").splitlines()[-25:]
        raise Failed(
            f"world {world_size}: rank {rank} (pid {procs[rank].pid}) {why}:\n" + "\n".join(tail)
        )
    return json.loads((workdir / f"results-w{world_size}.json").read_text())


def filesystem(path: Path) -> str:
    """The mount that holds ``path``, as ``device (type) on mount point``."""
    best = ("?", "?", "/")
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, kind = line.split()[:3]
        if (str(path).startswith(mount.rstrip("/") + "/") or str(path) == mount) and len(
            mount
        ) >= len(best[2]):
            best = (device, kind, mount)
    return f"{best[0]} ({best[1]}) on {best[2]}"


def median(values: list[float]) -> float:
    return statistics.median(values)


def derived_phases(name: str, times: dict[str, float], spent: dict[str, float]) -> dict[str, float]:
    """Rank 0's phases of one measurement, named for the tables."""
    if name == "sync save":
        commit = spent.get("commit", 0.0)
        return {
            "save returned": spent["own blocked"],
            "state_dict": spent["state_dict"],
            "staging directory, ledger, barrier": spent["own blocked"]
            - spent["state_dict"]
            - spent["dcp.save"]
            - commit,
            "dcp.save: write_data (serialize, write and fsync its shard file)": spent["write_data"],
            "dcp.save: the rest (plans, gathers, .metadata)": spent["dcp.save"]
            - spent["write_data"],
            "commit: manifest (sums taken while writing)": spent["manifest"],
            "commit: fsyncs, fence, rename": commit - spent["manifest"],
            "the next step": spent["own with step"] - spent["own blocked"],
        }
    if name == "async save":
        return {
            "save returned": spent["own blocked"],
            "state_dict": spent["state_dict"],
            "staging directory, ledger, barrier": spent["own blocked"]
            - spent["state_dict"]
            - spent["dcp.async_save"],
            "dcp.async_save (plans the write, starts the staging copy)": spent["dcp.async_save"],
            "the next step, the staging copy beside it": spent["own with step"]
            - spent["own blocked"],
            "  of which its wait for the copy before its optimizer step": spent["own staging wait"],
            "after that step, in the background: write and commit": spent["own to commit"]
            - spent["own with step"],
            "  of which write_data (serialize, write and fsync its shard file)": spent[
                "write_data"
            ],
            "  of which commit: manifest (sums taken while writing)": spent["manifest"],
        }
    if name == "commit":
        return {
            "dcp.save: write_data (serialize, sum, write and fsync its shard file)": spent[
                "write_data"
            ],
            "commit: manifest (sums taken while writing), fsyncs, fence, rename": spent["commit"],
        }
    if name.startswith("load"):
        return {
            "choose: verify (read and CRC-32 every file)": spent.get("verify", 0.0),
            "load: dcp.load (plan, read, copy in)": spent["dcp.load"],
            "load: set state into model and optimizer": times["load"] - spent["dcp.load"],
        }
    return {}


def table(title: str, names: list[str], results: dict, columns: list[tuple[str, str]]) -> None:
    """Rows ``names`` of ``results`` (its ``times`` and ``phases``): median and range of
    each of ``columns`` (key, heading), then rank 0's median phases."""
    print(f"\n{title}")
    width = max(len(name) for name in names) + 2
    print(" " * width + "".join(f"{heading:>22}" for _, heading in columns))
    for name in names:
        runs = results["times"][name]
        cells = []
        for key, _ in columns:
            values = [run[key] for run in runs if key in run]
            cells.append(
                f"{median(values):>8.3f} ({min(values):.2f}–{max(values):.2f})" if values else "—"
            )
        print(f"{name:<{width}}" + "".join(f"{cell:>22}" for cell in cells))
        phases = [
            derived_phases(name, run, spent) for run, spent in zip(runs, results["phases"][name])
        ]
        for phase in phases[0]:
            print(f"    {phase}: {median([p[phase] for p in phases]):.3f} s (rank 0)")


def verdict(value: float, target: float, at_most: bool) -> str:
    met = value <= target if at_most else value >= target
    return f"target {'≤' if at_most else '≥'} {target:g} {'met' if met else 'NOT met'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=8, help="timed rounds per launch (after one untimed)"
    )
    parser.add_argument("--dim", type=int, default=1024, help="model width (ModelConfig.dim)")
    parser.add_argument(
        "--layers", type=int, default=2, help="transformer blocks (ModelConfig.layers)"
    )
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="where the temporary checkpoint directory goes"
    )
    options = parser.parse_args()
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="keel-bench-checkpoint-", dir=options.dir))
    try:
        big = launch(
            workdir,
            4,
            options,
            ["--layouts", SAVE_LAYOUT, RESHARD_LAYOUT, "--saves", "--load-into", RESHARD_LAYOUT],
        )
        saved = big["sources"][f"{SAVE_LAYOUT} (world 4)"]
        small = launch(
            workdir,
            2,
            options,
            ["--layouts", SMALL_LAYOUT, "--foreign", f"{SAVE_LAYOUT} (world 4)@{saved}"],
        )
        shutil.rmtree(workdir / "load", ignore_errors=True)  # room for the large one
        large = launch(
            workdir,
            4,
            argparse.Namespace(
                **vars(options)
                | {
                    "dim": VERIFY_DIM,
                    "layers": VERIFY_LAYERS,
                    "rounds": min(options.rounds, VERIFY_ROUNDS),
                }
            ),
            ["--layouts", SAVE_LAYOUT, "--verify"],
            timeout_s=VERIFY_LAUNCH_TIMEOUT_S,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    wall_s = time.monotonic() - began

    committed = sum(big["shares"])
    print(
        f"model dim {options.dim}, {options.layers} layers, {HEADS} heads: "
        f"{committed / 1e6:.1f} MB per checkpoint (weights and AdamW moments, fp32); "
        f"{options.rounds} timed rounds per launch; "
        f"checkpoints on {filesystem(workdir)}"
    )
    problems = {kind: problem for kind, problem in big["commit_problems"].items() if problem}
    print(
        "commit without an agent: "
        + (
            "; ".join(f"{kind}: {p}" for kind, p in problems.items())
            if problems
            else "sync and async saves each left step_N/ with .metadata, one shard file per rank, "
            "ledger.json and a manifest.json that verifies, no staging directory; only the report "
            "to the agent was a no-op"
        )
    )
    table(
        f"saves, world 4, {SAVE_LAYOUT}; seconds, median (min–max) of the slowest rank",
        ["train step", "raw write", "sync save", "async save"],
        big,
        [
            ("blocked", "loop blocked"),
            ("with step", "save + next step"),
            ("to commit", "save → committed"),
        ],
    )
    loads = [name for name in big["times"] if name.startswith("load")]
    table(
        "restores (page cache dropped first), world 4; "
        "seconds, median (min–max) of the slowest rank",
        loads,
        big,
        [("blocked", "restore"), ("choose", "choose (verify)"), ("load", "checkpoint.load")],
    )
    small_loads = [name for name in small["times"] if name.startswith("load")]
    table(
        "restores (page cache dropped first), world 2; "
        "seconds, median (min–max) of the slowest rank",
        small_loads,
        small,
        [("blocked", "restore"), ("choose", "choose (verify)"), ("load", "checkpoint.load")],
    )

    gigabytes = large["verified_bytes"] / 1e9
    checks = ["verify.check, 4 ranks", "verify.check_alone, rank 0"]
    table(
        f"verification (page cache dropped first), world 4, {SAVE_LAYOUT}, a {gigabytes:.2f} GB "
        f"checkpoint (--dim {VERIFY_DIM} --layers {VERIFY_LAYERS}); seconds, median (min–max) "
        "of the slowest rank",
        checks,
        large,
        [("verify", "verify")],
    )
    table(
        "commit of the same state, world 4; seconds, median (min–max); "
        "commit and read-back are rank 0's",
        ["commit"],
        large,
        [("save", "sync save"), ("commit", "commit"), ("read-back", "old read-back")],
    )
    for kind, said in sorted(large["verdicts"].items()):
        print(f"    verdict ({kind}): {said}")

    def at(results: dict, name: str, key: str = "blocked") -> float:
        return median([run[key] for run in results["times"][name]])

    print(f"\nbenchmark wall time {wall_s:.0f} s")
    sync_s, async_s, raw_s = at(big, "sync save"), at(big, "async save"), at(big, "raw write")
    print(
        f"async save blocks the loop {async_s:.3f} s (the save, and the next step's wait for "
        f"its staging copy) vs sync save {sync_s:.3f} s -> {async_s / sync_s:.3f} "
        f"({verdict(async_s / sync_s, TARGETS['async_over_sync'], True)})"
    )
    # What a save costs the loop in all: the save and the next step, less that step
    # alone. On CPU the background copy and write take the cores the step trains on.
    step_s = at(big, "train step")
    sync_cost = at(big, "sync save", "with step") - step_s
    async_cost = at(big, "async save", "with step") - step_s
    print(
        f"async save costs the loop {async_cost:.3f} s in all vs sync save {sync_cost:.3f} s "
        f"(each: the save and the next step, less a step alone, {step_s:.3f} s; the "
        f"background work shares the CPU the step trains on) -> "
        f"{async_cost / sync_cost:.3f} (no target)"
    )
    print(
        f"save throughput {committed / sync_s / 1e6:.0f} MB/s vs raw write and fsync "
        f"{committed / raw_s / 1e6:.0f} MB/s -> {raw_s / sync_s:.2f} "
        f"({verdict(raw_s / sync_s, TARGETS['save_over_raw'], False)})"
    )
    resharded = f"load {SAVE_LAYOUT} (world 4) -> {RESHARD_LAYOUT}"
    same = f"load {RESHARD_LAYOUT} (world 4) -> {RESHARD_LAYOUT}"
    print(
        f"resharded load {SAVE_LAYOUT} -> {RESHARD_LAYOUT} (world 4) "
        f"{at(big, resharded, 'load'):.3f} s vs same layout {at(big, same, 'load'):.3f} s -> "
        f"{at(big, resharded, 'load') / at(big, same, 'load'):.2f} "
        f"(whole restore {at(big, resharded) / at(big, same):.2f}; no target)"
    )
    resharded = f"load {SAVE_LAYOUT} (world 4) -> {SMALL_LAYOUT}"
    same = f"load {SMALL_LAYOUT} (world 2) -> {SMALL_LAYOUT}"
    print(
        f"resharded load {SAVE_LAYOUT} (world 4) -> {SMALL_LAYOUT} (world 2) "
        f"{at(small, resharded, 'load'):.3f} s "
        f"vs same layout {at(small, same, 'load'):.3f} s -> "
        f"{at(small, resharded, 'load') / at(small, same, 'load'):.2f} "
        f"(whole restore {at(small, resharded) / at(small, same):.2f}; no target)"
    )
    check_s, alone_s = (at(large, name, "verify") for name in checks)
    print(
        f"verify of a {gigabytes:.2f} GB checkpoint on 4 ranks {check_s:.3f} s vs rank 0 alone "
        f"{alone_s:.3f} s -> {check_s / alone_s:.2f} (no target)"
    )
    commit_s, read_s = at(large, "commit", "commit"), at(large, "commit", "read-back")
    print(
        f"commit of a {gigabytes:.2f} GB checkpoint, sums taken while writing, {commit_s:.3f} s "
        f"vs with the old read-back {commit_s + read_s:.3f} s (read-back {read_s:.3f} s) -> "
        f"{commit_s / (commit_s + read_s):.2f} (no target)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
