"""What the memory tier (``trainer.memory_tier``) buys and costs, each against a
baseline measured in the same run, on 4 ranks (gloo, one CPU thread each):

1. **Restore from memory against from storage**, a model of over 1 GB of state
   (``--dim 2048 --layers 2``: 1.2 GB of fp32 weights and AdamW moments) in
   ``dp_shard=4`` after one step. The same state is saved once as a durable checkpoint
   (``Checkpointer``, synchronous: DCP, manifest, fsyncs, rename) under ``--dir`` and
   once as a memory snapshot (``MemoryTier.save``) under ``/dev/shm``; then, round after
   round in alternating order, each is restored as a generation restores it:
   ``restore.choose`` (the durable one is verified: every rank reads and sums its
   share; the snapshot is checked whole on every rank) and ``checkpoint.load``. The
   durable checkpoint's files are dropped from the page cache before each of its
   restores (a restart after a failure does not find the whole state cached; on a
   cluster it is read from a shared file system). Times are the slowest rank's.
   **From a peer's memory** too: the snapshot is sent to a partner agent's
   ``AgentPeer`` service (``agent.peer``, served by this benchmark's own process on
   loopback, into its ``/dev/shm``), and each round a replacement fetches it back
   (``fetch_snapshot``, as a replacement node's agent does before its ranks start) into
   the node's memory, from which the ranks restore it; the fetch counts in its total.
   The copy to the partner is timed unbounded and at ``--bound-mbps`` (the agents'
   ``--replication-mbps``), to show the bound holds.
2. **Step-time overhead**: the reference trainer's default model (``--dim 64
   --layers 2``) in ``dp_shard=4``, blocks of optimizer steps with memory snapshots
   against blocks without, alternating, the order flipped every round: first with a
   snapshot after every step (``--memory-overhead-max 0``), then at the interval the
   default bound (``--memory-overhead-max 0.02``) settles on over ``--warmup-steps``
   (blocks of at least four intervals). A snapshot's cost includes building the state
   dict. A step here is ``TrainStep`` alone (no step exchange, no reports), so the
   ratio is against less than the trainer's whole loop: it overstates the overhead, if
   anything. The interval is the number of steps a failure may lose.

Steps lost per failure are also shown by tests/integration/test_memory_tier.py: a rank
killed as step 9 begins resumes at step 8 or 9 (from the snapshot of step 7 or 8) where,
at ``--checkpoint-every 50``, it would start over.

    python -m benchmarks.memory_tier [--rounds 3] [--dir /tmp] [--overhead-rounds 8]
        [--steps 10] [--warmup-steps 60] [--bound-mbps 2000]

Targets (docs/BENCHMARKS.md): restore from memory, and from a peer's memory, ≤ 0.2×
from storage; overhead ≤ 2 %.
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

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"memory_over_storage": 0.2, "peer_over_storage": 0.2, "overhead": 0.02}
DEFAULT_OVERHEAD_MAX = 0.02  # the trainer's --memory-overhead-max default
WORLD = 4
PARTNER = "KEEL_BENCH_PARTNER"  # the partner agent's AgentPeer address
JOB, NODE = "bench", "node-0"  # whose copy the partner holds


def ranks(options: argparse.Namespace) -> None:
    """One rank's measurements; rank 0 writes them to ``--workdir``/results.json."""
    import torch
    import torch.distributed as dist

    from agent import peer
    from benchmarks.checkpoint_ranks import built, drop_cache, slowest, trainer_state
    from trainer import checkpoint, restore, train
    from trainer import runtime as keel_runtime
    from trainer.checkpoint import Checkpointer
    from trainer.memory_tier import MemoryTier, SnapshotReader, snapshot_path
    from trainer.mesh import Layout
    from trainer.phases import PhaseTimer

    dist.init_process_group("gloo")
    rt = keel_runtime.init({**os.environ, keel_runtime.env.GENERATION: "1"})
    device = torch.device("cpu")
    workdir = Path(options.workdir)
    results: dict = {}

    def args_for(*flags: str) -> argparse.Namespace:
        return train.parse_args(["--steps", "100000", "--no-preflight", *flags])

    layout = Layout(dp_shard=WORLD)
    # 1. Restores.
    args = args_for(
        *("--dim", str(options.dim), "--layers", str(options.layers), "--heads", "8"),
        *("--global-batch", "4", "--seq-len", "16"),
    )
    run = built(args, layout, device)
    durable_dir = str(workdir / "ckpt")
    saver = Checkpointer(durable_dir, rt, use_async=False, keep=0, restored_from=None)
    state = checkpoint.state_dict(run.parts, run.optimizers.optimizers, trainer_state(run, args, 1))
    saver.save(1, args.global_batch, state, trainer_state(run, args, 1).ledger, args.global_batch)
    saver.wait()
    memory = MemoryTier(rt, every=1, lineage=())
    state = checkpoint.state_dict(run.parts, run.optimizers.optimizers, trainer_state(run, args, 2))
    memory.save(2, 2 * args.global_batch, state)
    assert memory.wait(), "the memory snapshot was not taken"
    del state
    # The copy to the partner, as the node's agent sends it: unbounded, then bounded.
    partner = os.environ[PARTNER]
    snapshot = Path(snapshot_path(memory.directory, 2))
    if dist.get_rank() == 0:
        results["replication"] = {
            "unbounded": peer.send_snapshot(partner, None, JOB, NODE, 2, snapshot, 0, 900),
            "bounded": peer.send_snapshot(
                partner, None, JOB, NODE, 2, snapshot, options.bound_mbps * 1e6 / 8, 900
            ),
        }
    dist.barrier()
    template = trainer_state(run, args, 0)
    times: dict[str, list[dict]] = {"storage": [], "memory": [], "peer": []}
    sources = ["storage", "memory", "peer"]
    for round_ in range(options.rounds + 1):
        for source in sources[round_ % 3 :] + sources[: round_ % 3]:
            if source == "storage":
                drop_cache(durable_dir)
            dist.barrier()
            started = time.perf_counter()
            fetch_s = 0.0
            if source == "peer":
                # The node is gone, its memory with it; its replacement fetches the copy.
                if dist.get_rank() == 0:
                    os.rename(snapshot, f"{snapshot}.aside")
                    peer.fetch_snapshot(partner, None, JOB, NODE, 2, snapshot.parent, 900)
                dist.barrier()
                fetch_s = time.perf_counter() - started
            chosen = restore.choose(durable_dir, rt, memory=source != "storage")
            chose_s = time.perf_counter() - started - fetch_s
            assert chosen is not None and chosen.memory == (source != "storage"), chosen
            reader = SnapshotReader(chosen.path) if chosen.memory else None
            loaded = checkpoint.load(
                chosen.path, run.parts, run.optimizers.optimizers, template, reader
            )
            load_s = time.perf_counter() - started - fetch_s - chose_s
            assert loaded.step == (1 if source == "storage" else 2), loaded.step
            phases = {"fetch": slowest(fetch_s), "choose": slowest(chose_s)}
            phases["load"] = slowest(load_s)
            phases["total"] = slowest(fetch_s + chose_s + load_s)
            dist.barrier()
            if source == "peer" and dist.get_rank() == 0:
                shutil.rmtree(snapshot)
                os.rename(f"{snapshot}.aside", snapshot)
            if round_:
                times[source].append(phases)
    results["state_bytes"] = sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(memory.directory)
        for name in names
    )
    results["restores"] = times
    memory.close()
    del run, saver, memory
    # 2. Step-time overhead.
    args = args_for()  # the reference trainer's defaults
    run = built(args, layout, device)
    timer = PhaseTimer(device)

    def train_steps(count: int, memory: MemoryTier | None, first: int) -> float:
        """``count`` steps from step ``first``, snapshotted as ``memory`` decides; the
        slowest rank's seconds per step, the last snapshot's commit included."""
        run.step.before_update = memory.before_update if memory else None
        dist.barrier()
        started = time.perf_counter()
        for step in range(first, first + count):
            inputs = torch.randint(0, args.vocab, (args.global_batch // WORLD, args.seq_len))
            timer.start()
            run.step(inputs, inputs, timer)
            if memory is not None and memory.due(step, 10**9):
                building = time.perf_counter()
                whole = checkpoint.state_dict(
                    run.parts, run.optimizers.optimizers, trainer_state(run, args, step)
                )
                memory.save(step, step * args.global_batch, whole, time.perf_counter() - building)
        if memory is not None:
            memory.wait()
        return slowest(time.perf_counter() - started) / count

    def alternate(memory: MemoryTier, steps: int) -> dict[str, list[float]]:
        """Blocks of ``steps`` with ``memory`` and without, alternating, the order
        flipped every round; the first round untimed."""
        blocks: dict[str, list[float]] = {"plain": [], "memory": []}
        step = {"plain": 1, "memory": 1}  # each arm's own count: its snapshots' steps
        for round_ in range(options.overhead_rounds + 1):
            for arm in ["plain", "memory"] if round_ % 2 == 0 else ["memory", "plain"]:
                per_step = train_steps(steps, memory if arm == "memory" else None, step[arm])
                step[arm] += steps
                if round_:
                    blocks[arm].append(per_step)
        return blocks

    # A snapshot after every step, whatever it costs.
    every_step = MemoryTier(rt, every=1, lineage=())
    results["every_step"] = alternate(every_step, options.steps)
    every_step.close()
    # The default bound: its interval settles over a warm-up, and blocks at that
    # interval are timed against blocks without.
    bounded = MemoryTier(rt, every=1, lineage=(), overhead_max=DEFAULT_OVERHEAD_MAX)
    train_steps(options.warmup_steps, bounded, 1)
    interval = bounded.interval
    bounded.close()
    fixed = MemoryTier(rt, every=interval, lineage=())
    results["bounded"] = alternate(fixed, max(options.steps, 4 * interval))
    results["interval"] = interval
    fixed.close()
    if dist.get_rank() == 0:
        (workdir / "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed restore rounds")
    parser.add_argument("--overhead-rounds", type=int, default=8, help="timed rounds of blocks")
    parser.add_argument("--steps", type=int, default=10, help="steps per overhead block (least)")
    parser.add_argument(
        "--warmup-steps", type=int, default=60, help="steps for the bound's interval to settle"
    )
    parser.add_argument("--dim", type=int, default=2048, help="restore model width")
    parser.add_argument("--layers", type=int, default=2, help="restore model blocks")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoint goes")
    parser.add_argument(
        "--bound-mbps", type=float, default=2000.0, help="the copy's bound, megabits per second"
    )
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.as_rank:
        ranks(options)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="keel-bench-memory-", dir=options.dir))
    memory_dir = Path(tempfile.mkdtemp(prefix="keel-bench-memory-", dir="/dev/shm"))
    partner_dir = Path(tempfile.mkdtemp(prefix="keel-bench-partner-", dir="/dev/shm"))
    from agent import peer

    # The partner agent's peer service, in this process: the ranks send it the copy and
    # fetch it back.
    server, port = peer.serve("127.0.0.1:0", None, peer.Replicas(partner_dir, 0))
    try:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(WORLD),
            "-m",
            "benchmarks.memory_tier",
            "--as-rank",
            *("--workdir", str(workdir), "--rounds", str(options.rounds)),
            *("--overhead-rounds", str(options.overhead_rounds), "--steps", str(options.steps)),
            *("--warmup-steps", str(options.warmup_steps)),
            *("--dim", str(options.dim), "--layers", str(options.layers)),
            *("--bound-mbps", str(options.bound_mbps)),
        ]
        base = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
        env = base | {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "KEEL_LOG_FORMAT": "console",
            "KEEL_MEMORY_DIR": str(memory_dir),
            PARTNER: f"127.0.0.1:{port}",
        }
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-20000:], file=sys.stderr)
            return 1
        results = json.loads((workdir / "results.json").read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(memory_dir, ignore_errors=True)
        server.stop(0).wait()
        shutil.rmtree(partner_dir, ignore_errors=True)
    restores = results["restores"]
    print(
        f"restore of {results['state_bytes'] / 2**30:.2f} GiB of state on {WORLD} ranks, "
        f"medians of {options.rounds} rounds, slowest rank (s); storage under {options.dir}:"
    )
    print(f"{'phase':<10}{'storage':>10}{'memory':>10}{'peer':>10}")
    for phase in ("fetch", "choose", "load", "total"):
        row = [median([r[phase] for r in restores[s]]) for s in ("storage", "memory", "peer")]
        print(f"{phase:<10}" + "".join(f"{value:>10.3f}" for value in row))
    storage_s = median([r["total"] for r in restores["storage"]])
    ratio = median([r["total"] for r in restores["memory"]]) / storage_s
    peer_ratio = median([r["total"] for r in restores["peer"]]) / storage_s
    for arm, (size, seconds) in results["replication"].items():
        bound = f" (bound {options.bound_mbps:g} Mb/s)" if arm == "bounded" else ""
        rate = size * 8 / 1e6 / seconds
        share = f", {rate / options.bound_mbps:.2f} of the bound" if bound else ""
        print(
            f"copy to the partner, {arm}{bound}: {size / 2**30:.2f} GiB in {seconds:.2f} s, "
            f"{rate:.0f} Mb/s{share}"
        )
    overheads = {}
    for arm, what in (("every_step", "a snapshot every step"), ("bounded", None)):
        blocks = results[arm]
        plain, snap = median(blocks["plain"]), median(blocks["memory"])
        paired = sorted((m - p) / p for m, p in zip(blocks["memory"], blocks["plain"]))
        quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        overheads[arm] = snap / plain - 1
        what = what or (
            f"a snapshot every {results['interval']} steps (the interval "
            f"--memory-overhead-max {DEFAULT_OVERHEAD_MAX:g} settled on)"
        )
        print(
            f"step {plain * 1000:.1f} ms without, {snap * 1000:.1f} ms with {what}; middle "
            f"half of the paired differences {quartiles[0] * 100:+.1f} % to "
            f"{quartiles[-1] * 100:+.1f} % ({options.overhead_rounds} rounds)"
        )
    overhead = overheads["bounded"]
    print(f"memory tier step-time overhead at every step: {overheads['every_step'] * 100:+.2f} %")
    print(f"steps a failure may lose at the default bound: {results['interval']}")
    for name, value, target in (
        ("restore from memory / from storage", ratio, TARGETS["memory_over_storage"]),
        ("restore from a peer's memory / from storage", peer_ratio, TARGETS["peer_over_storage"]),
        ("memory tier step-time overhead at the default bound", overhead, TARGETS["overhead"]),
    ):
        shown = f"{value * 100:+.2f} %" if "overhead" in name else f"{value:.3f}x"
        mark = "meets" if value <= target else "misses"
        print(f"{name}: {shown} ({mark} the target of at most {target:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
