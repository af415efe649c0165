"""Copies of memory snapshots between agents (``agent.peer``): a real AgentPeer server on
127.0.0.1 (plaintext), real snapshot files, and the copies it holds on disk."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from agent.peer import (
    REPLICAS,
    PeerError,
    Replicas,
    Replicator,
    fetch_snapshot,
    send_snapshot,
    serve,
    snapshot_chunks,
)
from common import rpc
from common.call_bounds import KIB, MIB
from protos import keel_pb2, keel_pb2_grpc

JOB, NODE = "job-7", "node-a"
TIMEOUT_S = 10.0
# A node's snapshot: two ranks, the tensor bytes of rank 0 over two chunks, an empty
# object file (sent as one empty chunk).
FILES = {
    ".metadata": 3 * KIB,
    "snapshot.json": 200,
    "__0.mem": 2 * MIB + 17,
    "__0.obj": 0,
    "__1.mem": 5 * KIB,
    "__1.obj": 300,
}


def write_snapshot(directory: Path, sizes: dict[str, int] = FILES) -> Path:
    """A committed snapshot's directory with files of ``sizes`` of random bytes."""
    directory.mkdir(parents=True)
    for name, size in sizes.items():
        (directory / name).write_bytes(os.urandom(size))
    return directory


def contents(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


@contextlib.contextmanager
def holding(root: Path, budget_bytes: int = 0):
    """An agent's AgentPeer service over the replicas under ``root``: (replicas,
    address)."""
    replicas = Replicas(root, budget_bytes)
    server, port = serve("127.0.0.1:0", None, replicas)
    try:
        yield replicas, f"127.0.0.1:{port}"
    finally:
        server.stop(0).wait()


def send(address: str, directory: Path, step: int, job: str = JOB, node: str = NODE, rate=0):
    return send_snapshot(address, None, job, node, step, directory, rate, TIMEOUT_S)


def put_raw(address: str, chunks) -> grpc.RpcError:
    """What the server answers a PutSnapshot of ``chunks`` it refuses."""
    with rpc.channel(address, None) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            keel_pb2_grpc.AgentPeerStub(channel).PutSnapshot(iter(chunks), timeout=TIMEOUT_S)
    return refused.value


def test_a_sent_snapshot_is_held_whole_and_a_newer_one_replaces_it(tmp_path: Path):
    first = write_snapshot(tmp_path / "own" / "mem_00000005")
    second = write_snapshot(tmp_path / "own" / "mem_00000007", {".metadata": 10, "__0.mem": 99})
    with holding(tmp_path / "holder") as (replicas, address):
        size, seconds = send(address, first, 5)
        assert size == sum(FILES.values()) and seconds > 0
        step, copy = replicas.held(JOB, NODE)
        assert step == 5 and copy == tmp_path / "holder" / REPLICAS / JOB / NODE / "mem_00000005"
        assert contents(copy) == contents(first)

        assert send(address, second, 7)[0] == 109
        assert replicas.held(JOB, NODE) == (7, copy.parent / "mem_00000007")
        # The older copy goes, and no staging directory is left.
        assert sorted(p.name for p in copy.parent.iterdir()) == ["mem_00000007"]
        assert contents(copy.parent / "mem_00000007") == contents(second)


def test_copies_sent_and_fetched_are_counted_by_method_and_code(tmp_path: Path):
    def handled(method: str, code: str) -> float:
        labels = {"method": method, "code": code}
        return REGISTRY.get_sample_value("keel_grpc_server_handled_total", labels) or 0.0

    before = {
        key: handled(*key)
        for key in (("PutSnapshot", "OK"), ("PutSnapshot", "FAILED_PRECONDITION"))
    }
    fetched = handled("GetSnapshot", "OK")
    snapshot = write_snapshot(tmp_path / "own" / "mem_00000005")
    with holding(tmp_path / "holder") as (_, address):
        send(address, snapshot, 5)
        with pytest.raises(PeerError) as older:
            send(address, snapshot, 4)
        (tmp_path / "fetched").mkdir()
        fetch_snapshot(address, None, JOB, NODE, 5, tmp_path / "fetched", TIMEOUT_S)
    code = older.value.code.name
    assert handled("PutSnapshot", "OK") == before[("PutSnapshot", "OK")] + 1
    assert handled("PutSnapshot", code) == before.get(("PutSnapshot", code), 0.0) + 1
    assert handled("GetSnapshot", "OK") == fetched + 1


def test_a_stream_cut_before_its_last_message_leaves_no_copy(tmp_path: Path):
    snapshot = write_snapshot(tmp_path / "own" / "mem_00000004")
    with holding(tmp_path / "holder") as (replicas, address):
        every = list(snapshot_chunks(JOB, NODE, 4, snapshot))
        assert every[-1].files and dict(every[-1].files) == FILES
        refused = put_raw(address, every[:-1])
        assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "ended before its last message" in refused.details()
        assert replicas.held(JOB, NODE) is None
        assert files_under(tmp_path / "holder") == []
        assert list((tmp_path / "holder" / REPLICAS / JOB / NODE).iterdir()) == []


def test_a_chunk_of_another_snapshot_in_the_stream_is_refused(tmp_path: Path):
    snapshot = write_snapshot(tmp_path / "own" / "mem_00000004")
    with holding(tmp_path / "holder") as (replicas, address):
        every = list(snapshot_chunks(JOB, NODE, 4, snapshot))
        every[1].step = 5
        refused = put_raw(address, every)
        assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "every chunk of a stream names the same snapshot" in refused.details()
        assert replicas.held(JOB, NODE) is None and files_under(tmp_path / "holder") == []


def test_names_that_are_not_path_safe_are_refused_and_nothing_is_written(tmp_path: Path):
    snapshot = write_snapshot(tmp_path / "own" / "mem_00000003")
    with holding(tmp_path / "holder") as (replicas, address):
        with pytest.raises(PeerError) as refused:
            send(address, snapshot, 3, job="../x")
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "job_id '../x'" in refused.value.message

        escape = keel_pb2.SnapshotChunk(
            job_id=JOB, node=NODE, step=3, file="../../etc/passwd", data=b"root::0:0"
        )
        last = keel_pb2.SnapshotChunk(job_id=JOB, node=NODE, step=3, files={"../../etc/passwd": 9})
        refused = put_raw(address, [escape, last])
        assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "file '../../etc/passwd'" in refused.details()
        assert files_under(tmp_path / "holder") == []
        assert sorted(p.name for p in tmp_path.iterdir()) == ["holder", "own"]


def test_a_copy_over_the_budget_is_refused_counting_the_other_nodes_copies(tmp_path: Path):
    small = {".metadata": 100, "__0.mem": 600 * KIB}
    one = write_snapshot(tmp_path / "own" / "a1", small)
    newer = write_snapshot(tmp_path / "own" / "a2", small)
    other = write_snapshot(tmp_path / "own" / "b1", small)
    with holding(tmp_path / "holder", budget_bytes=1 * MIB) as (replicas, address):
        send(address, one, 1, node="node-a")
        # A newer copy of node-a's replaces the one held: only it counts.
        send(address, newer, 2, node="node-a")
        with pytest.raises(PeerError) as refused:
            send(address, other, 1, node="node-b")
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "replica budget of 1048576 bytes" in refused.value.message
        assert replicas.held(JOB, "node-b") is None
        assert replicas.held(JOB, "node-a")[0] == 2
        assert files_under(tmp_path / "holder" / REPLICAS / JOB / "node-b") == []


def test_a_copy_older_than_the_one_held_is_refused(tmp_path: Path):
    older = write_snapshot(tmp_path / "own" / "mem_00000005")
    newer = write_snapshot(tmp_path / "own" / "mem_00000007")
    with holding(tmp_path / "holder") as (replicas, address):
        send(address, newer, 7)
        with pytest.raises(PeerError) as refused:
            send(address, older, 5)
        assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "older than the copy held (step 7)" in refused.value.message
        assert replicas.held(JOB, NODE)[0] == 7


def test_a_held_copy_is_fetched_byte_identical_and_an_unheld_step_is_not_found(tmp_path: Path):
    snapshot = write_snapshot(tmp_path / "own" / "mem_00000005")
    restored = tmp_path / "restore"
    restored.mkdir()
    with holding(tmp_path / "holder") as (_, address):
        send(address, snapshot, 5)
        step, size = fetch_snapshot(address, None, JOB, NODE, 5, restored, TIMEOUT_S)
        into = restored / "mem_00000005"
        assert (step, size) == (5, sum(FILES.values()))
        assert contents(into) == contents(snapshot)
        # Asked for step 4 or later, it gets the newest held: a copy of a later step
        # arrived after step 4's was reported.
        shutil.rmtree(into)
        assert fetch_snapshot(address, None, JOB, NODE, 4, restored, TIMEOUT_S)[0] == 5

        with pytest.raises(PeerError) as missing:
            fetch_snapshot(address, None, JOB, NODE, 6, restored, TIMEOUT_S)
        assert missing.value.code is grpc.StatusCode.NOT_FOUND
        assert "step 6 or later" in missing.value.message
        assert "the copy held is of step 5" in missing.value.message
        with pytest.raises(PeerError, match="none of that node's is"):
            fetch_snapshot(address, None, JOB, "node-z", 5, restored, TIMEOUT_S)
        # Nothing of the failed fetches is left: no directory, no staging.
        assert sorted(p.name for p in restored.iterdir()) == ["mem_00000005"]


def test_take_moves_the_copy_and_release_gives_back_its_bytes(tmp_path: Path):
    snapshot = write_snapshot(tmp_path / "own" / "mem_00000005")
    with holding(tmp_path / "holder") as (replicas, address):
        send(address, snapshot, 5)
        send(address, snapshot, 5, node="node-b")
        job_memory = tmp_path / "holder" / JOB
        job_memory.mkdir()
        assert replicas.take(JOB, NODE, 6, job_memory) is None  # not that far
        assert replicas.take(JOB, NODE, 4, job_memory) == 5  # the newest held, a later one
        assert contents(job_memory / "mem_00000005") == contents(snapshot)
        assert replicas.held(JOB, NODE) is None

        assert replicas.release(JOB, "the job ended") == sum(FILES.values())
        assert not (tmp_path / "holder" / REPLICAS / JOB).exists()
        assert replicas.held(JOB, "node-b") is None
        assert replicas.release(JOB, "again") == 0


def test_a_replicas_budget_counts_the_copies_a_previous_agent_left(tmp_path: Path):
    snapshot = write_snapshot(tmp_path / "own" / "mem_00000005", {"__0.mem": 700 * KIB})
    with holding(tmp_path / "holder") as (_, address):
        send(address, snapshot, 5, node="node-b")
    stale = tmp_path / "holder" / REPLICAS / JOB / "node-b" / ".incoming-6-abc"
    stale.mkdir()
    (stale / "__0.mem").write_bytes(b"x" * 10)
    with holding(tmp_path / "holder", budget_bytes=1 * MIB) as (replicas, address):
        assert not stale.exists()  # a receive the previous agent never finished
        assert replicas.held(JOB, "node-b")[0] == 5
        with pytest.raises(PeerError, match="replica budget"):
            send(address, snapshot, 5, node="node-a")


def test_a_send_is_paced_to_its_rate(tmp_path: Path):
    snapshot = write_snapshot(tmp_path / "own" / "mem_00000005", {"__0.mem": 3 * MIB})
    rate = 10 * MIB  # bytes per second: 0.3 s for the snapshot
    with holding(tmp_path / "holder") as (_, address):
        size, seconds = send(address, snapshot, 5, rate=rate)
    assert size == 3 * MIB
    assert seconds >= 0.8 * size / rate


class Replicated:
    """What a Replicator reports, with an event set once ``step`` is reported."""

    def __init__(self, step: int):
        self.step = step
        self.calls: list[tuple[str, int, str, int, float]] = []
        self.done = threading.Event()

    def __call__(self, job_id, step, partner, size, seconds):
        self.calls.append((job_id, step, partner, size, seconds))
        if step == self.step:
            self.done.set()


def wait_until(condition, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_the_replicator_sends_the_newest_offer_once_the_send_in_flight_is_done(tmp_path: Path):
    slow = write_snapshot(tmp_path / "own" / "mem_00000001", {"__0.mem": 2 * MIB + 1})
    skipped = write_snapshot(tmp_path / "own" / "mem_00000002", {"__0.mem": 10})
    newest = write_snapshot(tmp_path / "own" / "mem_00000003", {"__0.mem": 20})
    reported = Replicated(step=3)
    with holding(tmp_path / "holder") as (replicas, address):
        replicator = Replicator(NODE, None, 4 * MIB, reported)
        try:
            replicator.offer(JOB, 1, slow, "node-b", address)
            # Step 1 is in flight once its copy is being received: 2 then 3 wait, and
            # only the newest is sent after it.
            node_dir = tmp_path / "holder" / REPLICAS / JOB / NODE
            wait_until(lambda: node_dir.is_dir() and any(node_dir.iterdir()))
            replicator.offer(JOB, 2, skipped, "node-b", address)
            replicator.offer(JOB, 3, newest, "node-b", address)
            assert reported.done.wait(TIMEOUT_S)
        finally:
            replicator.close()
        assert [(job, step, partner, size) for job, step, partner, size, _ in reported.calls] == [
            (JOB, 1, "node-b", 2 * MIB + 1),
            (JOB, 3, "node-b", 20),
        ]
        assert replicator.sent_bytes == 2 * MIB + 21
        assert replicator.sent_s == pytest.approx(sum(call[4] for call in reported.calls))
        assert replicas.held(JOB, NODE)[0] == 3


def test_the_replicator_skips_a_snapshot_removed_before_it_was_sent(tmp_path: Path):
    gone = tmp_path / "own" / "mem_00000001"  # the trainer removed it: a newer one committed
    snapshot = write_snapshot(tmp_path / "own" / "mem_00000002", {"__0.mem": 10})
    reported = Replicated(step=2)
    with holding(tmp_path / "holder") as (replicas, address), capture_logs() as logs:
        replicator = Replicator(NODE, None, 0, reported)
        try:
            replicator.offer(JOB, 1, gone, "node-b", address)
            # The offer no longer waits once the thread has taken it (white box: nothing
            # else shows a skip, which is silent).
            wait_until(lambda: replicator._waiting is None)
            replicator.offer(JOB, 2, snapshot, "node-b", address)
            assert reported.done.wait(TIMEOUT_S)
        finally:
            replicator.close()
    assert [call[1] for call in reported.calls] == [2]
    assert replicas.held(JOB, NODE)[0] == 2
    assert [entry for entry in logs if entry["log_level"] == "warning"] == []


def test_a_failing_partner_is_warned_of_once_until_a_send_to_it_succeeds(tmp_path: Path):
    own = {
        step: write_snapshot(tmp_path / "own" / f"mem_{step:08d}", {"__0.mem": 10})
        for step in (2, 3, 10)
    }
    reported = Replicated(step=10)

    def refused(logs) -> int:
        return sum(entry["event"] == "memory snapshot copy refused" for entry in logs)

    with holding(tmp_path / "holder") as (replicas, address), capture_logs() as logs:
        # The partner holds a newer copy (step 9): it refuses steps 2 and 3.
        send(address, write_snapshot(tmp_path / "own" / "held", {"__0.mem": 10}), 9)
        replicator = Replicator(NODE, None, 0, reported)
        try:
            replicator.offer(JOB, 2, own[2], "node-b", address)
            wait_until(lambda: refused(logs) == 1)
            replicator.offer(JOB, 3, own[3], "node-b", address)
            wait_until(lambda: refused(logs) == 2)
            replicator.offer(JOB, 10, own[10], "node-b", address)
            assert reported.done.wait(TIMEOUT_S)
        finally:
            replicator.close()
    warned = [entry for entry in logs if entry["event"] == "memory snapshot not replicated"]
    assert len(warned) == 1 and warned[0]["step"] == 2 and warned[0]["partner"] == "node-b"
    assert "older than the copy held (step 9)" in warned[0]["error"]
    assert [
        entry["step"] for entry in logs if entry["event"] == "memory snapshots replicated again"
    ] == [10]
    assert [call[1] for call in reported.calls] == [10]
    assert replicas.held(JOB, NODE)[0] == 10


def test_the_replicator_keeps_its_channel_while_sends_succeed_and_opens_another_after_one_fails(
    tmp_path: Path,
):
    own = {
        step: write_snapshot(tmp_path / "own" / f"mem_{step:08d}", {"__0.mem": 10})
        for step in (1, 2, 3)
    }
    with holding(tmp_path / "holder") as (replicas, address):
        reported = Replicated(step=1)
        replicator = Replicator(NODE, None, 0, reported)
        try:
            replicator.offer(JOB, 1, own[1], "node-b", address)
            assert reported.done.wait(TIMEOUT_S)
            first = replicator._channel[1]  # white box: nothing else shows the channel
            reported.step, reported.done = 2, threading.Event()
            replicator.offer(JOB, 2, own[2], "node-b", address)
            assert reported.done.wait(TIMEOUT_S)
            assert replicator._channel[1] is first
            # The partner refuses step 1 now (it holds step 2): the channel goes, and the
            # next send opens another.
            replicator.offer(JOB, 1, own[1], "node-b", address)
            wait_until(lambda: replicator._channel is None)
            reported.step, reported.done = 3, threading.Event()
            replicator.offer(JOB, 3, own[3], "node-b", address)
            assert reported.done.wait(TIMEOUT_S)
            assert replicator._channel[1] is not first
        finally:
            replicator.close()
        assert replicator._channel is None
        assert [call[1] for call in reported.calls] == [1, 2, 3]
        assert replicas.held(JOB, NODE)[0] == 3


def test_close_cancels_a_send_in_flight(tmp_path: Path):
    snapshot = write_snapshot(tmp_path / "own" / "mem_00000001", {"__0.mem": 16 * MIB})
    reported = Replicated(step=1)
    with holding(tmp_path / "holder") as (replicas, address):
        replicator = Replicator(NODE, None, 4 * MIB, reported)  # 4 s to send it all
        replicator.offer(JOB, 1, snapshot, "node-b", address)
        node_dir = tmp_path / "holder" / REPLICAS / JOB / NODE
        wait_until(lambda: node_dir.is_dir() and any(node_dir.iterdir()))
        start = time.monotonic()
        replicator.close()
        assert time.monotonic() - start < 2.0 and not replicator._thread.is_alive()
        # The holder drops the copy it was receiving once the stream is cut.
        wait_until(lambda: not any(node_dir.iterdir()))
    assert reported.calls == [] and replicator.sent_bytes == 0
    assert replicas.held(JOB, NODE) is None


def _bootstrapped(tls_dir: Path, node: str, into: Path):
    """Node ``node``'s certificate as the controller signs it for an agent that
    bootstrapped (``NodeSigner``), written beside its key: its TlsFiles."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from common.node_identity import certificate_request
    from common.tls import TlsFiles
    from orchestrator.security.certs import NodeSigner

    signer = NodeSigner(tls_dir / "ca.pem", tls_dir / "ca.key")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = signer.sign(node, signer.check(node, certificate_request(node, key)), 3600.0)
    (into / f"{node}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (into / f"{node}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return TlsFiles(tls_dir / "ca.pem", into / f"{node}.pem", into / f"{node}.key")


def test_over_mutual_tls_a_copy_goes_to_the_partner_named_and_to_no_other(tmp_path: Path):
    """Agents' certificates are servers' too, under their node's peer name: a copy goes
    to the node the controller named, whichever certificate kind it has (written by
    keel certs init, or signed for a bootstrapped agent), and a node answering at that
    address under another name is refused before a byte is sent."""
    from common.tls import TlsFiles
    from orchestrator.security import certs

    tls_dir = tmp_path / "tls"
    certs.init(tls_dir, agents=("node-a", "node-b"))
    sender = TlsFiles(
        tls_dir / "ca.pem", tls_dir / "agent-node-a.pem", tls_dir / "agent-node-a.key"
    )
    issued = tmp_path / "issued"
    issued.mkdir()
    for holder, files in (
        (
            "node-b",
            TlsFiles(
                tls_dir / "ca.pem", tls_dir / "agent-node-b.pem", tls_dir / "agent-node-b.key"
            ),
        ),
        ("node-c", _bootstrapped(tls_dir, "node-c", issued)),
    ):
        root = tmp_path / holder
        replicas = Replicas(root, 0)
        server, port = serve("127.0.0.1:0", files, replicas)
        try:
            directory = write_snapshot(tmp_path / f"from-{holder}" / "mem_00000003")
            address = f"127.0.0.1:{port}"
            sent = send_snapshot(address, sender, JOB, NODE, 3, directory, 0, TIMEOUT_S, holder)
            assert sent[0] == sum(FILES.values())
            assert replicas.held(JOB, NODE)[0] == 3
            with pytest.raises(PeerError, match="UNAVAILABLE"):
                send_snapshot(address, sender, JOB, NODE, 4, directory, 0, TIMEOUT_S, "node-x")
            assert replicas.held(JOB, NODE)[0] == 3
            fetched = tmp_path / f"fetched-{holder}" / "mem_00000003"
            fetched.parent.mkdir()
            fetch_snapshot(address, sender, JOB, NODE, 3, fetched.parent, TIMEOUT_S, holder)
            assert contents(fetched) == contents(directory)
        finally:
            server.stop(0).wait()
