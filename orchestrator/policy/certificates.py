"""Nodes' own certificates (TLS bootstrapping): what the leading controller does with a
node's certificate request, with an operator's approval or revocation, and whether a
Hello for a node may come over the certificate it was sent with. Pure: the records in,
the record to store and what to say out.

A node is signed a certificate once: the first request's key is the node's, and after
that only the same key is signed again (the agent renews before its certificate
expires, with the key it keeps). A request with another key for a node that has its
certificate is refused: the join token alone cannot take over a node. An operator who
retires a node's key revokes it (``keel certs revoke NODE``): the node's session ends,
and nothing is signed or accepted for it until an approval (``keel certs approve
NODE``) lets it bootstrap again. With ``--approve-agents``, a node's first request
waits for an approval too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from common.records import CertificateRecord, CertificateState

CONTROLLER = "controller"  # ``CertificateRecord.by`` of what the controller decided


class Answer(Enum):
    ISSUE = "issue"  # sign the request (and store ``record`` with the new serial)
    PENDING = "pending"  # recorded; an operator's approval is awaited
    REFUSE = "refuse"


@dataclass(frozen=True)
class Decision:
    answer: Answer
    record: CertificateRecord | None  # what to store; None: nothing changes
    message: str


def _ago(record: CertificateRecord) -> str:
    return f"by {record.by}" if record.by else "earlier"


def on_request(
    node: str,
    record: CertificateRecord | None,
    key_sha256: str,
    approval_required: bool,
    now_unix: float,
) -> Decision:
    """A certificate request for ``node`` with a key of fingerprint ``key_sha256``,
    given the node's stored ``record``. An ISSUE's record is stored with the serial and
    expiry of the certificate once signed (``issued``)."""
    if record is None:
        if approval_required:
            pending = CertificateRecord(
                state=CertificateState.PENDING,
                key_sha256=key_sha256,
                requested_at_unix=now_unix,
                changed_at_unix=now_unix,
                by=CONTROLLER,
            )
            return Decision(
                Answer.PENDING,
                pending,
                f"node {node}'s request is recorded; an operator approves it with "
                f"`keel certs approve {node}`",
            )
        return Decision(Answer.ISSUE, _to_issue(None, key_sha256, now_unix), "")
    state = record.state
    if state is CertificateState.REVOKED:
        return Decision(
            Answer.REFUSE,
            None,
            f"node {node}'s certificate was revoked ({_ago(record)}); "
            f"`keel certs approve {node}` lets it bootstrap again",
        )
    if state is CertificateState.PENDING:
        if record.key_sha256 == key_sha256:
            return Decision(
                Answer.PENDING,
                None,
                f"node {node}'s request waits for `keel certs approve {node}`",
            )
        return Decision(
            Answer.REFUSE,
            None,
            f"a request for node {node} with another key waits for approval; if it is "
            f"not this node's, `keel certs revoke {node}` then `keel certs approve {node}`",
        )
    if state is CertificateState.APPROVED:
        if record.key_sha256 and record.key_sha256 != key_sha256:
            return Decision(
                Answer.REFUSE,
                None,
                f"node {node} was approved for the key of its earlier request, not this "
                f"one; `keel certs revoke {node}` then `keel certs approve {node}` "
                f"approves whichever key asks next",
            )
        return Decision(Answer.ISSUE, _to_issue(record, key_sha256, now_unix), "")
    # ISSUED: the node's key asks again (renewal), or another key asks for the node.
    if record.key_sha256 == key_sha256:
        return Decision(Answer.ISSUE, _to_issue(record, key_sha256, now_unix), "")
    return Decision(
        Answer.REFUSE,
        None,
        f"node {node} already has its certificate (serial {record.serial}), for another "
        f"key; an operator who retires that key runs `keel certs revoke {node}`, then "
        f"`keel certs approve {node}`",
    )


def _to_issue(
    record: CertificateRecord | None, key_sha256: str, now_unix: float
) -> CertificateRecord:
    return CertificateRecord(
        state=CertificateState.ISSUED,
        key_sha256=key_sha256,
        requested_at_unix=record.requested_at_unix if record else now_unix,
        changed_at_unix=now_unix,
        by=CONTROLLER,
        issued=(record.issued if record else 0),
    )


def issued(record: CertificateRecord, serial: str, not_after_unix: float) -> CertificateRecord:
    """``record`` (an ISSUE's) with the certificate just signed."""
    return record.replace(serial=serial, not_after_unix=not_after_unix, issued=record.issued + 1)


def _moved(
    record: CertificateRecord | None,
    state: CertificateState,
    by: str,
    now_unix: float,
    keep_key: bool,
) -> CertificateRecord:
    """``record`` (None: none yet) moved to ``state`` by ``by``, its history kept."""
    if record is None:
        return CertificateRecord(
            state=state, key_sha256="", requested_at_unix=0.0, changed_at_unix=now_unix, by=by
        )
    return record.replace(
        state=state,
        key_sha256=record.key_sha256 if keep_key else "",
        changed_at_unix=now_unix,
        by=by,
    )


def on_approve(
    node: str, record: CertificateRecord | None, by: str, now_unix: float
) -> tuple[CertificateRecord | None, str]:
    """An operator approves ``node``: (the record to store, None if none changes; what
    the call did)."""
    if record is not None and record.state is CertificateState.ISSUED:
        return None, (
            f"node {node} already has its certificate (serial {record.serial}); nothing "
            f"to approve (`keel certs revoke {node}` first, to let a new key bootstrap)"
        )
    if record is not None and record.state is CertificateState.APPROVED:
        return None, f"node {node} was already approved; its next request is signed"
    pending = record is not None and record.state is CertificateState.PENDING
    # A pending request's key, so that no other key can take its place; else the first
    # key that asks.
    approved = _moved(record, CertificateState.APPROVED, by, now_unix, keep_key=pending)
    if pending:
        return approved, f"node {node} approved: its waiting request is signed when it asks again"
    return approved, f"node {node} approved: the next request for it is signed, whatever its key"


def on_revoke(
    node: str, record: CertificateRecord | None, by: str, now_unix: float
) -> tuple[CertificateRecord | None, str]:
    """An operator revokes ``node``'s certificate (or, with none yet, bars the name):
    (the record to store, None if none changes; what the call did)."""
    if record is not None and record.state is CertificateState.REVOKED:
        return None, f"node {node}'s certificate was already revoked"
    revoked = _moved(record, CertificateState.REVOKED, by, now_unix, keep_key=True)
    return revoked, (
        f"node {node}'s certificate revoked: its agent's session is closed and no Hello "
        f"or request for it is accepted until `keel certs approve {node}`"
    )


def hello_refusal(
    node: str,
    record: CertificateRecord | None,
    bound: str | None,
    key_sha256: str,
    allow_shared: bool,
) -> str:
    """Why a Hello for ``node`` may not come over a TLS connection whose certificate
    binds node ``bound`` (None: binds none, the shared agent certificate) with a key of
    fingerprint ``key_sha256``; "" if it may."""
    if bound is not None and bound != node:
        return f"the certificate of node {bound} cannot say Hello for node {node}"
    if record is not None and record.state is CertificateState.REVOKED:
        return (
            f"node {node}'s certificate was revoked ({_ago(record)}); "
            f"`keel certs approve {node}` lets it bootstrap again"
        )
    if record is not None and record.state is CertificateState.ISSUED:
        if bound == node and key_sha256 == record.key_sha256:
            return ""
        return (
            f"node {node} has its own certificate (serial {record.serial}); a Hello for "
            f"it must come with that certificate"
        )
    if bound is None and not allow_shared:
        return (
            "this certificate binds no node (the shared agent certificate); give the "
            "agent --bootstrap-address to have its own signed, or its agent-<NODE>.pem "
            "(`keel certs add --agent NODE`), or start the controller with "
            "--allow-shared-agent-certificate"
        )
    return ""
