"""Holds a checkpoint directory's fence lock through ``trainer.fence`` as an old
generation's rank 0 does inside a fenced step (a commit, a retention), and stays inside
it until it is killed: what a rank 0 stalled there (stopped, or in uninterruptible I/O)
looks like to the next generation.

Usage: hold_fence.py CHECKPOINT_DIR, with KEEL_GENERATION and KEEL_NODE set as Keel
sets them. Prints "held" once it holds the lock.
"""

import signal
import sys

from trainer import fence
from trainer import runtime as keel_runtime


def main() -> None:
    rt = keel_runtime.init()
    with fence.held(sys.argv[1], rt.generation, timeout_s=rt.fence_timeout_s, node=rt.node):
        print("held", flush=True)
        while True:
            signal.pause()


if __name__ == "__main__":
    main()
