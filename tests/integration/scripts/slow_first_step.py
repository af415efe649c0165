"""A torchrun-style script that knows nothing of Keel and takes its time before its
first collective (a long data load, a compile): it must not be judged hung for that.

Usage: slow_first_step.py MARKER_DIR SECONDS. Each rank sleeps SECONDS, all-reduces,
and appends "world=N" to MARKER_DIR/done-<rank>.
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    marker_dir, seconds = Path(sys.argv[1]), float(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    time.sleep(seconds)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world, t
    with open(marker_dir / f"done-{rank}", "a") as f:
        f.write(f"world={world}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
