"""A rank that tries to read what is its agent's, then reports steps.

Usage: reads_agent_secrets.py OUT_DIR STEPS PATH... Rank R of generation G writes
OUT_DIR/rankR-gG.json: its uid, gid and supplementary groups, and for each PATH and
for its agent's (its parent's) ``/proc/PID/environ``, "read" or the name of the error
that stopped the read. Then it reports STEPS steps through trainer.runtime. With
FAIL_FIRST=1 in its environment, rank 1 of generation 1 then waits 3 s and exits 3
instead (its job restarts; the next generation's ranks may come from warm processes).
"""

import json
import os
import sys
import time
from pathlib import Path

from trainer import runtime


def attempt(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            handle.read()
    except OSError as exc:
        return type(exc).__name__
    return "read"


def main() -> None:
    out, steps, *paths = sys.argv[1:]
    rt = runtime.init()
    paths.append(f"/proc/{os.getppid()}/environ")
    found = {
        "uid": os.getuid(),
        "gid": os.getgid(),
        "groups": os.getgroups(),
        "reads": {path: attempt(path) for path in paths},
    }
    (Path(out) / f"rank{rt.rank}-g{rt.generation}.json").write_text(json.dumps(found))
    if os.environ.get("FAIL_FIRST") == "1" and (rt.generation, rt.rank) == (1, 1):
        time.sleep(3)
        sys.exit(3)
    for step in range(1, int(steps) + 1):
        rt.report_step(step, loss=1.0 / step, tokens=4, step_time_s=0.01)
    rt.close()


if __name__ == "__main__":
    main()
