"""A rank that reports steps through trainer.runtime and starts a helper process that
leaves its process group (as a data server or a profiler might), for agent-restart tests.

Usage: stepper_with_helper.py MARKER_DIR STEPS. Each rank starts ``sleep 600`` in a new
session and writes its pid to MARKER_DIR/helper-g<generation>-r<rank>. Before its first
step, a rank of generation 2 or later writes to MARKER_DIR/alive-g<generation>-r<rank>
the pids of earlier generations' helpers that are still alive (none, if the agents
cleaned up after them).
"""

import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer import runtime


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def main() -> None:
    marker_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    rt = runtime.init()
    dist.init_process_group("gloo")
    helper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    (marker_dir / f"helper-g{rt.generation}-r{rt.rank}").write_text(str(helper.pid))
    if rt.generation > 1:
        earlier = [
            p for p in marker_dir.glob("helper-g*") if int(p.name.split("-")[1][1:]) < rt.generation
        ]
        survivors = [int(p.read_text()) for p in earlier if alive(int(p.read_text()))]
        (marker_dir / f"alive-g{rt.generation}-r{rt.rank}").write_text(
            " ".join(map(str, survivors))
        )
    for step in range(1, steps + 1):
        started = time.monotonic()
        t = torch.ones(4)
        dist.all_reduce(t)
        time.sleep(0.1)
        rt.report_step(step, loss=1.0 / step, tokens=4, step_time_s=time.monotonic() - started)
    dist.barrier()
    dist.destroy_process_group()
    rt.close()
    helper.kill()


if __name__ == "__main__":
    main()
