"""Durable, asynchronous, reshardable checkpoints with ``torch.distributed.checkpoint``
(DCP).

Layout under the job's checkpoint directory::

    step_00000010/                 committed: complete, durable, atomically renamed
        .metadata                  DCP's global plan, written last by the coordinator
        __0_0.distcp  __1_0.distcp one shard file per saving rank
        ledger.json                the data ledger of the lineage (``trainer.ledger``)
        manifest.json              every other file's size and CRC-32, and the job, its
                                   lineage and the generation that wrote it
                                   (``trainer.manifest``)
    .step_00000015.g3.tmp/         being written by generation 3; never loaded
    .step_00000005.g3.expired.tmp/ removed by retention, being deleted; never loaded
    .quarantine.step_00000020.g4/  failed verification when generation 4 restored it;
                                   kept for a person to look at, never loaded
    .fence, .fence.lock            which generation owns the directory (``trainer.fence``)
    .faults/                       one-shot fault markers (see ``trainer.runtime``)

A checkpoint holds the model and optimizer under their global parameter names
(FSDP2/tensor-parallel DTensors and pipeline stages alike, through DCP's
state-dict helpers over every model part), so it loads under any world size and any
layout: DCP reads whichever pieces of each tensor a rank now owns. Beside them, the
trainer state: steps done, samples consumed, the LR scheduler, the RNG state and the
data ledger.

A save is staged (copied to CPU memory) on a thread of its own beside the next step's
forward and backward (the step waits for the copy before its optimizer changes the
state: ``Checkpointer.before_update``), written in a background thread while training
goes on, and committed by rank 0 on a thread of its own once the
write is complete: the manifest, fsyncs, atomic rename to ``step_<08d>``, report to
the agent, then retention. One save is in flight at a time. Only the generation that
owns the directory (``trainer.fence``) commits, removes or cleans up there.

The manifest's sums are taken while writing, not by reading back: every rank writes
through a ``SummingWriter`` (``trainer.summing_writer``), which sums each file's bytes
on their way to the disk and hands the sums to DCP's coordinator with its write
results; rank 0's commit writes them (and the ledger's, which it reads: a few bytes of
its own) into the manifest.

Durability: a committed checkpoint survives power loss. The fsyncs are split between
DCP and us. ``dcp.save``/``dcp.async_save`` write through a ``SummingWriter``, DCP's
``FileSystemWriter`` with ``sync_files=True`` as its default is, under which every
rank fsyncs each shard file it wrote before reporting its write done, and the
coordinator fsyncs ``.metadata`` (as ``.metadata.tmp``) before renaming it into place;
all of that happens before rank 0's save completes. DCP fsyncs no directory, and the
ledger is ours, so the commit fsyncs ``ledger.json``, then the staging directory (making
the entries of the shard files, ``.metadata`` and ``ledger.json`` durable), renames it,
and fsyncs the checkpoint directory (making the new name durable). Never pass DCP a
writer with ``sync_files=False``: the shard files would then go unsynced.

A save that fails on storage (``trainer.storage_faults``: a write refused on any rank
for no space left, a quota or an I/O error, or the commit's) is not the run's
failure: rank 0 removes its staging directory (under the fence, giving its space back),
logs one line and reports a ``save_failed`` checkpoint problem, every rank goes on
training, and the next save is tried on schedule; the failed one is not retried. Every
rank agrees that it failed: DCP's save is collective, its coordinator gathers each
rank's write result and broadcasts one outcome, so a write that failed on one rank
raises ``CheckpointException`` on all of them, the async write's through its future.
What only rank 0 does (preparing the staging directory, the commit) fails on rank 0
alone, before the save's collective or after it, where no peer waits for it. A refusal
(``fence.Superseded``) and a fence lock held past its deadline (``fence.FenceTimeout``)
still fail the rank.

Retention (and the replacement of an unrecorded checkpoint) renames a checkpoint aside
to a ``.tmp`` name, durably, and deletes it in a background thread, so the training
thread, and the ranks waiting for rank 0's commit, do not wait for the files to go.
``wait`` waits for those deletions; ``discard_staging`` removes any a crash left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from trainer import fence, manifest
from trainer.checkpoint_dir import (
    committed_path,
    committed_steps,
    expired,
    fsync_dir,
    fsync_file,
    staging_path,
)
from trainer.ledger import LEDGER_FILE, Ledger
from trainer.runtime import Runtime
from trainer.storage_faults import report_fence_timeout, storage_fault
from trainer.summing_writer import SummingWriter

# Optimizer state keyed per parameter name ("state.layers.0.mlp.w1.weight.exp_avg"),
# not as one param_groups list per rank: ranks of different pipeline stages hold
# different parameters, and a per-rank list would not survive a change of layout.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainerState:
    """What besides the weights a resume needs. ``step``: optimizer steps done;
    ``samples``: global data position (samples consumed by all ranks); ``scheduler``:
    the LR scheduler's ``state_dict()``; ``rng_state``: ``torch.get_rng_state()``, the
    same on every rank because no rank draws rank-specific numbers, so one copy serves
    any world size; ``ledger``: the lineage's consumed sample ranges."""

    step: int
    samples: int
    scheduler: dict
    rng_state: torch.Tensor
    ledger: Ledger = field(default_factory=Ledger)

    def to_state_dict(self) -> dict:
        # Numbers as tensors: DCP loads tensors in place, so the same dict serves as
        # the load target. The scheduler and ledger are small Python objects, which
        # DCP stores pickled and replaces on load.
        return {
            "step": torch.tensor(self.step, dtype=torch.int64),
            "samples": torch.tensor(self.samples, dtype=torch.int64),
            "scheduler": self.scheduler,
            "rng_state": self.rng_state.clone(),
            "ledger": [list(entry) for entry in self.ledger.ranges],
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> TrainerState:
        return cls(
            step=int(state["step"]),
            samples=int(state["samples"]),
            scheduler=state["scheduler"],
            rng_state=state["rng_state"],
            ledger=Ledger(state["ledger"]),
        )


def state_dict(
    parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], trainer: TrainerState
) -> dict:
    """What a checkpoint holds: ``model`` and ``optim`` keyed by global parameter name
    over this rank's model ``parts`` (pipeline stages, or the one whole model) and
    their ``optimizers`` (one per part), and ``trainer``."""
    model_state: dict = {}
    optimizer_state: dict = {}
    for part, optimizer in zip(parts, optimizers):
        model_state.update(get_model_state_dict(part, options=STATE_DICT_OPTIONS))
        optimizer_state.update(
            get_optimizer_state_dict(part, optimizer, options=STATE_DICT_OPTIONS)
        )
    return {"model": model_state, "optim": optimizer_state, "trainer": trainer.to_state_dict()}


def load_target(
    parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], template: TrainerState
) -> tuple[dict, list[tuple[dict, dict]]]:
    """The state a checkpoint is loaded into, over this rank's model ``parts`` and
    their ``optimizers`` (``template``: the trainer state's shape), and each part's
    model and optimizer state dicts in it."""
    per_part = [
        (
            get_model_state_dict(part, options=STATE_DICT_OPTIONS),
            get_optimizer_state_dict(part, optimizer, options=STATE_DICT_OPTIONS),
        )
        for part, optimizer in zip(parts, optimizers)
    ]
    target = {
        "model": {key: value for model_state, _ in per_part for key, value in model_state.items()},
        "optim": {
            key: value for _, optimizer_state in per_part for key, value in optimizer_state.items()
        },
        "trainer": template.to_state_dict(),
    }
    return target, per_part


def load(
    path: str,
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    template: TrainerState,
    storage_reader: StorageReader | None = None,
    target: tuple[dict, list[tuple[dict, dict]]] | None = None,
) -> TrainerState:
    """Loads the checkpoint at ``path`` into ``parts`` and their ``optimizers``,
    resharding to the current layout, and returns its trainer state (``template``
    gives its shape: the current scheduler's state dict and RNG state).
    ``storage_reader``: how to read it, where not DCP's files (a memory snapshot:
    ``memory_tier.SnapshotReader``, whose every file the rank reads is on its node:
    each rank then plans its reads alone, from its node's metadata, without DCP's
    planning round). ``target``: ``load_target``'s, where the caller built it already
    (for ``memory_tier.files_read``). Collective, but with a ``storage_reader``."""
    state, per_part = target or load_target(parts, optimizers, template)
    dcp.load(
        state,
        checkpoint_id=path,
        storage_reader=storage_reader,
        no_dist=storage_reader is not None,
    )
    # DCP fills tensors in place but replaces other values (learning rates, step
    # counts kept as numbers), so each part takes its keys back from the loaded dict.
    for (part, optimizer), (model_state, optimizer_state) in zip(zip(parts, optimizers), per_part):
        set_model_state_dict(
            part, {key: state["model"][key] for key in model_state}, options=STATE_DICT_OPTIONS
        )
        set_optimizer_state_dict(
            part,
            optimizer,
            {key: state["optim"][key] for key in optimizer_state},
            options=STATE_DICT_OPTIONS,
        )
    return TrainerState.from_state_dict(state["trainer"])


@dataclass
class _Pending:
    """A save written in the background, to be committed when ``future`` is done."""

    step: int
    samples: int
    staging: str
    future: Future
    started: float  # perf_counter seconds, when its save began
    writer: SummingWriter  # on rank 0, the sums of every file once it is written


class Checkpointer:
    """Saves checkpoints of one run and commits them, one save at a time.

    ``save`` starts the staging copy and returns; ``before_update`` (before the next
    optimizer step) waits for the copy to end; ``poll`` (each step, non-blocking) and
    ``wait`` (before the next save and at exit, blocking) see to a save whose write
    finished: rank 0 then commits it (manifest, fsyncs, rename, report, retention) on a
    thread of its own, so neither it nor its peers wait for the commit. With
    ``use_async`` False, ``save`` writes and commits before returning. Every rank calls
    ``save`` and ``wait`` at the same steps; rank 0 alone commits. Checkpoints that
    retention removes are deleted in the background; ``wait`` (hence also ``save``)
    waits for the commit and those deletions, and raises if one failed.

    Every destructive step runs held under the generation's fence (``trainer.fence``):
    a commit, a retention or a cleanup of a generation that has been superseded is
    refused (one log line, reported to the agent) and the save fails.

    A save that fails on storage (``storage_fault``) is skipped on every rank: rank 0
    removes its staging directory, logs it and reports a ``save_failed`` problem, and
    ``save``, ``poll`` and ``wait`` return as after a save that was never asked for.

    ``keep``: committed checkpoints kept after each commit (0: all); never deleted: the
    checkpoint this run loaded (``restored_from``) and the newest one the controller
    recorded (``Runtime.recorded_step``). ``lineage``: the job ids whose checkpoints
    this run continues, origin first, this job's last, written into every manifest with
    the job and generation (default: this job's id alone; () outside Keel).
    ``take_blocked_s`` says how long ``save`` and ``poll`` held up the caller, for the
    step reports."""

    def __init__(
        self,
        checkpoint_dir: str,
        runtime: Runtime,
        *,
        use_async: bool,
        keep: int,
        restored_from: str | None,
        lineage: tuple[str, ...] = (),
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.runtime = runtime
        job_id = runtime.job_id
        self.lineage = lineage or ((job_id,) if job_id else ())
        self.use_async = use_async
        self.keep = keep
        self.restored_from = os.path.abspath(restored_from) if restored_from else None
        # Its own, fixed: a rank that restarts in place moves its Runtime to the next
        # generation, and nothing of this one may act as that one.
        self.generation = runtime.generation
        self._rank = dist.get_rank()
        self._pending: _Pending | None = None
        self._blocked_s = 0.0
        # Rank 0 commits async saves on one thread and deletes removed checkpoints on
        # another, both off the training thread.
        self._committer: ThreadPoolExecutor | None = None
        self._commit_future: Future | None = None
        self._deleter: ThreadPoolExecutor | None = None
        self._deletions: list[Future] = []
        self._deletions_lock = threading.Lock()
        # DCP's background writer gathers write results on this group while the
        # training loop runs its own collectives on the default one; sharing a group
        # between threads would interleave them. Gloo, because async save coordinates
        # through CPU tensors even on GPU jobs.
        self._group = dist.new_group(backend="gloo")
        # One stager for the run: it keeps the CPU copy it staged into and reuses it on
        # the next save (pinned on a GPU, for fast copies), where a stager per save
        # would allocate and fault in the whole state again each time. It copies on a
        # thread of its own, beside the next step's forward and backward; the step
        # waits for the copy before its optimizer changes the state (``before_update``).
        self._stager = (
            DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=torch.cuda.is_available(),
                )
            )
            if use_async
            else None
        )
        self._staging: Future | None = None  # the copy in flight, until it is waited for
        self._update_wait_s = 0.0

    def save(self, step: int, samples: int, state: dict, ledger: Ledger, global_batch: int) -> None:
        """Starts the checkpoint of step ``step`` (``samples``: global data position
        after it) from ``state`` (see ``state_dict``); rank 0 writes the ledger into the
        staging directory first. Returns once the state's staging copy has started
        (``use_async``: ``before_update`` waits for it to end) or once it is
        committed. Collective."""
        started = time.perf_counter()
        self.wait()
        staging = staging_path(self.checkpoint_dir, step, self.generation)
        prepared = True
        if self._rank == 0:
            try:
                self._prepare(step, staging, ledger, global_batch)
            except Exception as error:
                if not self._save_failed(step, staging, error):
                    raise
                prepared = False
        if not self._all_prepared(prepared):
            self._blocked_s += time.perf_counter() - started
            return
        writer = SummingWriter(staging)
        if self.use_async:
            response = dcp.async_save(
                state, storage_writer=writer, process_group=self._group, async_stager=self._stager
            )
            if isinstance(response, AsyncSaveResponse):
                self._staging, future = response.staging_completion, response.upload_completion
            else:
                future = response
            pending = _Pending(step, samples, staging, future, started, writer)
            if self._rank == 0:
                # Committed as soon as it is written, by the committer thread: not when
                # the training loop next looks, which may be blocked in a collective on
                # a hung peer while the checkpoint is as good as done.
                if self._committer is None:
                    self._committer = ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="keel-checkpoint-commit"
                    )
                self._commit_future = self._committer.submit(self._commit_when_written, pending)
            else:
                self._pending = pending
        else:
            try:
                with self._superseded_if_lost(step, staging):
                    dcp.save(state, storage_writer=writer, process_group=self._group)
                committed = self._commit(step, samples, staging, started, writer.sums)
            except (Exception, CheckpointException) as error:
                if not self._save_failed(step, staging, error):
                    raise
                committed = False
            if committed:
                self._retain(step)
        self._blocked_s += time.perf_counter() - started

    def _prepare(self, step: int, staging: str, ledger: Ledger, global_batch: int) -> None:
        """Rank 0: an empty staging directory for ``step`` holding the ledger."""
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        # An earlier incarnation of this generation (torchrun restarts keep the
        # generation) may have died while writing this step; its shards must not mix
        # with ours.
        with self._fenced(step, staging):
            shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        ledger.write(staging, global_batch, step)

    def _all_prepared(self, prepared: bool) -> bool:
        """Whether rank 0 prepared the save's staging directory (``prepared``, there),
        on every rank. In place of a barrier before DCP's collective save: a save that
        rank 0 could not prepare is skipped by every rank together, not waited for."""
        flag = torch.tensor([int(prepared)], dtype=torch.int64)
        dist.broadcast(flag, src=0, group=self._group)
        return bool(flag.item())

    def poll(self) -> None:
        """Raises if the save in flight failed to write (ranks but 0) or to commit (rank
        0) other than on storage (see ``_save_failed``); never blocks."""
        if self._pending is not None and self._pending.future.done():
            self._written()
        if self._commit_future is not None and self._commit_future.done():
            self._commit_future, done = None, self._commit_future
            done.result()

    def take_blocked_s(self) -> float:
        """Seconds ``save`` and ``before_update`` blocked their caller (a synchronous
        write and commit, the wait for the previous save, the wait for the staging
        copy) since the last call."""
        blocked_s, self._blocked_s = self._blocked_s, 0.0
        return blocked_s

    def take_update_wait_s(self) -> float:
        """Seconds of them ``before_update`` held up a step since the last call (the
        step's own time, which peers compare, is without them)."""
        waited_s, self._update_wait_s = self._update_wait_s, 0.0
        return waited_s

    def before_update(self) -> None:
        """Returns once the staging copy of the save in flight has ended: called before
        the optimizer changes the state it copies. A copy that failed fails the save,
        which ``poll`` and ``wait`` see to."""
        waited_s = self._staged()
        self._update_wait_s += waited_s
        self._blocked_s += waited_s

    def _staged(self) -> float:
        """Waits for the staging copy in flight to end, however it ends; the seconds
        waited."""
        staging, self._staging = self._staging, None
        if staging is None or staging.done():
            return 0.0
        started = time.perf_counter()
        futures_wait([staging])
        return time.perf_counter() - started

    def wait(self) -> None:
        """Blocks until the save in flight is written and committed, and until the
        checkpoints removed so far are deleted (the process may end after this call
        without running its threads to completion)."""
        self._staged()
        if self._pending is not None:
            self._written()
        if self._commit_future is not None:
            self._commit_future, done = None, self._commit_future
            done.result()
        with self._deletions_lock:
            deletions, self._deletions = self._deletions, []
        for deletion in deletions:
            deletion.result()

    def settle(self, timeout_s: float) -> bool:
        """After the run failed: waits up to ``timeout_s`` for the save in flight (its
        write, its commit) and the deletions to end, however they end (their errors are
        logged, not raised); whether all did. A rank whose threads did not end may not
        restart in place: they would go on writing as this generation."""
        deadline = time.monotonic() + timeout_s
        pending = [
            f
            for f in (
                self._staging,
                self._pending.future if self._pending else None,
                self._commit_future,
            )
            if f is not None
        ]
        with self._deletions_lock:
            pending += self._deletions
        for future in pending:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                return False
            except BaseException as error:  # CheckpointException is one
                self.runtime.log(
                    f"a checkpoint operation failed with the run: "
                    f"{type(error).__name__}: {str(error)[:200]}"
                )
        self._pending = self._commit_future = self._staging = None
        for pool in (self._committer, self._deleter):
            if pool is not None:
                pool.shutdown(wait=False)
        if self._stager is not None:
            self._stager.close()  # its copy of the state goes with the generation
        return True

    def _written(self) -> None:
        """Waits for this rank's write in flight. One that failed on storage is
        skipped (``_save_failed``); any other failure raises and fails the rank: an
        uncommitted checkpoint must not look like progress."""
        pending, self._pending = self._pending, None
        try:
            with self._superseded_if_lost(pending.step, pending.staging):
                pending.future.result()
        except (Exception, CheckpointException) as error:
            if not self._save_failed(pending.step, pending.staging, error):
                raise

    def _commit_when_written(self, pending: _Pending) -> None:
        try:
            with self._superseded_if_lost(pending.step, pending.staging):
                pending.future.result()
            committed = self._commit(
                pending.step, pending.samples, pending.staging, pending.started, pending.writer.sums
            )
        except (Exception, CheckpointException) as error:
            if not self._save_failed(pending.step, pending.staging, error):
                raise
            committed = False
        if committed:
            self._retain(pending.step)

    def _save_failed(self, step: int, staging: str, error: BaseException) -> bool:
        """Whether ``error``, which failed the save of ``step``, is a storage fault
        (``storage_fault``) that training goes on after. On rank 0 such a save's
        staging directory is removed, under the fence (a refusal or a lock held too
        long raises), and the fault logged and reported as ``save_failed``."""
        fault = storage_fault(error)
        if fault is None:
            return False
        if self._rank == 0:
            # Its space back at once, and nothing half written left in the directory.
            with self._fenced(step, staging):
                shutil.rmtree(staging, ignore_errors=True)
            reason = f"the save of step {step} failed: {fault}"
            self.runtime.log(
                f"checkpoint of step {step} not saved ({fault}); training goes on, "
                f"the next save is tried on schedule",
                step=step,
            )
            self.runtime.report_checkpoint_problem(step, staging, "save_failed", reason)
        return True

    @contextlib.contextmanager
    def _superseded_if_lost(self, step: int, staging: str):
        """A write that fails because a newer generation took the directory (and
        cleaned up this one's staging) is that generation's refusal, and says so."""
        try:
            yield
        # DCP raises CheckpointException, a BaseException, for a failed write.
        except (Exception, CheckpointException) as error:
            owner = fence.owner(self.checkpoint_dir)
            if owner <= self.generation or self.generation == 0:
                raise
            refused = fence.Superseded(self.checkpoint_dir, self.generation, owner)
            self.runtime.log(
                f"refusing to change checkpoint step {step}: {refused} (its write "
                f"failed: {type(error).__name__})"
            )
            self.runtime.report_checkpoint_problem(step, staging, "stale_commit", str(refused))
            raise refused from error

    @contextlib.contextmanager
    def _fenced(self, step: int, path: str):
        """Hold the generation's fence around a destructive step; a superseded
        generation's step is refused: one log line, reported to the agent, raised. A
        lock held past the deadline is reported with its holder's node and raised."""
        generation = self.generation
        try:
            with fence.held(
                self.checkpoint_dir,
                generation,
                self.runtime.job_id,
                timeout_s=self.runtime.fence_timeout_s,
                node=self.runtime.node,
            ):
                yield
        except fence.Superseded as refused:
            self.runtime.log(f"refusing to change checkpoint step {step}: {refused}")
            self.runtime.report_checkpoint_problem(step, path, "stale_commit", str(refused))
            raise
        except fence.FenceTimeout as stalled:
            report_fence_timeout(self.runtime, step, stalled)
            raise

    def _commit(
        self,
        step: int,
        samples: int,
        staging: str,
        started: float,
        sums: dict[str, manifest.FileSum],
    ) -> bool:
        """Make the written checkpoint of ``step`` durable under its committed name and
        report it (with the seconds since its save ``started``, perf_counter); whether
        this rank did (rank 0 does, the others return False). ``sums``: every file DCP
        wrote, summed as it wrote them (``SummingWriter``). Retention is the caller's,
        once the commit stands."""
        # DCP's coordinator (rank 0) writes the metadata only after gathering every
        # rank's write results, so rank 0's write being done means everyone's is, and
        # DCP has fsynced every shard file and .metadata (see the module docstring).
        if self._rank != 0:
            return False
        final = committed_path(self.checkpoint_dir, step)
        # What DCP leaves unsynced: our ledger and the staging directory's entries;
        # and the manifest, written (and fsynced) once every other file is there, from
        # the sums taken while writing: nothing DCP wrote is read back. A newer
        # generation may have cleaned this staging directory up meanwhile: then that
        # is its refusal, not a crash.
        with self._superseded_if_lost(step, staging):
            fsync_file(os.path.join(staging, LEDGER_FILE))
            record = manifest.Manifest(
                step=step,
                files=sums | manifest.checksum(staging, [LEDGER_FILE]),
                job_id=self.runtime.job_id,
                job=self.runtime.job,
                lineage=self.lineage,
                generation=self.generation,
            )
            manifest.write(staging, record)
            fsync_dir(staging)
        size = record.size_bytes
        with self._fenced(step, staging):
            if os.path.exists(final):
                # Whoever wrote it died before the controller recorded it, or the job
                # was restored from an earlier checkpoint: it was never committed. Move
                # it to a name that is never loaded before deleting, so a crash mid-delete
                # leaves no half checkpoint under a committed name.
                self.runtime.log(f"replacing unrecorded checkpoint {final}")
                self._remove(final, step, "discarded")
            os.rename(staging, final)
            fsync_dir(self.checkpoint_dir)
        self.runtime.report_checkpoint(
            step, os.path.abspath(final), samples, save_s=time.perf_counter() - started, size=size
        )
        return True

    def _retain(self, committed_step: int) -> None:
        found = committed_steps(self.checkpoint_dir)
        protected = {committed_step, self.runtime.recorded_step} | {
            step for step, path in found.items() if os.path.abspath(path) == self.restored_from
        }
        doomed = expired(list(found), self.keep, protected)
        if not doomed:
            return
        with self._fenced(committed_step, self.checkpoint_dir):
            for step in doomed:
                self._remove(found[step], step, "expired")
        self.runtime.log(
            f"retention (--keep-checkpoints {self.keep}) deleted checkpoints of steps "
            f"{', '.join(map(str, doomed))}"
        )

    def _remove(self, path: str, step: int, why: str) -> None:
        """Renames ``path`` to a name that is never loaded, durably, and deletes it in
        the background: a crash mid-delete leaves no half checkpoint under a committed
        name, only a ``.tmp`` directory that ``discard_staging`` removes. Called with
        the fence held."""
        doomed = os.path.join(self.checkpoint_dir, f".step_{step:08d}.g{self.generation}.{why}.tmp")
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(path, doomed)
        fsync_dir(self.checkpoint_dir)
        with self._deletions_lock:
            if self._deleter is None:
                self._deleter = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="keel-checkpoint-delete"
                )
            self._deletions.append(self._deleter.submit(delete_removed, doomed))


def delete_removed(path: str) -> None:
    """Deletes a checkpoint renamed to a ``.tmp`` name by ``Checkpointer._remove``.
    Another process may delete it meanwhile (a newer generation's ``discard_staging``
    removes every ``.tmp`` directory it finds, a superseded generation's among them):
    what is already gone is deleted; any other error (a read-only or failing disk) is
    raised, not hidden, since the space would never come back."""

    def gone_already(function, name, exc_info) -> None:
        if not isinstance(exc_info[1], FileNotFoundError):
            raise exc_info[1]

    shutil.rmtree(path, onerror=gone_already)
