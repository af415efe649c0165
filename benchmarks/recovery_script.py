"""A plain torchrun training script, knowing nothing of Keel, that ``benchmarks.recovery``
runs under ``keel run``, under torchrun and with no launcher at all.

It trains epochs of fixed work (``--iters`` steps of a small MLP, each averaging its
gradients over the ranks with ``all_reduce``), keeps its own snapshot as the PyTorch
DDP tutorial does (rank 0 saves the model, the optimizer and the epoch after every
epoch with an atomic rename; every rank resumes from it when there is one), and rank 1
SIGKILLs itself once, at the start of ``--fail-epoch`` in restart 0 (the marker
``OUT/killed`` makes it once only), writing ``time.time()`` to ``OUT/kill.json`` just
before.

Every rank appends its timestamps (unix seconds, ``time.time()``) to
``OUT/times-rank<R>.jsonl``, one JSON object a line with ``event``, ``t``, ``restart``
(``TORCHELASTIC_RESTART_COUNT``) and ``pid``: ``start`` (the script's first line, before
torch is imported), ``imported``, ``pg`` (``init_process_group`` returned), ``built``
(the model and its optimizer made), ``restored`` (the snapshot loaded, or none found;
with ``from_epoch``) and ``epoch`` (an epoch's end, with ``epoch``)::

    python -u benchmarks/recovery_script.py OUT [--epochs 7] [--fail-epoch 4] [--iters 12]
"""

import time

# ``start`` is stamped before torch is imported, so every other import follows it.
# ruff: noqa: E402
T_START = time.time()

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

T_IMPORTED = time.time()

WIDTH = 256  # the MLP's hidden width
BATCH = 64  # samples per rank per step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory of the snapshot, markers and timestamps")
    parser.add_argument("--epochs", type=int, default=7)
    parser.add_argument(
        "--fail-epoch", type=int, default=4, help="epoch at whose start rank 1 kills itself"
    )
    parser.add_argument("--iters", type=int, default=12, help="training steps per epoch")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    times = args.out / f"times-rank{rank}.jsonl"

    def mark(event: str, t: float | None = None, **fields) -> None:
        record = {
            "event": event,
            "t": time.time() if t is None else t,
            "restart": restart,
            "pid": os.getpid(),
            **fields,
        }
        with open(times, "a") as lines:
            lines.write(json.dumps(record) + "\n")

    mark("start", T_START)
    mark("imported", T_IMPORTED)
    dist.init_process_group("gloo")
    mark("pg")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 1),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mark("built")
    snapshot = args.out / "snapshot.pt"
    first = 0
    if snapshot.exists():
        state = torch.load(snapshot)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["epoch"] + 1
    mark("restored", from_epoch=first)

    for epoch in range(first, args.epochs):
        if rank == 1 and epoch == args.fail_epoch and restart == 0:
            try:
                os.close(os.open(args.out / "killed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                (args.out / "kill.json").write_text(
                    json.dumps({"t": time.time(), "pid": os.getpid()})
                )
                os.kill(os.getpid(), signal.SIGKILL)
        # The data is a function of the epoch and the step alone.
        generator = torch.Generator().manual_seed(1000 * epoch)
        for _ in range(args.iters):
            x = torch.randn(world * BATCH, WIDTH, generator=generator)[rank::world]
            loss = (model(x) - x.mean(dim=1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():  # what DDP does: average the gradients
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
        mark("epoch", epoch=epoch)
        if rank == 0:
            partial = snapshot.with_suffix(".tmp")
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                partial,
            )
            os.replace(partial, snapshot)
        # Nobody starts the next epoch (rank 1 not its kill) before the snapshot is in place.
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
