"""The environment contract: every variable Keel sets for a rank, or reads from the
environment of a daemon or the CLI, spelled once with its meaning.

A rank gets torchrun's variables (``TORCHRUN``) and Keel's (``JOB`` ... ``AGENT_SOCKET``
and the deadlines), set by its agent last, so that neither the agent's environment nor
the job's spec can point a rank at the wrong rendezvous or generation.
"""

from __future__ import annotations

# ------------------------------------------------------------- set for each rank
JOB = "KEEL_JOB"  # the job's name; "" or unset outside Keel
JOB_ID = "KEEL_JOB_ID"  # the job's unique id (its lineage's); "" outside Keel
GENERATION = "KEEL_GENERATION"  # the generation the rank belongs to, from 1
NODE = "KEEL_NODE"  # the node it runs on (for its log lines)
MESH = "KEEL_MESH"  # its layout, e.g. "dp_shard=2,tp=2"
CHECKPOINT_DIR = "KEEL_CHECKPOINT_DIR"  # where the job's checkpoints live
RESTORE_FROM = "KEEL_RESTORE_FROM"  # the committed checkpoint to load; "" = fresh start
RESTORE_FALLBACKS = "KEEL_RESTORE_FALLBACKS"  # older recorded ones, newest first, os.pathsep-joined
RESUME_FROM = "KEEL_RESUME_FROM"  # another lineage's checkpoint (or directory) to start from
# The memory tier (trainer.memory_tier): the job's directory in memory its node's agent
# holds (a tmpfs: it outlives the ranks, not the node), and the most its snapshots may
# take there, bytes; both unset where the agent keeps no memory tier.
MEMORY_DIR = "KEEL_MEMORY_DIR"
MEMORY_BUDGET_BYTES = "KEEL_MEMORY_BUDGET_BYTES"
AGENT_SOCKET = "KEEL_AGENT_SOCKET"  # the agent's Unix socket (AgentLocal); new per agent
RANK_TOKEN = "KEEL_RANK_TOKEN"  # the rank's credential on that socket; new per rank
RANK_TOKEN_METADATA = "x-keel-rank-token"  # ... sent as this call metadata
# The job's side of the deadline chain, seconds (common.deadlines): the agent's hang
# budgets and stop grace, and the collective timeouts the trainer is to use, which
# must fit around them.
DEADLINES = {
    "hang_floor_s": "KEEL_HANG_FLOOR_S",
    "first_step_timeout_s": "KEEL_FIRST_STEP_TIMEOUT_S",
    "checkpoint_timeout_s": "KEEL_CHECKPOINT_TIMEOUT_S",
    "stop_grace_s": "KEEL_STOP_GRACE_S",
    "collective_timeout_s": "KEEL_COLLECTIVE_TIMEOUT_S",
    "startup_timeout_s": "KEEL_STARTUP_TIMEOUT_S",
}

# Every variable torchrun's agent sets for a worker (torch.distributed.elastic's
# LocalElasticAgent), with the same meaning: a node is a torchrun "group", every rank
# plays the one role "default", and the rank's store is its own (rank 0 hosts it at
# MASTER_ADDR:MASTER_PORT), not an agent's.
TORCHRUN = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
)
# ... and one it sets only where the job's environment does not (as torchrun does).
TORCHRUN_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
# What the agent sets for every rank; a job's spec may not set these.
SET_FOR_RANKS = frozenset(TORCHRUN) | {
    JOB,
    JOB_ID,
    GENERATION,
    NODE,
    MESH,
    CHECKPOINT_DIR,
    RESTORE_FROM,
    RESTORE_FALLBACKS,
    RESUME_FROM,
    MEMORY_DIR,
    MEMORY_BUDGET_BYTES,
    AGENT_SOCKET,
    *DEADLINES.values(),
}

# ------------------------------------------------------- set by the job, optional
FAULTS = "KEEL_FAULTS"  # a FaultSchedule as protobuf JSON (keel up --inject)
PREFLIGHT = "KEEL_PREFLIGHT"  # "0": skip the trainer's collective sweep
WATCHDOG_DIR = "KEEL_WATCHDOG_DIR"  # where NCCL flight-recorder dumps go

# ---------------------------------------------- read by the daemons and the CLI
TOKEN = "KEEL_TOKEN"  # the token, when no file gives one
ETCD_ENDPOINTS = "KEEL_ETCD_ENDPOINTS"  # host:port,... of etcd
ETCD_PASSWORD = "KEEL_ETCD_PASSWORD"  # of --etcd-user (a flag would show in ps)
CONTROLLER = "KEEL_CONTROLLER"  # host:port of the controller, for the CLI
AGENT_PROG = "KEEL_AGENT_PROG"  # how `keel agent` names itself in usage lines
# Log format (json, console) and level (debug ... error) when no --log-format or
# --log-level is given (common.logs); a rank reads them from its job's env.
LOG_FORMAT = "KEEL_LOG_FORMAT"
LOG_LEVEL = "KEEL_LOG_LEVEL"
# When agents fill their warm processes (eager, lazy) where no --warm-fill is given: a
# small machine's test suite runs lazy.
WARM_FILL = "KEEL_WARM_FILL"
WARM_FILLS = ("eager", "lazy")  # its values, the first the default
