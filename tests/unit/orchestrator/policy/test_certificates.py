"""What the controller does with a node's certificate request, an approval, a
revocation, and which certificate may say Hello for a node."""

import pytest

from common.records import CertificateRecord, CertificateState
from orchestrator.policy.certificates import (
    Answer,
    hello_refusal,
    issued,
    on_approve,
    on_request,
    on_revoke,
)

NOW = 1000.0


def record(state: CertificateState, key: str = "k1", serial: str = "") -> CertificateRecord:
    return CertificateRecord(
        state=state,
        key_sha256=key,
        requested_at_unix=1.0,
        changed_at_unix=2.0,
        by="controller",
        serial=serial,
    )


@pytest.mark.parametrize(
    "stored, key, approval, answer, says",
    [
        (None, "k1", False, Answer.ISSUE, ""),  # the first request: signed at once
        (None, "k1", True, Answer.PENDING, "keel certs approve n1"),
        (record(CertificateState.PENDING), "k1", True, Answer.PENDING, "waits"),
        (record(CertificateState.PENDING), "k2", True, Answer.REFUSE, "another key"),
        (record(CertificateState.APPROVED), "k1", True, Answer.ISSUE, ""),
        (record(CertificateState.APPROVED), "k2", True, Answer.REFUSE, "earlier request"),
        (record(CertificateState.APPROVED, key=""), "k2", True, Answer.ISSUE, ""),
        (record(CertificateState.ISSUED, serial="ab"), "k1", False, Answer.ISSUE, ""),  # renewal
        (record(CertificateState.ISSUED, serial="ab"), "k2", False, Answer.REFUSE, "serial ab"),
        (record(CertificateState.REVOKED), "k1", False, Answer.REFUSE, "revoked"),
    ],
)
def test_a_node_is_signed_once_for_one_key(stored, key, approval, answer, says):
    decision = on_request("n1", stored, key, approval, NOW)
    assert decision.answer is answer
    assert says in decision.message
    if answer is Answer.ISSUE:
        assert decision.record.state is CertificateState.ISSUED
        assert decision.record.key_sha256 == key
        done = issued(decision.record, "cd", NOW + 60)
        assert (done.serial, done.issued) == ("cd", (stored.issued if stored else 0) + 1)


def test_an_approval_keeps_a_pending_key_and_a_revocation_bars_the_node():
    approved, _ = on_approve("n1", record(CertificateState.PENDING), "op", NOW)
    assert (approved.state, approved.key_sha256, approved.by) == (
        CertificateState.APPROVED,
        "k1",
        "op",
    )
    again, message = on_approve("n1", record(CertificateState.ISSUED, serial="ab"), "op", NOW)
    assert again is None and "revoke" in message
    revoked, _ = on_revoke("n1", record(CertificateState.ISSUED, serial="ab"), "op", NOW)
    assert (revoked.state, revoked.serial) == (CertificateState.REVOKED, "ab")
    barred, _ = on_revoke("n2", None, "op", NOW)  # a name no node may take until approved
    assert barred.state is CertificateState.REVOKED
    assert on_request("n2", barred, "k9", False, NOW).answer is Answer.REFUSE
    reopened, _ = on_approve("n2", barred, "op", NOW)
    assert reopened.key_sha256 == ""  # whichever key asks next
    assert on_request("n2", reopened, "k9", False, NOW).answer is Answer.ISSUE


ISSUED = record(CertificateState.ISSUED, serial="ab")


@pytest.mark.parametrize(
    "stored, bound, key, shared_ok, refused",
    [
        (ISSUED, "n1", "k1", False, ""),  # its own certificate
        (ISSUED, "n1", "k2", False, "its own certificate"),  # another key of that name
        (ISSUED, "n2", "k1", False, "node n2 cannot say Hello for node n1"),
        (ISSUED, None, "k1", True, "its own certificate"),  # shared: not for a bound node
        (None, None, "k1", False, "binds no node"),
        (None, None, "k1", True, ""),  # shared, behind the flag
        (None, "n1", "k5", False, ""),  # `keel certs init --agent n1`'s own
        (record(CertificateState.REVOKED), "n1", "k1", False, "revoked"),
    ],
)
def test_a_hello_for_a_node_comes_with_that_nodes_certificate(
    stored, bound, key, shared_ok, refused
):
    problem = hello_refusal("n1", stored, bound, key, shared_ok)
    assert (refused in problem) if refused else problem == ""
