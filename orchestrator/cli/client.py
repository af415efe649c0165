"""The one client of the controller that ``keel up`` and the operator verbs share: it
finds the leader in etcd (or is given an address), and follows it when it changes.

A standby answers every call UNAVAILABLE; so does a controller that has gone. A
controller that stalls (SIGSTOP, a frozen host) answers nothing, and the call's
deadline passes. Either way the client looks the leader up again and retries until
``wait_s`` after the first try, so a failover in progress costs a pause, not an error.
A call whose effect is not safe to repeat (``NOT_REPEATABLE``) is retried after a
refusal only: past a deadline it may have been carried out.
"""

from __future__ import annotations

import time

import grpc

from common.etcd import EtcdCredentials, connect
from common.rpc import channel
from common.tls import TlsFiles, call_metadata
from orchestrator.controller.store import Store
from protos import keel_pb2_grpc

RPC_TIMEOUT_S = 10.0
RETRY_S = 0.2
# A second SubmitJob of a job that was submitted is refused ALREADY_EXISTS, a second
# ReplaceNode FAILED_PRECONDITION; every other call may be repeated.
NOT_REPEATABLE = frozenset({"SubmitJob", "ReplaceNode", "DeleteJob"})


class NoController(Exception):
    """No controller could be found: etcd did not answer (``etcd_error`` is the gRPC
    error it answered with, if it did), or none is published there (``unpublished``)."""

    def __init__(
        self, message: str, etcd_error: grpc.RpcError | None = None, unpublished: bool = False
    ):
        super().__init__(message)
        self.etcd_error = etcd_error
        self.unpublished = unpublished


class ControllerClient:
    def __init__(
        self,
        token: str,
        *,
        etcd_endpoints: list[str] | None = None,
        controller: str | None = None,
        tls_files: TlsFiles | None = None,
        etcd_credentials: EtcdCredentials | None = None,
        wait_s: float = 60.0,
        rpc_timeout_s: float = RPC_TIMEOUT_S,
    ):
        """``controller`` (host:port) pins the address; otherwise the leader is read
        from etcd at ``etcd_endpoints`` (one of the two must be given)."""
        if not controller and not etcd_endpoints:
            raise ValueError("give --controller HOST:PORT, or --etcd-endpoints to find the leader")
        self.store = (
            Store(connect(etcd_endpoints, rpc_timeout_s, etcd_credentials))
            if etcd_endpoints
            else None
        )
        self.fixed = controller
        self.metadata = call_metadata(token)
        self.tls_files = tls_files
        self.wait_s = wait_s
        self.rpc_timeout_s = rpc_timeout_s
        self.address: str | None = None
        self.channel: grpc.Channel | None = None
        self.leaders: list[str] = []  # every leader seen, by id, in order

    def _stub(self) -> keel_pb2_grpc.ControllerStub:
        address = self.fixed
        if address is None:
            try:
                leader = self.store.leader()
            except grpc.RpcError as exc:  # e.g. PERMISSION_DENIED: etcd user or password
                raise NoController(f"{exc.code().name}: {exc.details()}", exc) from None
            except Exception as exc:  # etcd3's ConnectionFailedError and kin
                raise NoController(str(exc)) from None
            if leader is None:
                raise NoController("no controller is published in etcd", unpublished=True)
            address = leader.address
            if not self.leaders or self.leaders[-1] != leader.id:
                self.leaders.append(leader.id)
        if address != self.address:
            if self.channel is not None:
                self.channel.close()
            self.address = address
            self.channel = channel(address, self.tls_files)
        return keel_pb2_grpc.ControllerStub(self.channel)

    def call(self, method: str, request):
        """One call to the leader. While there is none answering (a failover, a stalled
        leader, etcd briefly out of reach), retry until ``wait_s`` after the first try;
        then raise the last error (a grpc.RpcError, or NoController)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return getattr(self._stub(), method)(
                    request, metadata=self.metadata, timeout=self.rpc_timeout_s
                )
            except grpc.RpcError as exc:
                retry = exc.code() is grpc.StatusCode.UNAVAILABLE or (
                    exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and method not in NOT_REPEATABLE
                )
                if not retry or time.monotonic() > deadline:
                    raise
            except NoController as exc:
                if exc.etcd_error is not None or time.monotonic() > deadline:
                    raise
            time.sleep(RETRY_S)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
