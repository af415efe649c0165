"""The role table, token checks, `keel certs init` output and the credential flags."""

from __future__ import annotations

import ipaddress
import stat

import grpc
import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from agent.config import security_settings as agent_settings
from common.etcd import etcd_credentials
from orchestrator.security import certs, tls
from orchestrator.security.auth import (
    BOOTSTRAP_SERVICE,
    METHOD_ROLES,
    SERVICE,
    Role,
    Tokens,
    authorize,
)
from protos import keel_pb2

TOKENS = Tokens(join="j-token", operator="o-token", reader="r-token")
READ_ONLY = ("GetJob", "ListJobs", "ListNodes", "ReadLog", "ListCertificates")


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_every_controller_rpc_is_in_the_role_table_and_mutating_ones_are_operator_only():
    methods = {SERVICE + m.name for m in keel_pb2.DESCRIPTOR.services_by_name["Controller"].methods}
    bootstrap = {
        BOOTSTRAP_SERVICE + m.name
        for m in keel_pb2.DESCRIPTOR.services_by_name["Bootstrap"].methods
    }
    assert set(METHOD_ROLES) == methods | bootstrap, "a new RPC needs a row in auth.METHOD_ROLES"
    assert {METHOD_ROLES[m] for m in bootstrap} == {frozenset({Role.JOIN})}
    assert METHOD_ROLES[SERVICE + "Connect"] == {Role.JOIN}
    assert METHOD_ROLES[SERVICE + "SubmitJob"] == {Role.OPERATOR}
    for name in READ_ONLY:
        assert METHOD_ROLES[SERVICE + name] == {Role.READER, Role.OPERATOR}
    mutating = methods - {SERVICE + "Connect"} - {SERVICE + n for n in READ_ONLY}
    assert SERVICE + "DrainNode" in mutating and SERVICE + "StopJob" in mutating
    for method in mutating:
        assert METHOD_ROLES[method] == {Role.OPERATOR}, method


@pytest.mark.parametrize(
    "token,method,allowed",
    [
        ("j-token", "Connect", True),
        ("o-token", "SubmitJob", True),
        ("r-token", "SubmitJob", False),
        ("j-token", "SubmitJob", False),
        ("o-token", "Connect", False),
        ("r-token", "Connect", False),
        *[(t, m, True) for t in ("r-token", "o-token") for m in READ_ONLY],
        *[("j-token", m, False) for m in READ_ONLY],
    ],
)
def test_each_token_may_call_only_its_roles_methods(token, method, allowed):
    denial = authorize(SERVICE + method, bearer(token), TOKENS)
    assert (denial is None) == allowed
    if not allowed:
        assert denial.code is grpc.StatusCode.PERMISSION_DENIED


def test_denials_say_which_token_to_use():
    denial = authorize(SERVICE + "SubmitJob", bearer("r-token"), TOKENS)
    assert denial.message == "the reader token cannot call SubmitJob; use the operator token"
    denial = authorize(SERVICE + "ListNodes", bearer("j-token"), TOKENS)
    assert (
        denial.message == "the join token cannot call ListNodes; use the operator or reader token"
    )
    denial = authorize(SERVICE + "Connect", bearer("o-token"), TOKENS)
    assert denial.message == "the operator token cannot call Connect; use the join token"


@pytest.mark.parametrize(
    "header,message",
    [
        ("", "missing token"),
        (bearer("nope"), "wrong token"),
        (bearer(""), "wrong token"),
        ("Basic o-token", "wrong token"),
        ("o-token", "wrong token"),
    ],
)
def test_missing_or_wrong_tokens_are_unauthenticated(header, message):
    denial = authorize(SERVICE + "ListNodes", header, TOKENS)
    assert denial.code is grpc.StatusCode.UNAUTHENTICATED
    assert denial.message.startswith(message)


def test_a_single_token_is_every_role_and_an_unlisted_method_is_closed_to_all():
    single = Tokens.single("only")
    for method in METHOD_ROLES:
        assert authorize(method, bearer("only"), single) is None
    denial = authorize(SERVICE + "DeleteEverything", bearer("o-token"), TOKENS)
    assert denial.code is grpc.StatusCode.PERMISSION_DENIED
    assert "no role's table" in denial.message


def test_tokens_must_be_set_and_either_one_or_all_different():
    with pytest.raises(ValueError, match="reader token is empty"):
        Tokens("a", "b", "")
    with pytest.raises(ValueError, match="must all differ"):
        Tokens("a", "a", "b")
    with pytest.raises(ValueError, match="non-empty token"):
        Tokens.single("")
    assert "o-token" not in repr(TOKENS)


# ------------------------------------------------------------------ certs init
def load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certs_init_writes_a_ca_every_partys_cert_and_key_and_three_tokens(tmp_path):
    directory = tmp_path / "tls"
    written = certs.init(directory, hosts=("ctl.example.com", "10.0.0.7", "localhost"))
    names = [w.path.name for w in written]
    assert names == [
        "ca.pem",
        "ca.key",
        "controller.pem",
        "controller.key",
        "agent.pem",
        "agent.key",
        "operator.pem",
        "operator.key",
        "reader.pem",
        "reader.key",
        "root.pem",
        "root.key",
        "join.token",
        "operator.token",
        "reader.token",
    ]
    assert sorted(p.name for p in directory.iterdir()) == sorted(names)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for w in written:
        mode = stat.S_IMODE(w.path.stat().st_mode)
        assert mode == w.mode
        assert mode == (0o600 if w.path.suffix in (".key", ".token") else 0o644), w.path

    ca = load(directory / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    controller = load(directory / "controller.pem")
    san = controller.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("10.0.0.7"),
    ]
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "ctl.example.com"]
    usages = {
        "controller": {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH},
        # A server too, to the other agents (agent.peer), under *.agent.keel.
        "agent": {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH},
        "operator": {ExtendedKeyUsageOID.CLIENT_AUTH},
        "reader": {ExtendedKeyUsageOID.CLIENT_AUTH},
        "root": {ExtendedKeyUsageOID.CLIENT_AUTH},
    }
    for party, expected in usages.items():
        cert = load(directory / f"{party}.pem")
        cert.verify_directly_issued_by(ca)
        assert set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == expected
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    shared = load(directory / "agent.pem").extensions
    names = shared.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["*.agent.keel"]
    tokens = {
        (directory / f"{r}.token").read_text().strip() for r in ("join", "operator", "reader")
    }
    assert len(tokens) == 3 and all(len(t) >= 40 for t in tokens)


def test_certs_init_per_agent_and_never_overwrites(tmp_path):
    written = certs.init(tmp_path / "a", agents=("node-0", "node-1"))
    names = {w.path.name for w in written}
    assert {"agent-node-0.pem", "agent-node-0.key", "agent-node-1.pem"} <= names
    assert "agent.pem" not in names
    assert (
        load(tmp_path / "a" / "agent-node-1.pem").subject.rfc4514_string()
        == "CN=keel-agent-node-1,O=Keel"
    )
    names = load(tmp_path / "a" / "agent-node-1.pem").extensions
    names = names.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["node-1.agent.keel"]

    before = (tmp_path / "a" / "ca.pem").read_bytes()
    with pytest.raises(FileExistsError, match="never overwrites"):
        certs.init(tmp_path / "a", agents=("node-0", "node-1"))
    assert (tmp_path / "a" / "ca.pem").read_bytes() == before
    with pytest.raises(ValueError, match="--agent 'a b'"):
        certs.init(tmp_path / "b", agents=("a b",))
    with pytest.raises(ValueError, match="no port"):
        certs.init(tmp_path / "b", hosts=("ctl:443",))
    assert not (tmp_path / "b").exists()


def test_keel_certs_init_prints_what_it_wrote(tmp_path):
    result = CliRunner().invoke(
        certs.certs, ["init", str(tmp_path / "tls"), "--host", "ctl.example.com"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 15
    assert any(
        "controller.pem" in line and "SAN 127.0.0.1, localhost, ctl.example.com" in line
        for line in lines
    )
    assert any("ca.key" in line and " 0600 " in line for line in lines)
    again = CliRunner().invoke(certs.certs, ["init", str(tmp_path / "tls")])
    assert again.exit_code == 2 and "never overwrites" in again.output


# ------------------------------------------------------------- credential flags
NO_FLAGS = dict(
    tls_dir=None,
    ca=None,
    cert=None,
    key=None,
    etcd_ca=None,
    etcd_cert=None,
    etcd_key=None,
    etcd_user=None,
    etcd_password=None,
    join_token_file=None,
    operator_token_file=None,
    reader_token_file=None,
)


def test_controller_tokens_single_or_per_role_from_flags_or_the_tls_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("KEEL_TOKEN", raising=False)
    directory = tmp_path / "tls"
    certs.init(directory)
    (tmp_path / "one").write_text("one-token\n")

    settings = tls.controller_settings(None, {**NO_FLAGS, "tls_dir": str(directory)})
    assert (
        settings["token"] == ""
        and settings["tokens"].join == (directory / "join.token").read_text().strip()
    )
    assert settings["tls"].cert == directory / "controller.pem"
    assert settings["etcd_credentials"] is None

    # --token-file keeps today's meaning, one token for every role, even beside --tls-dir.
    settings = tls.controller_settings(
        str(tmp_path / "one"), {**NO_FLAGS, "tls_dir": str(directory)}
    )
    assert (settings["token"], settings["tokens"]) == ("one-token", None)
    assert settings["tls"] is not None

    with pytest.raises(ValueError, match="not both"):
        tls.controller_settings(
            str(tmp_path / "one"), {**NO_FLAGS, "join_token_file": str(tmp_path / "one")}
        )
    with pytest.raises(ValueError, match="operator.token, reader.token missing"):
        tls.controller_settings(None, {**NO_FLAGS, "join_token_file": str(tmp_path / "one")})
    with pytest.raises(ValueError, match="needs --cert, --key too"):
        tls.controller_settings(None, {**NO_FLAGS, "ca": str(directory / "ca.pem")})

    monkeypatch.setenv("KEEL_TOKEN", "from-env")
    settings = tls.controller_settings(None, NO_FLAGS)
    assert (settings["token"], settings["tokens"], settings["tls"]) == ("from-env", None, None)


def test_clients_take_their_identity_from_the_tls_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("KEEL_TOKEN", raising=False)
    full = tmp_path / "tls"
    certs.init(full, agents=("node-0",))
    token, files, _ = tls.client_settings(None, {**NO_FLAGS, "tls_dir": str(full)})
    assert files.cert == full / "operator.pem"
    assert token == (full / "operator.token").read_text().strip()

    reader = tmp_path / "reader"
    reader.mkdir()
    for name in ("ca.pem", "reader.pem", "reader.key", "reader.token"):
        (reader / name).write_bytes((full / name).read_bytes())
    token, files, _ = tls.client_settings(None, {**NO_FLAGS, "tls_dir": str(reader)})
    assert (files.cert, files.key) == (reader / "reader.pem", reader / "reader.key")
    assert token == (full / "reader.token").read_text().strip()

    agent = agent_settings("node-0", None, tls_dir=str(full))
    assert agent["tls"].cert == full / "agent-node-0.pem"
    assert agent["token"] == (full / "join.token").read_text().strip()
    with pytest.raises(ValueError, match="neither agent-node-9.pem nor agent.pem"):
        agent_settings("node-9", None, tls_dir=str(full))


def test_etcd_credentials_map_onto_etcd3_client(tmp_path):
    for name in ("ca.pem", "c.pem", "c.key"):
        (tmp_path / name).write_text("x")
    flags = dict(
        etcd_ca=str(tmp_path / "ca.pem"),
        etcd_cert=str(tmp_path / "c.pem"),
        etcd_key=str(tmp_path / "c.key"),
        etcd_user="keel",
        etcd_password="pw",
    )
    for credentials in (
        etcd_credentials(**flags),
        agent_settings("n0", None, **flags)["etcd_credentials"],
    ):
        assert credentials.client_kwargs() == {
            "ca_cert": str(tmp_path / "ca.pem"),
            "cert_cert": str(tmp_path / "c.pem"),
            "cert_key": str(tmp_path / "c.key"),
            "user": "keel",
            "password": "pw",
        }
        assert "pw" not in repr(credentials)
    assert etcd_credentials() is None
    with pytest.raises(ValueError, match="--etcd-user and --etcd-password"):
        etcd_credentials(etcd_user="keel")
    with pytest.raises(ValueError, match="--etcd-cert and --etcd-key go together"):
        etcd_credentials(etcd_ca=flags["etcd_ca"], etcd_cert=flags["etcd_cert"])
    with pytest.raises(ValueError, match="needs --etcd-ca"):
        agent_settings("n0", None, etcd_cert=flags["etcd_cert"], etcd_key=flags["etcd_key"])


def test_init_once_signs_what_an_older_directory_lacks_with_its_own_ca(tmp_path):
    directory = tmp_path / "tls"
    certs.init(directory)
    (directory / "root.pem").unlink()
    (directory / "root.key").unlink()
    before = (directory / "ca.pem").read_bytes()
    certs.init_once(directory, agents=("node-0",))
    assert (directory / "ca.pem").read_bytes() == before
    ca = load(directory / "ca.pem")
    issued = {"root": "CN=root,O=Keel", "agent-node-0": "CN=keel-agent-node-0,O=Keel"}
    for party, name in issued.items():
        cert = load(directory / f"{party}.pem")
        cert.verify_directly_issued_by(ca)
        assert cert.subject.rfc4514_string() == name
        assert stat.S_IMODE((directory / f"{party}.key").stat().st_mode) == 0o600


def test_keel_certs_add_signs_a_new_nodes_certificate_with_the_directorys_ca(tmp_path):
    directory = tmp_path / "tls"
    certs.init(directory, agents=("node-0",))
    result = CliRunner().invoke(certs.certs, ["add", str(directory), "--agent", "node-1"])
    assert result.exit_code == 0, result.output
    assert len(result.output.splitlines()) == 2
    cert = load(directory / "agent-node-1.pem")
    cert.verify_directly_issued_by(load(directory / "ca.pem"))
    assert cert.subject.rfc4514_string() == "CN=keel-agent-node-1,O=Keel"
    again = CliRunner().invoke(certs.certs, ["add", str(directory), "--agent", "node-0"])
    assert again.exit_code != 0 and "never overwrites" in again.output
    bad = CliRunner().invoke(certs.certs, ["add", str(directory), "--agent", "a b"])
    assert bad.exit_code != 0 and "--agent 'a b'" in bad.output
