"""The real controller daemon, but its etcd client loses replies: the first
transaction that moves a job to each state named by ``LOSE_REPLY_TO`` commits in etcd,
and then the call raises the timeout a client sees when a reply never comes.

Usage: lost_reply_controller.py [keel controller options]; with
LOSE_REPLY_TO=STATE[,STATE...] in the environment. Prints "lost the reply" (with the
revision the write committed at) each time it has.
"""

import os
import sys

import etcd3.exceptions

from orchestrator.cli.main import main
from orchestrator.controller.store import Store

TARGETS = set(os.environ["LOSE_REPLY_TO"].split(","))
update_job_state = Store.update_job_state
lost: set[str] = set()


def losing_the_reply(self, name, state, read_revision, plan=None):
    revision = update_job_state(self, name, state, read_revision, plan)
    if state.state.value in TARGETS - lost:
        lost.add(state.state.value)
        print(
            f"lost the reply to the write of {name} {state.state.value} (committed at "
            f"revision {revision})",
            file=sys.stderr,
            flush=True,
        )
        raise etcd3.exceptions.ConnectionTimeoutError("injected: the reply never came")
    return revision


Store.update_job_state = losing_the_reply
sys.exit(main(["controller", *sys.argv[1:]]))
