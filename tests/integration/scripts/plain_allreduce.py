"""A torchrun-style script that knows nothing of Keel: all-reduces, and fails once.

Usage: plain_allreduce.py MARKER_DIR [ITERATIONS]. Rank 1 exits with code 3 the first
time it runs (it leaves MARKER_DIR/failed-once behind), so a supervisor must restart
the job for it to complete. Each completed run appends a line to MARKER_DIR/done-<rank>.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    marker_dir = Path(sys.argv[1])
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(iterations):
        t = torch.ones(4) * rank
        dist.all_reduce(t)
        assert t[0].item() == sum(range(world)), t
    marker = marker_dir / "failed-once"
    if rank == 1 and not marker.exists():
        marker.touch()
        print("rank 1 failing on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    dist.barrier()
    with open(marker_dir / f"done-{rank}", "a") as f:
        f.write(f"restart={os.environ.get('TORCHELASTIC_RESTART_COUNT')} world={world}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
