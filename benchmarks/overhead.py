"""What step reporting (``trainer.runtime``) costs the training loop.

The reference trainer's loop — batch, forward/backward/optimizer, the per-step
exchange — runs on one rank (world size 1, gloo, one CPU thread), in alternating
blocks of steps with reporting on and off, round after round (the order flips every
round), so that drift of the machine hits both alike. With reporting on, every step
is timed by phase and queued for the agent, and the reporter thread sends batches
over gRPC to a real agent-local server (``agent.local_server``, no-op callbacks) on a
Unix socket, in its own process as on a node. Reporting off is the same loop without
the ``report_step`` call. Each reporting block ends by sending what it queued (untimed),
so that none of its reports goes out during the next block.

Prints the figure: the median step time with reporting against without. On a shared
machine the noise between blocks can exceed the effect, so a second line gives the
spread of the per-round differences (each round's block medians, paired) and the
time the ``report_step`` call itself takes in the loop::

    python -m benchmarks.overhead [--rounds 30] [--steps 20]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from agent.local_server import AgentLocalService, LocalCallbacks, RankIdentity, serve
from trainer import runtime, train
from trainer.data import SyntheticTokens, rank_samples
from trainer.mesh import Layout
from trainer.phases import PhaseTimer

WARMUP_STEPS = 20


def agent(socket_path: str, token: str, ready, reports, calls) -> None:
    """The agent's side: its AgentLocal service, counting what it is sent; ``token`` is
    the rank token it gave rank 0 of generation 1 of job ``bench``."""
    rank = RankIdentity(job="bench", generation=1, ranks=frozenset({0}), checkpoint_dir="")

    def on_steps(generation: int, batch: list) -> bool:
        with reports.get_lock():
            reports.value += len(batch)
            calls.value += 1
        return False

    server = serve(
        socket_path,
        AgentLocalService(
            LocalCallbacks(
                identify=lambda given: rank if given == token else None,
                on_steps=on_steps,
                on_checkpoint=lambda _: None,
            )
        ),
    )
    ready.set()
    server.wait_for_termination()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=30, help="rounds of one block with reporting and one without"
    )
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    options = parser.parse_args()
    torch.set_num_threads(1)

    workdir = tempfile.mkdtemp(prefix="keel-bench-")
    socket_path = os.path.join(workdir, "agent.sock")
    spawn = multiprocessing.get_context("spawn")
    ready, reports, calls = spawn.Event(), spawn.Value("q", 0), spawn.Value("q", 0)
    token = secrets.token_urlsafe(24)
    server = spawn.Process(
        target=agent, args=(socket_path, token, ready, reports, calls), daemon=True
    )
    server.start()
    if not ready.wait(60):
        raise TimeoutError("the agent-local server did not start within 60 s")

    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=0, world_size=1)
    rt = runtime.init(
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "KEEL_JOB": "bench",
            "KEEL_GENERATION": "1",
            "KEEL_AGENT_SOCKET": socket_path,
            "KEEL_RANK_TOKEN": token,
        }
    )
    total_steps = WARMUP_STEPS + 2 * options.rounds * options.steps
    args = train.parse_args(["--steps", str(total_steps), "--no-preflight"])
    device = torch.device("cpu")
    torch.manual_seed(args.seed)
    run = train.setup(args, Layout(dp_shard=1), device)
    data = SyntheticTokens(args.vocab, args.seq_len, args.seed)
    timer = PhaseTimer(device)
    step, samples = 0, 0
    call_s: list[float] = []

    def block(steps: int, report: bool) -> list[float]:
        """Runs ``steps`` steps of the trainer's loop; returns each one's wall seconds."""
        nonlocal step, samples
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            timer.start()
            first, count = rank_samples(samples, args.global_batch, 0, 1)
            inputs, targets = data.batch(first, count)
            timer.lap("data_s")
            loss = run.step(inputs, targets, timer)
            busy_s = time.perf_counter() - started
            shared = train.exchange_step(
                loss, first, count, True, rt.take_checkpoint_request(), device
            )
            step, samples = step + 1, samples + args.global_batch
            if report:
                reporting = time.perf_counter()
                rt.report_step(
                    step, shared.mean_loss, count * args.seq_len, busy_s, **timer.seconds()
                )
                call_s.append(time.perf_counter() - reporting)
            times.append(time.perf_counter() - started)
        return times

    def flush() -> None:
        """Sends what a reporting block queued before the next block starts, outside
        any timed step: the reporter thread sends every ``REPORT_INTERVAL_S``, so the
        last batch of a block would otherwise go out during the next one, a baseline
        block's steps among them. ``Runtime`` has no public flush; this is the private
        one ``report_checkpoint`` uses."""
        if not rt.flush():
            raise TimeoutError("the agent-local server did not take the queued reports")

    block(WARMUP_STEPS, report=True)
    flush()
    call_s.clear()
    with_reports: list[float] = []
    without: list[float] = []
    paired: list[float] = []
    for round_index in range(options.rounds):
        medians = {}
        for report in (True, False) if round_index % 2 == 0 else (False, True):
            times = block(options.steps, report)
            if report:
                flush()
            (with_reports if report else without).extend(times)
            medians[report] = statistics.median(times)
        paired.append(100 * (medians[True] - medians[False]) / medians[False])

    rt.close()
    dist.destroy_process_group()
    server.terminate()
    server.join()
    shutil.rmtree(workdir, ignore_errors=True)
    on, off = statistics.median(with_reports), statistics.median(without)
    sent = options.rounds * options.steps + WARMUP_STEPS
    print(
        f"report overhead: {100 * (on - off) / off:+.2f} % of step time "
        f"(median step {1000 * on:.2f} ms with reporting, {1000 * off:.2f} ms without, "
        f"{options.rounds} rounds × {options.steps} steps each way; "
        "world size 1, gloo, 1 CPU thread; "
        f"the agent got {reports.value}/{sent} reports in {calls.value} calls)"
    )
    quartiles = statistics.quantiles(paired, n=4)
    print(
        f"spread: per-round differences median {statistics.median(paired):+.2f} %, middle half "
        f"{quartiles[0]:+.2f} % to {quartiles[2]:+.2f} %; the report_step call takes "
        f"{1e6 * statistics.median(call_s):.1f} µs (median) = "
        f"{100 * statistics.median(call_s) / off:.3f} % of a step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
