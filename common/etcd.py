"""The one etcd client of every Keel process: it outlives etcd restarts and brief
outages. Also the credentials it uses (from the ``common.flags.etcd_options`` flags, and
as flags for a child daemon), and ``connect``.

python3-etcd3's own client, as it comes, does not: after one UNAVAILABLE it refuses its
endpoint for 300 s (``Endpoint.time_retry``), gRPC's reconnect back-off grows to two
minutes, and with etcd auth it logs in once, while etcd forgets its tokens when it
restarts. And once its current member fails a call it picks another only while that one
is still failing: a call retried after the member's short retry interval went back to
it, so a client whose every retry came later (a watch re-reading) stayed on a stalled
member for good. This client passes a member that failed a call over for
``MEMBER_PASSED_OVER_S`` while another has not failed that recently (and, all having
failed, tries the one that failed longest ago, at once: one etcd restarting is retried
without a pause), caps the reconnect back-off, and logs in again when etcd no longer
knows its token. A call during an outage still fails (callers retry, as every
loop of ours does); the call after etcd is back succeeds.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import etcd3
import etcd3.watch
import grpc
from etcd3 import etcdrpc
from etcd3.client import EtcdTokenCallCredentials

from common.metrics import EtcdCallMetrics
from common.rpc import MESSAGE_LIMITS

MEMBER_PASSED_OVER_S = 30.0
# gRPC's default reconnect back-off reaches 120 s; an etcd that is back is found within
# this instead. (With Keel's message limits, ``common.rpc``: gRPC's default 4 MiB would
# fail a range read past it.) Keepalive pings while a call is open: a unary call has its
# deadline, but a watch has none, and one on a member that stalled (SIGSTOP, or its
# traffic dropped: the kernel may still acknowledge TCP) would wait for good, its
# follower never learning of a new leader. A ping unanswered for WATCH_PING_TIMEOUT_S
# ends the stream; the watch (``common.watch``) reads again, which fails over to another
# member. etcd answers pings more often than every 5 s (its --grpc-keepalive-min-time)
# with GOAWAY, hence the period; pings go even while the watch carries no data. gRPC
# 1.85 enforces the keepalive timeout only through ``ping_timeout_ms`` (without it a
# ping to a SIGSTOPped member waited for good, tests/integration/test_leader_watch.py),
# which also bounds gRPC's own bandwidth probes: a member that answers no ping for 3 s
# is left either way.
WATCH_PING_S = 10.0
WATCH_PING_TIMEOUT_S = 3.0
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", int(WATCH_PING_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(WATCH_PING_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", int(WATCH_PING_TIMEOUT_S * 1000)),
]


@dataclass(frozen=True)
class EtcdCredentials:
    """How an etcd client proves itself: TLS (``ca`` alone to verify the server,
    ``cert``/``key`` too when etcd demands client certificates) and/or a user and
    password (etcd auth enabled)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise ValueError("--etcd-cert and --etcd-key go together")
        if self.cert and not self.ca:
            raise ValueError("--etcd-cert needs --etcd-ca (the CA of etcd's server certificate)")
        if bool(self.user) != bool(self.password):
            raise ValueError("--etcd-user and --etcd-password (or KEEL_ETCD_PASSWORD) go together")

    def client_kwargs(self) -> dict:
        """Keyword arguments of python3-etcd3's clients."""
        found = {
            "ca_cert": self.ca,
            "cert_cert": self.cert,
            "cert_key": self.key,
            "user": self.user,
            "password": self.password,
        }
        return {k: str(v) for k, v in found.items() if v}


def etcd_credentials(
    etcd_ca=None, etcd_cert=None, etcd_key=None, etcd_user=None, etcd_password=None, **_
) -> EtcdCredentials | None:
    """The etcd credentials of the ``common.flags.etcd_options`` flags; None if none
    is given."""
    if not (etcd_ca or etcd_cert or etcd_key or etcd_user or etcd_password):
        return None
    return EtcdCredentials(
        ca=Path(etcd_ca) if etcd_ca else None,
        cert=Path(etcd_cert) if etcd_cert else None,
        key=Path(etcd_key) if etcd_key else None,
        user=etcd_user or None,
        password=etcd_password or None,
    )


def etcd_flags(credentials: EtcdCredentials | None) -> list[str]:
    """The flags that hand ``credentials`` to a child daemon, bar the password (the
    child reads that from KEEL_ETCD_PASSWORD)."""
    if credentials is None:
        return []
    flags = {
        "--etcd-ca": credentials.ca,
        "--etcd-cert": credentials.cert,
        "--etcd-key": credentials.key,
        "--etcd-user": credentials.user,
    }
    return [part for flag, value in flags.items() if value for part in (flag, str(value))]


def host_port(endpoint: str) -> tuple[str, int]:
    """An etcd endpoint "host:port", split; raises ValueError with the fix."""
    host, _, port = endpoint.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {endpoint!r}: write it as host:port")
    return host, int(port)


class _Endpoint(etcd3.Endpoint):
    """An etcd member whose unary calls are timed and counted (``common.metrics``)."""

    def _mkchannel(self, opts):
        return grpc.intercept_channel(super()._mkchannel(opts), EtcdCallMetrics())


# python3-etcd3 0.13's watcher still calls ``six.itervalues`` when a watch stream fails
# (etcd restarted, or out of reach) but no longer imports six: without this its thread
# dies of a NameError before telling the callbacks, so a watch that etcd's restart ends
# is never reported, and a LeaderWatch goes on naming the old leader for good
# (tests/integration/test_leader_watch.py).
if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = types.SimpleNamespace(itervalues=lambda mapping: iter(mapping.values()))


class EtcdClient(etcd3.MultiEndpointEtcd3Client):
    def __init__(
        self, endpoints: list[str], timeout_s: float, credentials: EtcdCredentials | None = None
    ):
        """``endpoints``: "host:port" of every etcd member; ``timeout_s``: deadline of
        each call."""
        kwargs = credentials.client_kwargs() if credentials else {}
        secure = "ca_cert" in kwargs
        creds = (
            self.get_secure_creds(
                kwargs["ca_cert"], kwargs.get("cert_key"), kwargs.get("cert_cert")
            )
            if secure
            else None
        )
        members = [
            _Endpoint(
                host,
                port,
                secure=secure,
                creds=creds,
                time_retry=0,  # which member a call goes to: ``channel``
                opts=[*CHANNEL_OPTIONS, *MESSAGE_LIMITS],
            )
            for host, port in map(host_port, endpoints)
        ]
        if not members:
            raise ValueError("etcd endpoints: give at least one host:port")
        self._user, self._password = kwargs.get("user"), kwargs.get("password")
        self._secure = secure
        super().__init__(endpoints=members, timeout=timeout_s, failover=True)
        if self._user:
            self._log_in()

    @property
    def channel(self) -> grpc.Channel:
        """The channel of the member the next call goes to: the current one unless it
        failed a call in the last ``MEMBER_PASSED_OVER_S``; else the first that has not;
        else the one that failed longest ago."""
        now = time.time()

        def passed_over(member) -> bool:
            return now - member.last_failed < MEMBER_PASSED_OVER_S

        current = self.endpoint_in_use
        if current is None or passed_over(current):
            label = next(
                (label for label, member in self.endpoints.items() if not passed_over(member)),
                min(self.endpoints, key=lambda label: self.endpoints[label].last_failed),
            )
            self._current_endpoint_label = label  # drops the stubs of the member left
            current = self.endpoints[label]
        return current.use()

    def leave_member(self) -> None:
        """Count the current member as failed (a stream on it ended, not a call):
        the next call goes to another if one has not failed lately."""
        if self.endpoint_in_use is not None:
            self.endpoint_in_use.fail()

    def _manage_grpc_errors(self, exc: grpc.RpcError):
        if exc.code() is grpc.StatusCode.UNAUTHENTICATED and self._user:
            # etcd restarted and forgot our token: the next call goes with a new one.
            try:
                self._log_in()
            except grpc.RpcError:
                pass  # etcd not ready yet: the next failure tries again
        super()._manage_grpc_errors(exc)

    def _log_in(self) -> None:
        response = self.authstub.Authenticate(
            etcdrpc.AuthenticateRequest(name=self._user, password=self._password), self.timeout
        )
        self.metadata = (("token", response.token),)
        # gRPC sends call credentials over TLS only; in plaintext the metadata carries it.
        self.call_credentials = (
            grpc.metadata_call_credentials(EtcdTokenCallCredentials(response.token))
            if self._secure
            else None
        )


def connect(
    endpoints: list[str], timeout_s: float, credentials: EtcdCredentials | None = None
) -> EtcdClient:
    """An etcd client over ``endpoints`` ("host:port", failing over between them), over
    TLS and/or with a user and password if ``credentials`` say so, with ``timeout_s``
    the deadline of each call."""
    return EtcdClient(endpoints, timeout_s, credentials)


PAGE = 500  # keys a paged read asks for at a time (fewer if a page's values are too large)


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    end[-1] += 1
    return bytes(end)


def read_prefix(client: EtcdClient, prefix: str, keys_only: bool = False) -> tuple[list, int, int]:
    """Every key-value under ``prefix``, in key order, read page by page at the revision
    of the first page (a page of values past the message limit is asked for again
    smaller); returns (kvs, that revision, the cluster id)."""
    found: list = []
    start, end = prefix.encode(), prefix_end(prefix.encode())
    revision, page = None, PAGE
    while True:
        try:
            response = client.get_range_response(
                start, end, limit=page, revision=revision, keys_only=keys_only
            )
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED or page == 1:
                raise
            page = max(1, page // 4)
            continue
        revision = revision or response.header.revision
        found.extend(response.kvs)
        if not response.more or not response.kvs:
            return found, revision, response.header.cluster_id
        start = response.kvs[-1].key + b"\0"
