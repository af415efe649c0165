"""Saves checkpoints under some layouts and loads them under others, in one torchrun
launch, recording the full (unsharded) model and optimizer state on both sides.

Usage, under torchrun: ``reshard_cases.py ROOT CASES_JSON -- COMMON_TRAINER_FLAGS...``.
CASES_JSON is a list of

- ``{"save": NAME, "flags": [...]}``: ``trainer.train.train`` with the common flags,
  these flags and ``--checkpoint-dir ROOT/NAME`` (train ``--steps`` steps, commit the
  last checkpoint), then every rank writes the full state of the model parts it holds
  to ``ROOT/NAME/full-<rank>.pt``;
- ``{"load": NAME, "flags": [...]}``: ``trainer.train.train`` under the flags, resuming
  from ``ROOT/NAME`` with nothing left to train, then every rank compares the full
  state of its parts with the saved side's; rank 0 prints ``RESULT {...}`` with what
  was compared and what differed.

Full state: ``get_model_state_dict``/``get_optimizer_state_dict`` with
``full_state_dict=True`` (gathered over the mesh) and the optimizer flattened per
parameter name, so that either side's pipeline split does not matter.
"""

import glob
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from trainer import runtime as keel_runtime
from trainer import train

FULL = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)


def full_state(run: train.Setup) -> dict:
    """Flat ``"model.<fqn>"``/``"optim.<key>"`` → CPU tensor or number, for this rank's parts."""
    state = {}
    for part, optimizer in zip(run.parts, run.optimizers.optimizers):
        for key, value in get_model_state_dict(part, options=FULL).items():
            state[f"model.{key}"] = value.detach().cpu().clone()
        for key, value in get_optimizer_state_dict(part, optimizer, options=FULL).items():
            state[f"optim.{key}"] = (
                value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
            )
    return state


def saved_state(directory: str) -> dict:
    """The union of every saving rank's full state; ranks holding the same key (data-
    and tensor-parallel peers) must agree exactly."""
    union: dict = {}
    for path in sorted(glob.glob(os.path.join(directory, "full-*.pt"))):
        for key, value in torch.load(path, weights_only=True).items():
            if key in union and not same(union[key], value):
                raise AssertionError(f"saving ranks disagree on {key}")
            union[key] = value
    return union


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return a == b


def main() -> None:
    root, cases = sys.argv[1], json.loads(sys.argv[2])
    common = sys.argv[sys.argv.index("--") + 1 :]
    rt = keel_runtime.init()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for case in cases:
            name = case.get("save") or case["load"]
            directory = os.path.join(root, name)
            args = train.parse_args(
                common + case["flags"] + ["--checkpoint-dir", directory, "--keep-checkpoints", "0"]
            )
            rt.checkpoint_dir = directory
            run = train.train(args, rt, torch.device("cpu"))
            mine = full_state(run)
            if "save" in case:
                torch.save(mine, os.path.join(directory, f"full-{rank}.pt"))
                dist.barrier()
                continue
            expected = saved_state(directory)
            differing = sorted(
                key
                for key, value in mine.items()
                if key not in expected or not same(value, expected[key])
            )
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, {"keys": sorted(mine), "differing": differing})
            if rank == 0:
                covered = set().union(*(report["keys"] for report in reports))
                print(
                    "RESULT "
                    + json.dumps(
                        {
                            "source": name,
                            "target": " ".join(case["flags"]),
                            "compared": len(covered),
                            "saved": len(expected),
                            "uncovered": sorted(set(expected) - covered),
                            "differing": sorted(
                                set().union(*(report["differing"] for report in reports))
                            ),
                            "optimizer_steps": sorted(
                                {float(v) for k, v in expected.items() if k.endswith(".step")}
                            ),
                            "exp_avg_tensors": sum(k.endswith(".exp_avg") for k in covered),
                        }
                    ),
                    flush=True,
                )
    finally:
        rt.close()
        train.shut_down_process_group()


if __name__ == "__main__":
    main()
    train.exit_without_finalizing(0)
