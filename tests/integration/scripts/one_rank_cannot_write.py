"""Saves a checkpoint after each step with ``trainer.checkpoint`` (asynchronously) on
every rank of a torchrun launch, while one rank's files may not grow past a few KiB at
one step: that rank's write of its shard fails (EFBIG, as a write on a full disk fails
with ENOSPC) and every other rank's succeeds.

Usage: one_rank_cannot_write.py CHECKPOINT_DIR STEPS LIMITED_RANK LIMITED_STEP. After
each save every rank all-reduces its step: none may be left behind in a collective.
Each rank prints {"rank": R, "steps": [...]} (the steps it went on from) at the end.
"""

import json
import resource
import signal
import sys

import torch
import torch.distributed as dist

from trainer import runtime as keel_runtime
from trainer.checkpoint import Checkpointer
from trainer.ledger import Ledger

LIMIT_BYTES = 4096


def main() -> None:
    directory, steps = sys.argv[1], int(sys.argv[2])
    limited_rank, limited_step = int(sys.argv[3]), int(sys.argv[4])
    rt = keel_runtime.init()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    saver = Checkpointer(directory, rt, use_async=True, keep=0, restored_from=None)
    went_on = []
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for step in range(1, steps + 1):
        # A shard of its own on each rank (400 KB), far over the limit.
        state = {"model": {f"rank{rank}.w": torch.full((100_000,), float(step))}}
        limited = rank == limited_rank and step == limited_step
        if limited:
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, hard))
        saver.save(step, step * 16, state, Ledger(), 16)
        saver.wait()
        if limited:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        together = torch.tensor([step])
        dist.all_reduce(together)
        assert together.item() == step * dist.get_world_size(), together
        went_on.append(step)
    # One write per line: the ranks share torchrun's stdout, and print writes the text
    # and the newline apart, two writes on an unbuffered stdout; two ranks' lines were
    # seen interleaved into one in CI.
    sys.stdout.write(json.dumps({"rank": rank, "steps": went_on}) + "\n")
    sys.stdout.flush()
    saver.settle(10)
    rt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
