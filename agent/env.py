"""The environment of a rank process: torchrun's variables plus Keel's. Pure."""

from __future__ import annotations

import os
from collections.abc import Mapping

from common import env as keel_env
from common.deadlines import Deadlines
from protos import keel_pb2


def rank_env(
    base: Mapping[str, str],
    start: keel_pb2.StartGeneration,
    assignment: keel_pb2.RankAssignment,
    agent_socket: str,
    error_file: str,
    chain: Deadlines,
    rank_token: str = "",
    node: str = "",
    interface: str = "",
    memory: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for one rank: ``base`` (the agent's) but for its Keel variables,
    then the job's, then ours.

    ``interface``: the network interface of the node's advertised address.
    ``memory``: the memory tier's variables for the job (``agent.memory``), if the node
    holds memory for it.

    Least privilege: a rank gets none of the agent's ``KEEL_*`` variables (its token,
    etcd's endpoints and password, the controller's address): only what the plan
    gives it. Keel's own variables come last so that neither the agent's environment
    nor the job can point a rank at the wrong rendezvous or generation.
    """
    env = {name: value for name, value in base.items() if not name.startswith("KEEL_")}
    env.update(start.env)
    # As torchrun does: one OpenMP thread per rank unless the job says otherwise, so
    # several ranks on a node do not oversubscribe its cores.
    if start.local_world_size > 1 and "OMP_NUM_THREADS" not in start.env:
        env["OMP_NUM_THREADS"] = "1"
    # gloo binds the address the host name resolves to, often a loopback one
    # (127.0.1.1 on Debian): on a cluster its peers could not connect. Tie it to the
    # interface of the address this node advertises, unless told otherwise.
    if interface and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = interface
    env.update(
        {
            "RANK": str(assignment.rank),
            "LOCAL_RANK": str(assignment.local_rank),
            "WORLD_SIZE": str(start.world_size),
            "LOCAL_WORLD_SIZE": str(start.local_world_size),
            "GROUP_RANK": str(start.group_rank),
            "GROUP_WORLD_SIZE": str(max(start.group_world_size, 1)),
            "ROLE_RANK": str(assignment.rank),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(start.world_size),
            "MASTER_ADDR": start.master_addr,
            "MASTER_PORT": str(start.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(start.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(start.max_restarts),
            "TORCHELASTIC_RUN_ID": f"{start.job}-g{start.generation}",
            # Rank 0 hosts the rendezvous store (init_process_group's env://); under
            # torchrun the agent's own store would be used instead.
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": error_file,
            **{name: env.get(name, value) for name, value in keel_env.TORCHRUN_DEFAULTS.items()},
            "PYTHONUNBUFFERED": "1",
            keel_env.JOB: start.job,
            keel_env.JOB_ID: start.job_id,
            keel_env.GENERATION: str(start.generation),
            keel_env.NODE: node,
            keel_env.MESH: start.mesh,
            keel_env.CHECKPOINT_DIR: start.checkpoint_dir,
            keel_env.RESTORE_FROM: start.restore_from,
            keel_env.RESTORE_FALLBACKS: os.pathsep.join(start.restore_fallbacks),
            keel_env.RESUME_FROM: start.resume_from,
            keel_env.MEMORY_DIR: "",
            keel_env.MEMORY_BUDGET_BYTES: "0",
            **(memory or {}),
            keel_env.AGENT_SOCKET: agent_socket,
            keel_env.RANK_TOKEN: rank_token,
            **{name: f"{getattr(chain, field):g}" for field, name in keel_env.DEADLINES.items()},
        }
    )
    return env
