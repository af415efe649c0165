"""A warm rank process (``agent.pool``): Python started, torch and the distributed
stack imported (and on a GPU node, its slot's CUDA context created) before any rank
is asked of it. It then
waits for its assignment, one JSON line on stdin, and becomes that rank as ``python
-u SCRIPT ARGS`` or ``python -u -m MODULE ARGS`` would have been started: the same
``sys.argv``, ``__main__``, ``sys.path[0]``, environment, working directory, standard
streams (the rank's files), signals (Python's defaults) and exit status (an uncaught
exception prints its traceback and exits 1; ``sys.exit`` passes its code).

The assignment: ``{"args": [...after the interpreter...], "env": {...}, "cwd": "...",
"stdout": PATH, "stderr": PATH}``. End of input before one: the pool is closing; exit 0.
Once its imports are done it writes ``ready`` on its stdout, a pipe to the pool.
Its arguments: the pool slot's path, which only names it in ``ps`` (the rank it
becomes keeps this process's command line), and the modules to import ahead.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from common.adopt import redirect, take_environment, take_output

SLOT = "KEEL_WARM_SLOT"  # the local rank this process is warmed for (its GPU)


# What a warm process imports ahead of its rank (``keel agent --warm-imports``): torch,
# the distributed stack a composite-parallel trainer loads (checkpoints, FSDP,
# DTensor), and torch._dynamo, which the first optimizer of any script imports
# (torch._compile): several seconds of every cold start.
DEFAULT_IMPORTS = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch._dynamo",
)


def _warm_up(modules: list[str]) -> None:
    import importlib

    import torch

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # a module this installation lacks: the rank may too
            print(f"warm process: not importing {name}: {exc}", file=sys.stderr)
    slot = int(os.environ.get(SLOT, "0"))
    if torch.cuda.is_available() and slot < torch.cuda.device_count():
        torch.cuda.set_device(slot)
        torch.zeros(1, device="cuda")  # the context, created now


def become(assignment: dict) -> None:
    """Turn this process into the rank; returns when the rank's code does."""
    take_environment(assignment["env"])
    if assignment.get("cwd"):
        os.chdir(assignment["cwd"])
    redirect(0, os.devnull, os.O_RDONLY)
    take_output(assignment["stdout"], assignment["stderr"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))  # torch read the pool's own at import
    args = assignment["args"]
    if args[0] == "-m":
        # As `python -m`: the working directory first on the path; run_module puts the
        # module's file in argv[0] and the module in sys.modules["__main__"].
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def main() -> None:
    # argv: the pool slot's path (a name only), then the modules to import, comma-separated.
    _warm_up([m for m in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if m])
    try:
        # To the pool's pipe (agent.pool), unbuffered: nothing of it may reach the rank's
        # stdout. Closed already if the process was handed out before it was ready.
        os.write(1, b"ready\n")
    except OSError:
        pass
    line = sys.stdin.readline()
    if not line.strip():
        return
    become(json.loads(line))


if __name__ == "__main__":
    main()
