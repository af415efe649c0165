"""Restart in place, the rank's side (trainer.runtime.in_place): which errors a rank may
live on after, and severing the connections of the generation it leaves."""

import socket

import pytest

from trainer.runtime.in_place import GenerationEnded, ended_under_the_rank, sever, tcp_connections

GLOO_LOST_PEER = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:3213. This is typically caused by a "
    "remote worker crashing."
)


class DistBackendError(RuntimeError):
    """Named as torch.distributed's is (the module matches by class name, without torch)."""


class StartBarrierError(RuntimeError):
    pass


class CheckpointException(BaseException):
    def __init__(self, failures):
        super().__init__("a save failed")
        self.failures = failures


def raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as cause:
            raise outer from cause
    except BaseException as error:
        return error


@pytest.mark.parametrize(
    "error, restartable",
    [
        (RuntimeError(GLOO_LOST_PEER), True),
        (RuntimeError("Rank 1 failed to pass monitoredBarrier in 30000 ms"), True),
        (DistBackendError("NCCL error: remote process exited"), True),
        (StartBarrierError("ranks 2, 3 did not reach the start barrier"), True),
        (GenerationEnded("asked to leave"), True),
        (CheckpointException({1: RuntimeError(GLOO_LOST_PEER)}), True),
        (raised_from(ValueError("the loop gave up"), RuntimeError(GLOO_LOST_PEER)), True),
        # The rank's own failures follow it into the next generation: a fresh process.
        (RuntimeError("injected crash at step 12 on rank 1"), False),
        (ValueError("loss is nan"), False),
        (MemoryError(), False),
        (KeyboardInterrupt(), False),
        (SystemExit(1), False),
        (CheckpointException({0: OSError(28, "No space left on device")}), False),
    ],
)
def test_only_a_generation_ending_under_the_rank_lets_it_live_on(error, restartable):
    assert ended_under_the_rank(error) is restartable


def test_severing_shuts_down_the_generations_connections_and_keeps_the_older_ones():
    listener = socket.create_server(("127.0.0.1", 0))
    older = socket.create_connection(listener.getsockname())
    older_peer, _ = listener.accept()
    keep = set(tcp_connections().values())
    newer = socket.create_connection(listener.getsockname())
    newer_peer, _ = listener.accept()
    try:
        assert sever(keep) == 2  # the new connection's two ends, both ours here
        # The far end sees the connection end at once; the descriptors stay open.
        newer_peer.settimeout(5)
        assert newer_peer.recv(1) == b"" and newer.fileno() >= 0
        older.sendall(b"x")
        assert older_peer.recv(1) == b"x"
        # The listening socket was left alone: it still accepts.
        socket.create_connection(listener.getsockname()).close()
    finally:
        for s in (listener, older, older_peer, newer, newer_peer):
            s.close()
