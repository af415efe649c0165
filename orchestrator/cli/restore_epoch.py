"""``keel restore-epoch``: the step of disaster recovery between restoring etcd from a
snapshot and starting the controllers (docs/disaster-recovery.md).

It advances the epoch (``/keel/epoch``, ``common.epoch``) in the restored etcd, in one
transaction guarded by the epoch's revision as read, and deletes the leader key the
snapshot held (its controller is stopped, and its lease came back with the snapshot:
the first controller to start would otherwise wait out that lease). Then it says what
the restored etcd holds: each job's generation and the checkpoint it resumes from.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import click
import etcd3
import grpc

from common import env, epoch, flags, keys
from common.etcd import EtcdClient, connect, etcd_credentials
from common.records import EpochRecord, LeaderRecord, RecordError
from orchestrator.controller.store import Store
from orchestrator.policy.generation import RestorePoint, restore_point

CONTEXT = {"help_option_names": ["-h", "--help"]}
CALL_TIMEOUT_S = 5.0


class EtcdRefused(click.ClickException):
    """etcd could not be reached or refused us; the message says what to check."""


def _read_epoch(client: EtcdClient) -> tuple[int, int, int, str]:
    """(the stored epoch, the key's mod revision, etcd's revision, a problem): 0 and 0
    while absent; a value that does not parse is epoch -1 with the problem."""
    response = client.get_response(keys.EPOCH)
    revision = response.header.revision
    if not response.kvs:
        return 0, 0, revision, ""
    kv = response.kvs[0]
    try:
        return EpochRecord.from_json(keys.EPOCH, kv.value).epoch, kv.mod_revision, revision, ""
    except RecordError as error:
        return -1, kv.mod_revision, revision, error.problem


def _advance(client: EtcdClient, asked: int | None) -> tuple[EpochRecord, LeaderRecord | None]:
    """Write the next epoch (or ``asked``) and delete the leader key, if the epoch did
    not change meanwhile; returns the record written and the leader deleted."""
    stored, mod_revision, revision, problem = _read_epoch(client)
    if problem and asked is None:
        raise click.ClickException(
            f"{keys.EPOCH} does not parse ({problem}): give --epoch N, above every epoch "
            f"this cluster has used"
        )
    previous = max(stored, 0)
    try:
        new = epoch.advanced(previous, asked)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    record = EpochRecord(
        epoch=new,
        previous=previous,
        at_unix=time.time(),
        by=f"keel restore-epoch on {socket.gethostname()}",
        restored_revision=revision,
    )
    tx = client.transactions
    ok, responses = client.transaction(
        compare=[tx.mod(keys.EPOCH) == mod_revision],
        success=[tx.get(keys.LEADER), tx.put(keys.EPOCH, record.to_json()), tx.delete(keys.LEADER)],
        failure=[],
    )
    if not ok:
        raise click.ClickException(
            f"{keys.EPOCH} changed while this ran (another keel restore-epoch?); run it again"
        )
    leader = None
    if responses[0]:
        try:
            leader = LeaderRecord.from_json(keys.LEADER, responses[0][0][0])
        except RecordError:
            pass  # deleted all the same; there is nobody to name
    return record, leader


def _jobs(store: Store) -> list[str]:
    """A line per job the restored etcd holds: its generation, where it resumes."""
    lines = []
    for name in store.job_names():
        try:
            state = store.job_state(name).value
            point = restore_point(store.checkpoints(name))
        except RecordError as error:
            lines.append(f"  job {name}: its records do not parse ({error}); see the controller")
            continue
        generation = state.generation if state else 0
        where = resumes_from(point)
        lines.append(
            f"  job {name}: {state.state.value if state else 'no state'} at generation "
            f"{generation} in the snapshot; {where}"
        )
    return lines


def resumes_from(point: RestorePoint, there: Callable[[str], bool] = os.path.isdir) -> str:
    """Where a job restored with ``point`` resumes, as this host sees its checkpoint
    directory (``there``): the recorded restore point if it is there, else the newest
    of its fallbacks that is, and why; or that none is. Checkpoint retention goes on
    after the etcd snapshot is taken, so a snapshot older than ``--keep-checkpoints``
    checkpoints names restore points that are gone."""
    if not point.path:
        return "has no checkpoint recorded: starts from step 0"
    if there(point.path):
        return f"resumes from {point.path} (step {point.step})"
    gone = (
        f"its restore point {point.path} (step {point.step}) is not there from this host "
        "(retention deletes checkpoints after a snapshot is taken: keep etcd snapshots "
        "younger than --keep-checkpoints checkpoints)"
    )
    present = next((path for path in point.fallbacks if there(path)), None)
    if present is not None:
        return f"{gone}; it falls back to {present}, the newest recorded one that is there"
    return (
        f"{gone}, nor is any older one recorded: its next generation cannot restore. "
        "Delete it (keel delete) and submit it again with --resume-from a checkpoint "
        "that is there, or restore a newer etcd snapshot"
    )


@click.command("restore-epoch", context_settings=CONTEXT)
@click.option(
    "--etcd-endpoints",
    required=True,
    envvar=env.ETCD_ENDPOINTS,
    help="Comma-separated host:port list of the restored etcd (env KEEL_ETCD_ENDPOINTS).",
)
@click.option(
    "--epoch",
    "asked",
    type=click.IntRange(min=1),
    default=None,
    help="Set this epoch instead of the restored one plus 1: when restoring a snapshot "
    "older than an earlier restore, give one above every epoch the cluster has used.",
)
@flags.etcd_options
def restore_epoch(etcd_endpoints, asked, **security):
    """Advance the epoch in an etcd just restored from a snapshot.

    Run it after `etcdutl snapshot restore` and starting etcd on the restored data,
    before starting any controller (docs/disaster-recovery.md). The restore wound etcd's
    revisions, and so leader terms and job generations, back below what agents and
    checkpoint fences have seen; in the new epoch agents take the new leader whatever
    its term, and new generations are numbered above every earlier one. It also deletes
    the leader key the snapshot held, so that a controller may lead at once.
    """
    endpoints = [e.strip() for e in etcd_endpoints.split(",") if e.strip()]
    where = f"etcd at {', '.join(endpoints) or '(none)'}"
    try:
        credentials = etcd_credentials(**security)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        client = connect(endpoints, CALL_TIMEOUT_S, credentials)
    except ValueError as exc:
        raise click.UsageError(f"--etcd-endpoints {etcd_endpoints!r}: {exc}") from None
    try:
        record, leader = _advance(client, asked)
        jobs = _jobs(Store(client))
    except grpc.RpcError as exc:
        raise EtcdRefused(
            f"{where} refused: {exc.code().name}: {exc.details()}; check the --etcd-* credentials"
        ) from None
    except etcd3.exceptions.Etcd3Exception as exc:
        raise EtcdRefused(
            f"cannot reach {where} ({type(exc).__name__}{': ' + str(exc) if str(exc) else ''}); "
            f"check --etcd-endpoints, and that etcd runs on the restored data directory"
        ) from None
    finally:
        client.close()
    click.echo(
        f"epoch {record.epoch} set in {where} (the snapshot held epoch {record.previous}; "
        f"etcd at revision {record.restored_revision})"
    )
    if leader is not None:
        click.echo(
            f"deleted the snapshot's leader key (controller {leader.id} at {leader.address}, "
            f"epoch {leader.epoch})"
        )
    click.echo(
        f"controllers now lead in epoch {record.epoch}: agents take them whatever their "
        f"term, and the generations they start are numbered from "
        f"{epoch.first_generation(record.epoch)}"
    )
    click.echo("\n".join(jobs) if jobs else "  no jobs in the snapshot")
    click.echo("start the controllers now")
