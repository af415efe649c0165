"""Validation of submitted job specs: every error names the field and the fix."""

from __future__ import annotations

import os
import re

from protos import keel_pb2

NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Set by the agent for every rank; a job may not override them.
RESERVED_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE", "KEEL_JOB", "KEEL_GENERATION",
    "KEEL_MESH", "KEEL_CHECKPOINT_DIR", "KEEL_RESTORE_FROM", "KEEL_AGENT_SOCKET"})
MAX_RESTARTS_LIMIT = 1000


class InvalidSpec(ValueError):
    """A job spec that cannot run; the message lists every problem found."""


def validate(spec: keel_pb2.JobSpec) -> None:
    problems = []
    if not NAME.match(spec.name):
        problems.append(f"name {spec.name!r}: use 1-63 lowercase letters, digits and '-', "
                        f"starting and ending with a letter or digit")
    if spec.world_size < 1:
        problems.append("world_size: must be at least 1")
    if not spec.command or not spec.command[0]:
        problems.append("command: give the argv each rank runs, e.g. "
                        "['python', '-m', 'trainer.train']")
    if spec.max_restarts > MAX_RESTARTS_LIMIT:
        problems.append(f"max_restarts: {spec.max_restarts} is more than "
                        f"{MAX_RESTARTS_LIMIT}; a job failing that often needs a person")
    if spec.checkpoint_dir and not os.path.isabs(spec.checkpoint_dir):
        problems.append(f"checkpoint_dir {spec.checkpoint_dir!r}: must be an absolute path")
    for key in spec.env:
        if not ENV_NAME.match(key):
            problems.append(f"env {key!r}: not a valid environment variable name")
        elif key in RESERVED_ENV:
            problems.append(f"env {key!r}: set by Keel for every rank; remove it")
    if problems:
        raise InvalidSpec("; ".join(problems))
