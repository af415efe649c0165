"""The reference trainer's command line (``python -m trainer.train --help``): run,
model, optimizer, parallelism, checkpoints and health, each checked with the fix, and
the collective timeouts checked against the job's deadline chain under Keel."""

from __future__ import annotations

import argparse
import os

from trainer import mesh, optim, preflight
from trainer import runtime as keel_runtime

# Rank 0 may hold up its peers this long, outside any collective, when it commits a
# checkpoint: flushing the step reports, then reporting the checkpoint to the agent.
# The collective timeout must leave room for it (and for the fsync before it).
COMMIT_REPORT_S = keel_runtime.FLUSH_WAIT_S + keel_runtime.CHECKPOINT_REPORT_DEADLINE_S
# Collective timeouts outside Keel (under Keel, the job's deadline chain gives them).
COLLECTIVE_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 300.0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones, whose help says what leaving them out means."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.train",
        description="Keel's reference composite-parallel trainer "
        "on a synthetic Markov-chain token stream.",
        formatter_class=_HelpFormatter,
    )
    run = parser.add_argument_group("run")
    run.add_argument(
        "--steps",
        type=int,
        required=True,
        help="target number of optimizer steps in total, counting those before a resume",
    )
    run.add_argument(
        "--global-batch",
        type=int,
        default=16,
        help="samples per optimizer step over all ranks; "
        "must divide by data-parallel ranks × --grad-accum "
        "(× --microbatches with pipeline parallelism)",
    )
    run.add_argument("--seq-len", type=int, default=64, help="tokens per sample; must divide by tp")
    run.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")

    model = parser.add_argument_group("model")
    model.add_argument("--dim", type=int, default=64, help="model width")
    model.add_argument("--layers", type=int, default=2, help="transformer blocks")
    model.add_argument("--heads", type=int, default=4, help="attention heads; must divide by tp")
    model.add_argument("--vocab", type=int, default=256, help="vocabulary size")

    optimizer = parser.add_argument_group("optimizer")
    optimizer.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="peak AdamW learning rate (a resume keeps the checkpoint's)",
    )
    optimizer.add_argument(
        "--lr-schedule",
        choices=optim.LR_SCHEDULES,
        default="constant",
        help=f"after warm-up: constant, or cosine decay to {optim.COSINE_FLOOR:g}×lr at --steps",
    )
    optimizer.add_argument(
        "--warmup-steps", type=int, default=0, help="steps of linear learning-rate warm-up"
    )
    optimizer.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="forward/backward passes per optimizer step, each on 1/N of the rank's samples",
    )
    optimizer.add_argument(
        "--clip-grad",
        type=float,
        default=None,
        metavar="NORM",
        help="clip gradients to this global L2 norm (over every rank and stage); "
        "default no clipping",
    )

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument(
        "--layout",
        default=None,
        help="ranks per mesh axis, e.g. dp_replicate=2,dp_shard=2 or dp_shard=2,tp=2 or tp=2,pp=2 "
        "(axes dp_replicate, dp_shard, tp, pp; omitted ones are 1); "
        "default $KEEL_MESH, else dp_shard over all ranks",
    )
    parallel.add_argument(
        "--pp-schedule",
        choices=mesh.PP_SCHEDULES,
        default="1f1b",
        help="pipeline schedule (with pp > 1)",
    )
    parallel.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline micro-batches per pass (with pp > 1; at least pp for 1f1b schedules); "
        "default pp",
    )
    parallel.add_argument(
        "--virtual-stages",
        type=int,
        default=2,
        help="pipeline stages per rank for interleaved_1f1b",
    )
    parallel.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FSDP2: free each block's gathered parameters after its forward "
        "and gather again for the backward; "
        "default on without pipeline parallelism, off with it "
        "(every micro-batch would gather again)",
    )
    parallel.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="recompute each block's activations in the backward pass instead of keeping them",
    )

    run.add_argument(
        "--restart-in-place",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="under a Keel agent, when a generation ends under this rank (a peer died, or "
        "the generation is being stopped) stay alive and become the next generation's "
        "rank in this process instead of exiting",
    )

    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument(
        "--checkpoint-dir",
        default=os.environ.get(keel_runtime.env.CHECKPOINT_DIR) or None,
        help="where checkpoints live; default $KEEL_CHECKPOINT_DIR, else no checkpoints",
    )
    ckpt.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        help="checkpoint at every multiple of this many steps (and at the last step)",
    )
    ckpt.add_argument(
        "--async-checkpoint",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write checkpoints in the background; the state is copied to host memory beside "
        "the next step's forward and backward, which waits for the copy only before its "
        "optimizer step",
    )
    ckpt.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        metavar="K",
        help="after each commit keep the newest K committed checkpoints "
        "(and the one resumed from); 0 keeps all",
    )
    ckpt.add_argument(
        "--memory-checkpoint-every",
        type=int,
        default=1,
        metavar="K",
        help="snapshot every rank's state into the memory the node's agent holds for the "
        "job (KEEL_MEMORY_DIR; none: no snapshots) every K steps, or less often where "
        "--memory-overhead-max says so, restored in place of an older durable "
        "checkpoint; 0 turns the memory tier off",
    )
    parser.add_argument(
        "--memory-overhead-max",
        type=float,
        default=0.02,
        metavar="F",
        help="the most of the training time memory snapshots may take, as measured: "
        "where a snapshot every --memory-checkpoint-every steps costs more, they are "
        "taken less often, as often as F allows (rank 0 says each change); 0: every K "
        "steps whatever they cost",
    )

    health = parser.add_argument_group("health")
    health.add_argument(
        "--startup-timeout-s",
        type=float,
        default=None,
        help="collective timeout until the first step is done: "
        "rendezvous, start barrier, preflight, "
        f"checkpoint load, first step; default ${keel_runtime.env.DEADLINES['startup_timeout_s']} "
        f"(the job's deadline chain under Keel), else {STARTUP_TIMEOUT_S:g}",
    )
    health.add_argument(
        "--collective-timeout-s",
        type=float,
        default=None,
        help="collective timeout after the first step; "
        "a rank stuck in a collective fails after this long. "
        "It must exceed the agent's hang floor plus its stop grace, "
        "so the agent names the hung rank first "
        "(checked under Keel), and rank 0's checkpoint commit (fsync, then up to "
        f"{COMMIT_REPORT_S:g} s reporting it), which its peers wait out; default "
        f"${keel_runtime.env.DEADLINES['collective_timeout_s']}, else {COLLECTIVE_TIMEOUT_S:g}",
    )
    health.add_argument(
        "--preflight",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get(keel_runtime.env.PREFLIGHT, "1") != "0",
        help="time all_reduce, all_gather and reduce_scatter over all ranks "
        "before the first step and report "
        "the bandwidths to the agent; default on unless $KEEL_PREFLIGHT=0. Skipped on one rank",
    )
    health.add_argument(
        "--preflight-sizes-mb",
        default=",".join(f"{size:g}" for size in preflight.DEFAULT_SIZES_MB),
        help="comma-separated buffer sizes in MiB to time each collective at "
        "(the job's bucket sizes)",
    )
    health.add_argument(
        "--preflight-budget-s",
        type=float,
        default=preflight.DEFAULT_BUDGET_S,
        help="stop the preflight sweep once it has taken this long (checked between measurements)",
    )
    args = parser.parse_args(argv)
    try:
        chain = keel_runtime.job_deadlines(os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    if args.collective_timeout_s is None:
        args.collective_timeout_s = chain.get("collective_timeout_s", COLLECTIVE_TIMEOUT_S)
    if args.startup_timeout_s is None:
        args.startup_timeout_s = chain.get("startup_timeout_s", STARTUP_TIMEOUT_S)
    problems = keel_runtime.deadline_problems(
        os.environ,
        collective_timeout_s=args.collective_timeout_s,
        startup_timeout_s=args.startup_timeout_s,
    )
    if problems:
        parser.error("the job's deadlines: " + "; ".join(problems))
    for name in ("steps", "checkpoint_every", "global_batch", "grad_accum", "virtual_stages"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("keep_checkpoints", "warmup_steps", "memory_checkpoint_every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0")
    if not 0 <= args.memory_overhead_max < 1:
        parser.error(
            f"--memory-overhead-max {args.memory_overhead_max:g} must be at least 0 and "
            "below 1 (a fraction of the training time; 0: no bound)"
        )
    if args.microbatches is not None and args.microbatches < 1:
        parser.error("--microbatches must be at least 1")
    if args.clip_grad is not None and args.clip_grad <= 0:
        parser.error("--clip-grad must be positive; leave it out for no clipping")
    preflight_env = os.environ.get(keel_runtime.env.PREFLIGHT, "1")
    if preflight_env not in ("0", "1"):
        parser.error(f"{keel_runtime.env.PREFLIGHT}={preflight_env!r} must be 0 (off) or 1 (on)")
    try:
        args.preflight_sizes_mb = [float(size) for size in args.preflight_sizes_mb.split(",")]
    except ValueError:
        parser.error(
            f"--preflight-sizes-mb {args.preflight_sizes_mb!r} "
            "is not a comma-separated list of numbers, "
            f"e.g. 1,8"
        )
    if min(args.preflight_sizes_mb) <= 0:
        parser.error("--preflight-sizes-mb must all be positive")
    if args.preflight_budget_s <= 0:
        parser.error("--preflight-budget-s must be positive; use --no-preflight to skip the sweep")
    if args.collective_timeout_s <= COMMIT_REPORT_S:
        parser.error(
            f"--collective-timeout-s {args.collective_timeout_s:g} "
            f"must exceed {COMMIT_REPORT_S:g} s, the longest "
            f"rank 0 reports a checkpoint while its peers wait in the next collective"
        )
    if args.startup_timeout_s < max(args.collective_timeout_s, args.preflight_budget_s):
        parser.error(
            f"--startup-timeout-s {args.startup_timeout_s:g} "
            "must be at least --collective-timeout-s "
            f"({args.collective_timeout_s:g}) "
            f"and --preflight-budget-s ({args.preflight_budget_s:g}): "
            f"start-up covers the preflight and the first step"
        )
    return args
