"""A torchrun-style training script that knows nothing of Keel and keeps its own
snapshot, as the PyTorch DDP tutorial's does: rank 0 saves the model and the epoch
after every epoch, and every rank resumes from the snapshot when there is one.

Usage: snapshot_trainer.py OUT_DIR EPOCHS FAIL_EPOCH. Rank 1 exits with code 7 once,
at the start of FAIL_EPOCH (OUT_DIR/failed-once marks it). Every epoch a rank runs is
appended to OUT_DIR/epochs-<rank> as "restart R epoch E"; rank 0 writes the final
weights to OUT_DIR/final.pt. The data of an epoch is a function of the epoch alone, so
a run that resumes correctly ends with the weights of a run that never failed.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    out, epochs, fail_epoch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    snapshot = out / "snapshot.pt"
    first = 0
    if snapshot.exists():
        state = torch.load(snapshot)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["epoch"] + 1
        print(f"resuming from snapshot at epoch {first}", flush=True)
    for epoch in range(first, epochs):
        if rank == 1 and epoch == fail_epoch and not (out / "failed-once").exists():
            (out / "failed-once").touch()
            print(f"rank 1 failing on purpose at epoch {epoch}", file=sys.stderr, flush=True)
            os._exit(7)
        generator = torch.Generator().manual_seed(1000 + epoch)
        x = torch.randn(world * 4, 8, generator=generator)[rank::world]
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # what DDP does: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        with open(out / f"epochs-{rank}", "a") as f:
            f.write(f"restart {restart} epoch {epoch}\n")
        print(f"epoch {epoch} loss {loss.item():.6f}", flush=True)
        dist.barrier()
        if rank == 0:
            partial = snapshot.with_suffix(".tmp")
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                partial,
            )
            os.replace(partial, snapshot)
        dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), out / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
