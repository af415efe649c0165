"""One rank of ``benchmarks.checkpoint``: the reference trainer's model built by
``trainer.train.setup`` in each of ``--layouts`` on this world (one optimizer step
each, so AdamW holds its moments), then, round after round in an order that rotates
every round, the measurements below, each started together after a barrier and timed
as the slowest rank's seconds. Rank 0 writes ``WORKDIR/results-w<WORLD>.json``.

With ``--saves`` (the first layout's state):

* ``raw``: every rank writes its share of a checkpoint's bytes (its own DCP shard
  file's size; rank 0 also the ``.metadata``, ``ledger.json`` and ``manifest.json``) to a
  file of its own in one directory on the checkpoints' filesystem, sequentially in
  ``CHUNK_BYTES`` writes, and fsyncs it; rank 0 then fsyncs the directory.
* ``sync``: ``checkpoint.state_dict`` and ``Checkpointer.save`` with ``use_async``
  False: staging directory and ledger, ``dcp.save`` (every rank writes and fsyncs its
  shard file, summing it as it goes, rank 0 the metadata), and rank 0's commit
  (manifest from those sums, fsyncs, fence, rename).
* ``async``: the same with ``use_async`` True: ``save`` returns once the staging copy to
  CPU memory has started.
* After either save, one optimizer step of ``TrainStep`` (``with step``: the save and
  that step), whose ``before_update`` is the async checkpointer's: the step waits there
  for the staging copy before its optimizer changes the state; then ``wait`` until rank
  0's commit is done (``to commit``). ``blocked``: the time the loop waited in the
  checkpointer's calls (``save``, and that step's wait for the copy). ``train step``:
  the same step alone, the baseline a save's whole cost to the loop is measured
  against.

Loads, for every checkpoint source (one saved here per layout, once, plus
``--foreign`` ones another launch saved) into every layout of ``--load-into``: the source's page
cache dropped (``POSIX_FADV_DONTNEED``; a restore after a failure on another node
finds nothing cached), then the trainer's restore: ``restore.choose`` (every rank
verifies its share of the files against the manifest, ``verify.check``) and
``checkpoint.load``.

With ``--verify`` (the first layout's checkpoint, saved once), and no loads:

* ``commit``: a sync save as above (``save``: the slowest rank's), rank 0's
  ``_commit`` (``commit``), then at once, as warm as the commit found the files, rank
  0's ``verify.check_alone`` of the committed checkpoint (``read-back``): what the
  commit read back before it took the sums while writing.
* ``verify.check, <world> ranks`` and ``verify.check_alone, rank 0``: the checkpoint's
  page cache dropped, then ``verify.check`` on every rank, or ``check_alone`` on rank 0
  while the others wait (``verify``).

Between measurements, untimed: what a save committed is deleted and the filesystem
synced, so that no deletion or writeback lands in the next one. Rank 0's phases come
from timing wrappers around the real calls (``dcp.save``, ``dcp.async_save``,
``dcp.load``, ``FileSystemWriter.write_data``, ``manifest.write``/``verify`` and the
checkpointers' ``_commit``).

The ranks run outside Keel but as generation 1, so the generation fence
(``trainer.fence``) holds every commit as under Keel; without ``KEEL_AGENT_SOCKET`` the
checkpoint report to the agent is a no-op, and that is all of the commit that does
not run (``check_commit`` confirms what a commit left)::

    python -m benchmarks.checkpoint_ranks --workdir DIR --layouts dp_shard=4 dp_shard=2,tp=2 --saves
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from trainer import checkpoint, fence, manifest, restore, train, verify
from trainer import runtime as keel_runtime
from trainer.checkpoint import Checkpointer, TrainerState
from trainer.checkpoint_dir import METADATA_FILE, committed_path, committed_steps, fsync_dir
from trainer.data import SyntheticTokens, rank_samples
from trainer.ledger import LEDGER_FILE, Ledger
from trainer.mesh import Layout
from trainer.phases import PhaseTimer

GENERATION = 1
CHUNK_BYTES = 16 << 20
_SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp")


class Clock:
    """Seconds spent in the calls it wraps, by name, since the last ``take``."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, call):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - started

        return timed

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {}
        return spent


def built(args: argparse.Namespace, layout: Layout, device: torch.device) -> train.Setup:
    """The trainer's setup under ``layout`` after one optimizer step: AdamW makes its
    moments at the first step, and a checkpoint before it would hold the weights only."""
    torch.manual_seed(args.seed)
    run = train.setup(args, layout, device)
    first, count = rank_samples(
        0, args.global_batch, layout.dp_rank(dist.get_rank()), layout.dp_size
    )
    inputs, targets = SyntheticTokens(args.vocab, args.seq_len, args.seed).batch(first, count)
    timer = PhaseTimer(device)
    timer.start()
    run.step(inputs, targets, timer)
    return run


def trainer_state(run: train.Setup, args: argparse.Namespace, step: int) -> TrainerState:
    return TrainerState(
        step,
        step * args.global_batch,
        run.optimizers.scheduler_state(),
        torch.get_rng_state(),
        Ledger([[1, 0, args.global_batch]]),
    )


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``. Collective."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seconds)
    return max(everyone)


def shares(committed: str, world_size: int) -> list[int]:
    """Bytes of the checkpoint at ``committed`` by the rank that wrote them: each
    rank's shard files; rank 0 also everything else (metadata, ledger, manifest)."""
    owed = [0] * world_size
    for name in os.listdir(committed):
        match = _SHARD_FILE.fullmatch(name)
        owed[int(match.group(1)) if match else 0] += os.path.getsize(os.path.join(committed, name))
    return owed


def check_commit(committed: str, world_size: int) -> str:
    """What is wrong with a committed checkpoint's files ("" if nothing): the
    staging directory renamed, DCP's files, the ledger, the fence claimed for this
    generation and a manifest that verifies."""
    names = set(os.listdir(committed))
    expected = {METADATA_FILE, LEDGER_FILE, manifest.MANIFEST_FILE}
    missing = sorted(expected - names)
    shard_ranks = {int(m.group(1)) for m in map(_SHARD_FILE.fullmatch, names) if m}
    if missing or shard_ranks != set(range(world_size)):
        return f"{committed} holds {sorted(names)}"
    staging = [name for name in os.listdir(os.path.dirname(committed)) if name.endswith(".tmp")]
    if staging:
        return f"staging left beside it: {staging}"
    if fence.owner(os.path.dirname(committed)) != GENERATION:
        return (
            f"the fence names generation {fence.owner(os.path.dirname(committed))}, "
            f"not {GENERATION}"
        )
    verdict = verify.check_alone(committed)
    return "" if verdict.kind is verify.VerdictKind.OK else verdict.reason


def raw_write(directory: str, size: int, chunk: memoryview) -> None:
    """Writes ``size`` bytes to this rank's own file in ``directory`` and fsyncs it."""
    with open(os.path.join(directory, f"rank{dist.get_rank()}.bin"), "wb") as out:
        left = size
        while left:
            left -= out.write(chunk[: min(left, len(chunk))])
        out.flush()
        os.fsync(out.fileno())


def drop_cache(directory: str) -> None:
    """Evicts ``directory``'s files from the page cache (they are clean: fsynced)."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="where checkpoints and results go")
    parser.add_argument("--rounds", type=int, required=True, help="timed rounds, after one untimed")
    parser.add_argument(
        "--layouts", nargs="+", required=True, help="layouts on this world; saves use the first"
    )
    parser.add_argument(
        "--saves", action="store_true", help="time raw writes, sync and async saves"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="time verification and the commit of the first layout's checkpoint, and no loads",
    )
    parser.add_argument(
        "--load-into",
        nargs="*",
        default=None,
        metavar="LAYOUT",
        help="the layouts restores load into (default every one of --layouts)",
    )
    parser.add_argument(
        "--foreign",
        nargs="*",
        default=[],
        metavar="NAME@DIR",
        help="checkpoint directories saved by another launch, to load here",
    )
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    options = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rt = keel_runtime.init({**os.environ, keel_runtime.env.GENERATION: str(GENERATION)})
    args = train.parse_args(
        [
            "--steps",
            "1",
            "--no-preflight",
            "--dim",
            str(options.dim),
            "--layers",
            str(options.layers),
            "--heads",
            str(options.heads),
            "--global-batch",
            "4",
            "--seq-len",
            "16",
        ]
    )
    device = torch.device("cpu")
    clock = Clock()
    dcp.save = clock.wrap("dcp.save", dcp.save)
    dcp.async_save = clock.wrap("dcp.async_save", dcp.async_save)
    FileSystemWriter.write_data = clock.wrap("write_data", FileSystemWriter.write_data)
    dcp.load = clock.wrap("dcp.load", dcp.load)
    manifest.write = clock.wrap("manifest", manifest.write)
    verify.check = clock.wrap("verify", verify.check)

    layouts = {text: Layout.parse(text, world_size, source="--layouts") for text in options.layouts}
    runs = {text: built(args, layout, device) for text, layout in layouts.items()}
    work = os.path.join(options.workdir, f"w{world_size}")
    state_dict = clock.wrap("state_dict", checkpoint.state_dict)

    # One checkpoint per layout, kept for the loads (this launch's and another's).
    sources: dict[str, str] = {}
    for text, run in runs.items():
        saver = Checkpointer(
            os.path.join(options.workdir, "load", f"w{world_size}-{text}"),
            rt,
            use_async=False,
            keep=0,
            restored_from=None,
        )
        saver.save(
            1,
            args.global_batch,
            state_dict(run.parts, run.optimizers.optimizers, trainer_state(run, args, 1)),
            Ledger([[1, 0, args.global_batch]]),
            args.global_batch,
        )
        sources[f"{text} (world {world_size})"] = saver.checkpoint_dir
    for entry in options.foreign:
        name, directory = entry.split("@", 1)
        sources[name] = directory

    arms: list[tuple[str, object]] = []
    results: dict = {
        "times": {},
        "phases": {},
        "sources": sources,
        "commit_problems": {},
        "verdicts": {},
    }
    steps = iter(range(2, 1 << 30))
    if options.saves:
        run = runs[options.layouts[0]]
        sync = Checkpointer(
            os.path.join(work, "sync"), rt, use_async=False, keep=0, restored_from=None
        )
        background = Checkpointer(
            os.path.join(work, "async"), rt, use_async=True, keep=0, restored_from=None
        )
        sync._commit = clock.wrap("commit", sync._commit)
        background._commit = clock.wrap("commit", background._commit)
        raw_dir = os.path.join(work, "raw")
        os.makedirs(raw_dir, exist_ok=True)
        chunk = memoryview(os.urandom(CHUNK_BYTES))

        # One optimizer step of the trainer's own (TrainStep, as the loop calls it): the
        # next step after a save, beside which an async save's staging copy runs and
        # which waits for it before its optimizer step.
        layout = layouts[options.layouts[0]]
        first, count = rank_samples(0, args.global_batch, layout.dp_rank(rank), layout.dp_size)
        batch = SyntheticTokens(args.vocab, args.seq_len, args.seed).batch(first, count)
        run.step.before_update = background.before_update

        def train_step() -> None:
            timer = PhaseTimer(device)
            timer.start()
            run.step(*batch, timer)

        def step_alone() -> tuple[dict[str, float], dict[str, float]]:
            dist.barrier()
            started = time.perf_counter()
            train_step()
            times = {"blocked": slowest(time.perf_counter() - started)}
            return times, clock.take()

        def save(saver: Checkpointer) -> tuple[dict[str, float], dict[str, float]]:
            step = next(steps)
            saved = trainer_state(run, args, step)
            dist.barrier()
            started = time.perf_counter()
            saver.save(
                step,
                saved.samples,
                state_dict(run.parts, run.optimizers.optimizers, saved),
                saved.ledger,
                args.global_batch,
            )
            blocked_s = time.perf_counter() - started
            train_step()
            with_step_s = time.perf_counter() - started
            staging_wait_s = saver.take_update_wait_s()
            saver.wait()
            committed_s = time.perf_counter() - started
            phases = clock.take() | {
                "own blocked": blocked_s,
                "own with step": with_step_s,
                "own staging wait": staging_wait_s,
                "own to commit": committed_s,
            }
            times = {
                # What the loop waits in the checkpointer's calls: the save, and the next
                # step's wait for its staging copy before the optimizer step.
                "blocked": slowest(blocked_s + staging_wait_s),
                "with step": slowest(with_step_s),
                "to commit": slowest(committed_s),
            }
            if rank == 0:
                final = committed_steps(saver.checkpoint_dir)[step]
                kind = "async" if saver.use_async else "sync"
                if kind not in results["commit_problems"]:
                    results["commit_problems"][kind] = check_commit(final, world_size)
                    results["shares"] = shares(final, world_size)
                shutil.rmtree(final)
                os.sync()
            return times, phases

        def raw() -> tuple[dict[str, float], dict[str, float]]:
            dist.barrier()
            started = time.perf_counter()
            raw_write(raw_dir, owed[rank], chunk)
            if rank == 0:
                fsync_dir(raw_dir)
            times = {"blocked": slowest(time.perf_counter() - started)}
            phases = clock.take()
            dist.barrier()
            if rank == 0:
                for name in os.listdir(raw_dir):
                    os.remove(os.path.join(raw_dir, name))
                os.sync()
            return times, phases

        # What the raw write owes each rank: its share of a checkpoint the sync save made.
        save(sync)
        shared = [results.get("shares")]
        dist.broadcast_object_list(shared, src=0)
        owed = shared[0]
        arms += [
            ("train step", step_alone),
            ("raw write", raw),
            ("sync save", lambda: save(sync)),
            ("async save", lambda: save(background)),
        ]

    def load(source: str, target: str):
        def measure() -> tuple[dict[str, float], dict[str, float]]:
            run = runs[target]
            dist.barrier()
            if rank == 0:
                drop_cache(sources[source])
            dist.barrier()
            started = time.perf_counter()
            path = restore.choose(sources[source], rt).path
            chosen_s = time.perf_counter() - started
            checkpoint.load(
                path,
                run.parts,
                run.optimizers.optimizers,
                TrainerState(0, 0, run.optimizers.scheduler_state(), torch.get_rng_state()),
            )
            loaded_s = time.perf_counter() - started
            phases = clock.take()
            return {
                "choose": slowest(chosen_s),
                "blocked": slowest(loaded_s),
                "load": slowest(loaded_s - chosen_s),
            }, phases

        return measure

    if options.verify:
        run = runs[options.layouts[0]]
        verified = committed_path(sources[f"{options.layouts[0]} (world {world_size})"], 1)
        committer = Checkpointer(
            os.path.join(work, "commit"), rt, use_async=False, keep=0, restored_from=None
        )
        committer._commit = clock.wrap("commit", committer._commit)
        if rank == 0:
            results["verified_bytes"] = manifest.read(verified).size_bytes

        def commit() -> tuple[dict[str, float], dict[str, float]]:
            step = next(steps)
            saved = trainer_state(run, args, step)
            dist.barrier()
            started = time.perf_counter()
            committer.save(
                step,
                saved.samples,
                state_dict(run.parts, run.optimizers.optimizers, saved),
                saved.ledger,
                args.global_batch,
            )
            times = {"save": slowest(time.perf_counter() - started)}
            phases = clock.take()
            if rank == 0:
                final = committed_steps(committer.checkpoint_dir)[step]
                # What the commit read back before sums were taken while writing: every
                # file read again and summed, at once, as warm as that commit found them.
                began = time.perf_counter()
                verdict = verify.check_alone(final)
                times |= {"commit": phases["commit"], "read-back": time.perf_counter() - began}
                results["verdicts"].setdefault(
                    "read-back", f"{verdict.kind.value}: {verdict.reason}"
                )
                shutil.rmtree(final)
                os.sync()
            dist.barrier()
            return times, phases

        def verification(alone: bool):
            def measure() -> tuple[dict[str, float], dict[str, float]]:
                dist.barrier()
                if rank == 0:
                    drop_cache(verified)
                dist.barrier()
                started = time.perf_counter()
                if not alone:
                    verdict = verify.check(verified)
                elif rank == 0:
                    verdict = verify.check_alone(verified)
                times = {"verify": slowest(time.perf_counter() - started)}
                if rank == 0:
                    results["verdicts"].setdefault(
                        "alone" if alone else "check", f"{verdict.kind.value}: {verdict.reason}"
                    )
                return times, clock.take()

            return measure

        arms += [
            ("commit", commit),
            (f"verify.check, {world_size} ranks", verification(alone=False)),
            ("verify.check_alone, rank 0", verification(alone=True)),
        ]
    else:
        arms += [
            (f"load {source} -> {target}", load(source, target))
            for source in sources
            for target in options.load_into or runs
        ]
    for round_index in range(options.rounds + 1):
        shift = round_index % len(arms)
        for name, measure in arms[shift:] + arms[:shift]:
            clock.take()
            times, phases = measure()
            if round_index == 0:
                continue  # the first round warms every path up
            results["times"].setdefault(name, []).append(times)
            results["phases"].setdefault(name, []).append(phases)
    if rank == 0:
        with open(os.path.join(options.workdir, f"results-w{world_size}.json"), "w") as out:
            json.dump(results, out)
    dist.barrier()
    rt.close()
    train.shut_down_process_group()
    train.exit_without_finalizing(0)


if __name__ == "__main__":
    main()
