"""A torchrun-style script that writes the torchrun variables it was given.

Usage: dump_env.py OUT_DIR. Each rank writes OUT_DIR/env-<RANK>.json: every variable
whose name torchrun's agent sets for a worker (and OMP_NUM_THREADS), with its value.
"""

import json
import os
import sys
from pathlib import Path

# As torch.distributed.elastic.agent.server.local_elastic_agent sets them (torch 2.13).
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
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    seen = {name: os.environ[name] for name in TORCHRUN if name in os.environ}
    (out / f"env-{os.environ['RANK']}.json").write_text(json.dumps(seen, sort_keys=True))
