"""Trains the reference model for a few steps under each of several layouts, one after
another in the same ranks (an interpreter and torch import per rank, not per layout),
and prints on rank 0 one line per step: ``RESULT {"case", "step", "loss", "grad_norm"}``.

Usage, under torchrun: ``layout_losses.py CASES_JSON -- COMMON_TRAINER_FLAGS...`` where
CASES_JSON is ``[{"name": ..., "flags": [...]}, ...]``; each case runs
``trainer.train``'s own setup, step and loss exchange with the common flags plus its
own. ``--clip-grad`` must be among the flags, so that the global gradient norm is
measured.
"""

import gc
import json
import sys

import torch
import torch.distributed as dist

from trainer import runtime as keel_runtime
from trainer import train
from trainer.data import SyntheticTokens, rank_samples


def run_case(name: str, argv: list[str], rt: keel_runtime.Runtime) -> None:
    args = train.parse_args(argv)
    torch.manual_seed(args.seed)
    layout = train.resolve_layout(args, rt)
    run = train.setup(args, layout, torch.device("cpu"))
    data = SyntheticTokens(args.vocab, args.seq_len, args.seed)
    rank = dist.get_rank()
    represents = layout.speaks_for_its_data(rank)
    samples = 0
    for step in range(1, args.steps + 1):
        first, count = rank_samples(
            samples, args.global_batch, layout.dp_rank(rank), layout.dp_size
        )
        loss = run.step(*data.batch(first, count))
        mean_loss, consumed = train.exchange(loss, first, count, represents, torch.device("cpu"))
        samples += args.global_batch
        covered = sorted((first, count) for first, count in consumed if count)
        if rank == 0:
            print(
                "RESULT "
                + json.dumps(
                    {
                        "case": name,
                        "step": step,
                        "loss": mean_loss,
                        "grad_norm": run.step.grad_norm,
                        "consumed": covered,
                    }
                ),
                flush=True,
            )
    del run
    gc.collect()


def main() -> None:
    cases = json.loads(sys.argv[1])
    common = sys.argv[sys.argv.index("--") + 1 :]
    rt = keel_runtime.init()
    dist.init_process_group("gloo")
    try:
        for case in cases:
            run_case(case["name"], common + case["flags"], rt)
    finally:
        rt.close()
        train.shut_down_process_group()


if __name__ == "__main__":
    main()
    train.exit_without_finalizing(0)
