"""deploy/docker, deploy/systemd, deploy/kubernetes and deploy/slurm: every Keel
command line in them (unit ExecStart lines, container args, the sbatch script, the
shell blocks of their READMEs) uses only options the real click commands define, and
each recipe keeps the properties a deployment depends on: the agent's stop grace
exceeds its drain timeout, the agent reaches GPUs, the daemons hold no Kubernetes
API rights, the image pins the torch it is given.

The Kubernetes objects are checked against the API's own schemas (kubernetes-validate,
offline); the ServiceMonitor, a CRD, structurally."""

from __future__ import annotations

import configparser
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
import kubernetes_validate
import pytest
import yaml

from agent.__main__ import main as agent_command
from common import env
from orchestrator.cli.main import main as keel_group
from orchestrator.local.etcd_server import STORAGE_FLAGS
from orchestrator.security.certs import TOKENS
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
RECIPE_DIRS = ("docker", "systemd", "kubernetes", "slurm")
SYSTEMD = DEPLOY / "systemd"
KUBERNETES = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
SBATCH = DEPLOY / "slurm" / "keel.sbatch"
# The agent's SIGTERM drain lasts at most --drain-timeout-s; this is its default.
DEFAULT_DRAIN_TIMEOUT_S = float(
    agent_command.params[[p.name for p in agent_command.params].index("drain_timeout_s")].default
)
# What Keel itself reads from a daemon's environment (common/env.py).
DAEMON_ENV = {env.TOKEN, env.ETCD_ENDPOINTS, env.ETCD_PASSWORD, env.LOG_FORMAT, env.LOG_LEVEL}
# ca.key: the controllers sign each node's own certificate (TLS bootstrapping); the
# agents' Secret has no key of the CA's. agent.pem is etcd's only: the controller
# refuses a Hello over it (no --allow-shared-agent-certificate).
CONTROLLER_FILES = {"ca.pem", "ca.key", "controller.pem", "controller.key"} | {
    f"{t}.token" for t in TOKENS
}
AGENT_FILES = {"ca.pem", "agent.pem", "agent.key", "join.token"}


# ------------------------------------------------------------------ command lines
@dataclass(frozen=True)
class Invocation:
    where: str  # file and what in it
    words: tuple[str, ...]  # after `keel` (or ["agent", ...] for `python -m agent`)


SHELL_OPERATORS = {"|", "||", "&&", ";", "&", "(", ")", "!", "then", "do", "else", "{", "}"}
COMMAND_PREFIXES = {"exec", "nohup", "time", "sudo", "env", "if", "elif", "while", "until"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
IMAGE = re.compile(r"^([\w.-]+(:\d+)?/)*keel:[\w.-]+$")


def _tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def _until_operator(tokens: list[str]) -> tuple[str, ...]:
    words = []
    for token in tokens:
        if (
            token in SHELL_OPERATORS
            or token.startswith((">", "<"))
            or re.fullmatch(r"\d>.*", token)
        ):
            break
        words.append(token)
    return tuple(words)


def _is_keel(token: str) -> bool:
    return token == "keel" or token.endswith("/bin/keel")


def invocations_in_tokens(tokens: list[str], where: str) -> list[Invocation]:
    """Keel invocations among one shell command line's tokens: `keel ...` (or a path
    ending in bin/keel) and `python -m agent ...` where a command starts, and a
    `docker run` of a keel image."""
    found = []
    at_command = True
    for i, token in enumerate(tokens):
        if at_command and _is_keel(token):
            found.append(Invocation(where, _until_operator(tokens[i + 1 :])))
        elif (
            at_command
            and re.fullmatch(r"(\S*/)?python3?", token)
            and tokens[i + 1 : i + 3] == ["-m", "agent"]
        ):
            found.append(Invocation(where, ("agent", *_until_operator(tokens[i + 3 :]))))
        elif token == "run" and i > 0 and tokens[i - 1] == "docker":
            rest = _until_operator(tokens[i + 1 :])
            image = next((j for j, word in enumerate(rest) if IMAGE.match(word)), None)
            if image is not None:
                found.append(Invocation(where, rest[image + 1 :]))
        at_command = (
            token in SHELL_OPERATORS
            or token in COMMAND_PREFIXES
            or (at_command and ASSIGNMENT.match(token) is not None)
        )
    return found


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined."""
    return text.replace("\\\n", " ").splitlines()


def shell_invocations(text: str, where: str) -> list[Invocation]:
    return [
        found
        for line in logical_lines(text)
        for found in invocations_in_tokens(_tokens(line), where)
    ]


def comment_invocations(text: str, where: str) -> list[Invocation]:
    """Command lines shown in comments (`# keel certs init ...`), continuations
    included; prose is passed over."""
    found, pending = [], ""
    for line in text.splitlines():
        content = line.strip()
        if not content.startswith("#"):
            pending = ""
            continue
        content = content.lstrip("#").strip()
        if pending or content.startswith("keel "):
            pending += " " + content.removesuffix("\\")
            if not content.endswith("\\"):
                found += invocations_in_tokens(_tokens(pending), where)
                pending = ""
    return found


def markdown_blocks(text: str, languages=("", "bash", "sh")) -> list[str]:
    """The blocks fenced as one of ``languages`` ("": unmarked); fences of other
    languages are paired too, so that their closing fence never opens a block."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    return [body for language, body in blocks if language in languages]


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(
        strict=False,
        interpolation=None,
        delimiters=("=",),
        comment_prefixes=("#", ";"),
        empty_lines_in_values=False,
    )
    parser.optionxform = str
    parser.read_string(path.read_text())
    return parser


def yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kubernetes_objects() -> list[tuple[Path, dict]]:
    return [
        (path, doc)
        for path in sorted(KUBERNETES.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml_documents(path)
    ]


def containers(pod_spec: dict) -> list[dict]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def kubernetes_invocations() -> list[Invocation]:
    """Each container that runs the keel image's entrypoint (no command) or names
    keel in its command."""
    found = []
    for path, doc in kubernetes_objects():
        template = doc.get("spec", {}).get("template")
        if template is None:
            continue
        for container in containers(template["spec"]):
            where = f"{path.name}: {doc['metadata']['name']}/{container['name']}"
            command = [str(word) for word in container.get("command", [])]
            args = [str(word) for word in container.get("args", [])]
            if not command and container["image"].split(":")[0].endswith("keel"):
                found.append(Invocation(where, tuple(args)))
            elif command and _is_keel(command[0]):
                found.append(Invocation(where, tuple(command[1:] + args)))
    return found


def all_invocations() -> list[Invocation]:
    found = []
    for directory in RECIPE_DIRS:
        for path in sorted((DEPLOY / directory).iterdir()):
            where = str(path.relative_to(REPO))
            text = path.read_text()
            if path.suffix == ".md":
                found += [
                    i for block in markdown_blocks(text) for i in shell_invocations(block, where)
                ]
            elif path.suffix == ".sbatch":
                found += shell_invocations(text, where)
            else:
                found += comment_invocations(text, where)
            if path.suffix == ".service":
                found += [
                    i
                    for line in unit(path)["Service"].get("ExecStart", "").splitlines()
                    for i in shell_invocations(line.lstrip("-@+!:"), f"{where}: ExecStart")
                ]
    return found + kubernetes_invocations()


def resolve(words: tuple[str, ...]) -> tuple[click.Command, list[str], tuple[str, ...]]:
    """The click command ``words`` run (`agent` is python -m agent's), its name and
    the words after the command's name."""
    command, name, rest = keel_group, ["keel"], list(words)
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        sub = command.commands.get(rest[0])
        if sub is None:
            raise LookupError(f"`{' '.join(name)} {rest[0]}`: no such command")
        command, name = sub, [*name, rest.pop(0)]
        if name == ["keel", "agent"]:
            command = agent_command
    return command, rest, tuple(name)


def check_options(invocation: Invocation, complete: bool = True) -> list[str]:
    """What is wrong with one command line: a command or option that does not exist,
    and when it is meant to be ``complete`` (not a mention in prose), an option without
    its value or a required option that is neither given nor read from the
    environment. Words after `--`, or after the first argument of a command that takes
    its options before its arguments only (`keel run SCRIPT ARGS`), are not its own."""
    try:
        command, rest, name = resolve(invocation.words)
    except LookupError as exc:
        return [f"{invocation.where}: {exc}"]
    options = {
        opt: param
        for param in command.params
        if isinstance(param, click.Option)
        for opt in (*param.opts, *param.secondary_opts)
    }
    options.update({opt: None for opt in command.get_help_option_names(click.Context(command))})
    problems, given = [], set()
    interspersed = command.context_settings.get("allow_interspersed_args", True)
    words = iter(rest)
    for word in words:
        if word == "--":
            break
        if not word.startswith("-") or word == "-":
            if not interspersed:
                break
            continue
        flag, has_value, _ = word.partition("=")
        if flag not in options:
            problems.append(f"{invocation.where}: `{' '.join(name)}` has no option {flag}")
            continue
        param = options[flag]
        given.add(param.name if param else "help")
        if (
            param is not None
            and not param.is_flag
            and not has_value
            and next(words, None) is None
            and complete
        ):
            problems.append(f"{invocation.where}: {flag} lacks its value")
    if "help" not in given and complete:
        for param in command.params:
            if (
                isinstance(param, click.Option)
                and param.required
                and not param.envvar
                and param.name not in given
            ):
                problems.append(f"{invocation.where}: `{' '.join(name)}` needs {param.opts[0]}")
    return problems


def invocations_of(
    name: tuple[str, ...], found: list[Invocation] | None = None
) -> list[Invocation]:
    return [
        i
        for i in (found if found is not None else all_invocations())
        if resolve(i.words)[2] == name
    ]


def option_value(invocation: Invocation, flag: str) -> str:
    words = list(invocation.words)
    for i, word in enumerate(words):
        if word == flag:
            return words[i + 1]
        if word.startswith(flag + "="):
            return word.partition("=")[2]
    raise AssertionError(f"{invocation.where}: no {flag}")


def test_the_extractor_finds_commands_where_a_shell_runs_them():
    line = (
        'JOB=$(keel submit --check "$SPEC" | python3 -c "x") && exec keel agent --node n '
        "--host \"$(hostname -i | cut -d ' ' -f 1)\"; kubectl -n keel logs x; "
        "docker run --rm -v a:b registry.example.com/keel:0.1 status --json"
    )
    found = shell_invocations(line, "here")
    assert [i.words for i in found] == [
        ("submit", "--check", "$SPEC"),
        ("agent", "--node", "n", "--host", "$(hostname -i | cut -d ' ' -f 1)"),
        ("status", "--json"),
    ]
    assert check_options(Invocation("here", ("agent", "--node", "n", "--slot", "2"))) == [
        "here: `keel agent` has no option --slot",
        "here: `keel agent` needs --slots",
    ]
    assert check_options(Invocation("here", ("stauts",))) == [
        "here: `keel stauts`: no such command"
    ]


def test_every_command_line_in_the_recipes_uses_only_real_options():
    found = all_invocations()
    problems = [problem for invocation in found for problem in check_options(invocation)]
    assert not problems, "\n".join(problems)
    # The recipes the daemons run from are all seen.
    wheres = {i.where.split(":")[0] for i in found}
    assert {
        "deploy/systemd/keel-controller.service",
        "deploy/systemd/keel-agent.service",
        "controller.yaml",
        "agent.yaml",
        "deploy/slurm/keel.sbatch",
        "deploy/docker/README.md",
    } <= wheres, wheres
    names = {resolve(i.words)[2] for i in found}
    assert {
        ("keel", "controller"),
        ("keel", "agent"),
        ("keel", "submit"),
        ("keel", "events"),
        ("keel", "status"),
        ("keel", "certs", "init"),
    } <= names, names


# ------------------------------------------------------------------------ systemd
def env_file(path: Path) -> dict[str, str]:
    """KEY=value lines, and commented-out `#KEY=` ones (as "")."""
    values = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"(#?)([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            values[match[2]] = "" if match[1] else match[3]
    return values


def seconds(value: str) -> float:
    total = 0.0
    for number, suffix in re.findall(r"(\d+(?:\.\d+)?)\s*(min|s|ms)?", value):
        total += float(number) * {"min": 60, "s": 1, "ms": 0.001, "": 1}[suffix]
    return total


AGENT_CAPABILITIES = {
    f"CAP_{c}" for c in ("SETUID", "SETGID", "CHOWN", "KILL", "DAC_OVERRIDE", "SYS_PTRACE")
}


@pytest.mark.parametrize("name", ["controller", "agent"])
def test_units_restart_with_back_off_hardened_and_read_their_environment(name):
    parsed = unit(SYSTEMD / f"keel-{name}.service")
    service = parsed["Service"]
    for key, value in {
        "Restart": "on-failure",
        "KillSignal": "SIGTERM",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes",
        "AmbientCapabilities": "",
    }.items():
        assert service.get(key) == value, f"keel-{name}.service: {key}={service.get(key)!r}"
    if name == "controller":
        assert (service.get("User"), service.get("CapabilityBoundingSet")) == ("keel", "")
    else:
        # Root bounded to what starting ranks as another user takes (agent.rank_user).
        assert (
            service.get("User") == "root" and "--rank-user ${RANK_USER}" in (service["ExecStart"])
        )
        assert set(service["CapabilityBoundingSet"].split()) == AGENT_CAPABILITIES
    assert seconds(service["RestartSec"]) >= 1
    assert (
        int(parsed["Unit"]["StartLimitBurst"]) > 1
        and seconds(parsed["Unit"]["StartLimitIntervalSec"]) > 0
    )
    assert parsed["Install"]["WantedBy"] == "multi-user.target"
    # The environment file is the recipe beside the unit, and feeds every ${VAR}.
    environment = env_file(SYSTEMD / Path(service["EnvironmentFile"].lstrip("-")).name)
    used = set(re.findall(r"\$\{(\w+)\}", service["ExecStart"]))
    assert used <= environment.keys(), f"not in the env file: {used - environment.keys()}"
    keel_reads = {key for key in environment if key.startswith("KEEL_")}
    assert env.ETCD_ENDPOINTS in keel_reads and keel_reads <= DAEMON_ENV, keel_reads
    assert set(environment) - keel_reads <= used, "env file variables nothing reads"
    assert service["ExecStart"].split()[0].startswith("/"), "systemd wants an absolute path"


def test_the_controller_unit_has_no_devices():
    assert unit(SYSTEMD / "keel-controller.service")["Service"].get("PrivateDevices") == "yes"


def test_the_agent_unit_drains_before_systemd_kills_and_lets_ranks_use_gpus():
    service = unit(SYSTEMD / "keel-agent.service")["Service"]
    environment = env_file(SYSTEMD / "agent.env")
    drain_s = float(environment["DRAIN_TIMEOUT_S"])
    assert "--drain-timeout-s ${DRAIN_TIMEOUT_S}" in service["ExecStart"]
    assert seconds(service["TimeoutStopSec"]) > max(drain_s, DEFAULT_DRAIN_TIMEOUT_S)
    # SIGTERM to the agent only: it stops its ranks itself, after their checkpoint.
    assert service["KillMode"] == "mixed"
    assert service.get("PrivateDevices", "no") == "no" and "DevicePolicy" not in service
    assert service.get("MemoryDenyWriteExecute", "no") == "no"  # CUDA, Triton JIT
    assert service.get("ReadWritePaths") or service.get("StateDirectory")
    assert environment["RUN_DIR"].startswith(f"/var/lib/{service['StateDirectory']}/")


# ------------------------------------------------------------------------- docker
def dockerfile_instructions() -> list[tuple[str, str]]:
    lines = [
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    ]
    return [
        (instruction.upper(), rest.strip())
        for line in logical_lines("\n".join(lines))
        if line.strip()
        for instruction, _, rest in [line.strip().partition(" ")]
    ]


def test_dockerfile_takes_base_and_torch_as_build_args_and_pins_torch_before_keel():
    steps = dockerfile_instructions()
    start = [kind for kind, _ in steps].index("FROM")
    assert ("ARG", next(rest for kind, rest in steps if kind == "ARG")) == steps[0]
    assert steps[0][1].startswith("BASE=") and steps[start][1] == "${BASE}"
    declared = {rest.split("=")[0] for kind, rest in steps[start:] if kind == "ARG"}
    assert {"TORCH_VERSION", "TORCH_INDEX_URL"} <= declared  # after FROM, so in scope
    torch = next(
        i
        for i, (kind, rest) in enumerate(steps)
        if kind == "RUN" and '"torch==${TORCH_VERSION}"' in rest
    )
    assert '--index-url "${TORCH_INDEX_URL}"' in steps[torch][1]
    keel = next(
        i
        for i, (kind, rest) in enumerate(steps)
        if kind == "RUN" and re.search(r"pip install /src\b", rest)
    )
    assert torch < keel, "torch must be installed, pinned, before Keel"
    assert steps[-1] == ("ENTRYPOINT", '["keel"]') or (
        steps[-2] == ("ENTRYPOINT", '["keel"]') and steps[-1][0] == "CMD"
    )
    users = [i for i, (kind, _) in enumerate(steps) if kind == "USER"]
    assert users and users[-1] > keel and steps[users[-1]][1] not in ("root", "0")


def test_dockerfile_copies_every_package_pip_installs():
    pyproject = (REPO / "pyproject.toml").read_text()
    include = re.search(r"include = \[(.*?)\]", pyproject)[1]
    packages = {name.strip(' "*') for name in include.split(",")}
    copied = set()
    for kind, rest in dockerfile_instructions():
        if kind == "COPY":
            sources = rest.split()[:-1]
            copied.update(sources)
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    assert packages | {"pyproject.toml", "README.md"} <= copied, packages - copied
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


# --------------------------------------------------------------------- kubernetes
def objects_by_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in kubernetes_objects() if doc["kind"] == kind}


def container(workload: dict, name: str) -> dict:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def keel_invocation(workload: str) -> Invocation:
    return next(i for i in kubernetes_invocations() if f": {workload}/" in i.where)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    manifests = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(manifests)
    assert kustomization["namespace"] == "keel"
    assert [image["name"] for image in kustomization["images"]] == ["keel"]


def test_standard_objects_match_the_kubernetes_api_schema():
    version = kubernetes_validate.latest_version()
    checked = 0
    for path, doc in kubernetes_objects():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{path.name}: {doc['kind']} {doc['metadata']['name']} "
                f"(Kubernetes {version}): {exc.message} at {list(exc.path)}"
            )
        checked += 1
    assert checked >= 15


def test_servicemonitors_select_a_service_port_of_the_controllers_and_the_agents():
    services = objects_by_kind("Service")
    monitors = objects_by_kind("ServiceMonitor")
    scraped = set()
    for name, monitor in monitors.items():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        selector = monitor["spec"]["selector"]["matchLabels"]
        matches = [
            s
            for s in services.values()
            if selector.items() <= s["metadata"].get("labels", {}).items()
        ]
        assert len(matches) == 1, f"ServiceMonitor {name} selects {len(matches)} Services"
        ports = {port["name"] for port in matches[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
            # The daemons run with --tls-dir: /metrics is HTTPS with client certificates.
            assert endpoint["scheme"] == "https" and "cert" in endpoint["tlsConfig"]
        scraped.add(matches[0]["spec"]["selector"]["app.kubernetes.io/name"])
    assert scraped == {"keel-controller", "keel-agent"}


def test_the_agent_daemonset_runs_on_the_host_network_with_gpus_and_drains_in_its_grace():
    agent = objects_by_kind("DaemonSet")["keel-agent"]
    pod = agent["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    invocation = keel_invocation("keel-agent")
    gpus = container(agent, "agent")["resources"]["limits"]["nvidia.com/gpu"]
    assert int(option_value(invocation, "--slots")) == int(gpus) > 0
    assert option_value(invocation, "--node") == "$(NODE_NAME)"
    assert option_value(invocation, "--host") == "$(HOST_IP)"
    drain_s = float(option_value(invocation, "--drain-timeout-s"))
    assert pod["terminationGracePeriodSeconds"] > max(drain_s, DEFAULT_DRAIN_TIMEOUT_S)
    # SIGTERM drains; a preStop hook, if any, may only wait.
    pre_stop = container(agent, "agent").get("lifecycle", {}).get("preStop")
    assert pre_stop is None or pre_stop.get("exec", {}).get("command", [""])[0] == "sleep"
    run_dir = option_value(invocation, "--run-dir")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(
        m
        for m in container(agent, "agent")["volumeMounts"]
        if run_dir.startswith(m["mountPath"] + "/")
    )
    assert "hostPath" in volumes[mount["name"]]


def test_the_agent_runs_ranks_as_their_own_user_who_cannot_read_its_secrets():
    agent = objects_by_kind("DaemonSet")["keel-agent"]
    invocation = keel_invocation("keel-agent")
    assert option_value(invocation, "--rank-user") == "keel-rank"
    context = container(agent, "agent")["securityContext"]
    assert context["runAsUser"] == 0 and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert {f"CAP_{c}" for c in context["capabilities"]["add"]} == AGENT_CAPABILITIES
    pod = agent["spec"]["template"]["spec"]
    assert "fsGroup" not in pod.get("securityContext", {}), "it would give ranks the secret"
    tls = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert tls["secret"]["defaultMode"] == 0o400
    # The image has the user.
    assert "useradd --uid 10002" in DOCKERFILE.read_text() and "keel-rank" in (
        DOCKERFILE.read_text()
    )


def test_the_controllers_are_two_with_stable_names_their_certificate_can_hold():
    controller = objects_by_kind("StatefulSet")["keel-controller"]
    assert controller["spec"]["replicas"] == 2
    service = objects_by_kind("Service")[controller["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    invocation = keel_invocation("keel-controller")
    assert option_value(invocation, "--listen") == "0.0.0.0:7070"
    assert option_value(invocation, "--metrics-listen").endswith(":9400")
    advertise = option_value(invocation, "--advertise-host")
    env_values = {e["name"]: e.get("value") for e in container(controller, "controller")["env"]}
    assert advertise == "$(ADVERTISE_HOST)"
    assert (
        env_values["ADVERTISE_HOST"]
        == f"$(POD_NAME).{service['metadata']['name']}.$(POD_NAMESPACE).svc"
    )
    # secrets.yaml's `keel certs init` names exactly those hosts.
    init = next(
        i
        for i in all_invocations()
        if i.where == "deploy/kubernetes/secrets.yaml" and i.words[:2] == ("certs", "init")
    )
    hosts = [w for prev, w in zip(init.words, init.words[1:]) if prev == "--host"]
    assert hosts[:2] == [f"keel-controller-{i}.keel-controller.keel.svc" for i in range(2)]
    # ... and each etcd member as KEEL_ETCD_ENDPOINTS names it: etcd serves with that
    # certificate (test_etcd_serves_tls_to_certificate_holders_only).
    endpoints = objects_by_kind("ConfigMap")["keel-config"]["data"][env.ETCD_ENDPOINTS]
    assert hosts[2:] == [e.rpartition(":")[0] for e in endpoints.split(",")]


def test_etcd_serves_tls_to_certificate_holders_only_and_each_daemon_presents_its_own():
    etcd = objects_by_kind("StatefulSet")["keel-etcd"]
    command = container(etcd, "etcd")["command"]
    flags = dict(w.partition("=")[::2] for w in command if w.startswith("--"))
    assert flags["--listen-client-urls"].startswith("https://")
    assert flags["--advertise-client-urls"].startswith("https://")
    assert "--client-cert-auth" in flags
    mount = next(m for m in container(etcd, "etcd")["volumeMounts"] if m["name"] == "tls")
    secret = next(v for v in etcd["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    held = set(objects_by_kind("Secret")[secret["secret"]["secretName"]]["stringData"])
    for flag in ("--cert-file", "--key-file", "--trusted-ca-file"):
        directory, _, name = flags[flag].rpartition("/")
        assert directory == mount["mountPath"] and name in held, flag
    # The kubelet's probe, which holds no client certificate, reads the plain port.
    probe = container(etcd, "etcd")["readinessProbe"]["httpGet"]
    port = next(p for p in container(etcd, "etcd")["ports"] if p["name"] == probe["port"])
    assert flags["--listen-metrics-urls"] == f"http://0.0.0.0:{port['containerPort']}"
    for workload, party in (("keel-controller", "controller"), ("keel-agent", "agent")):
        invocation = keel_invocation(workload)
        tls_dir = option_value(invocation, "--tls-dir")
        assert option_value(invocation, "--etcd-ca") == f"{tls_dir}/ca.pem"
        assert option_value(invocation, "--etcd-cert") == f"{tls_dir}/{party}.pem"
        assert option_value(invocation, "--etcd-key") == f"{tls_dir}/{party}.key"
    # etcd's root certificate is in no Secret: it stays with the operator.
    for secret in objects_by_kind("Secret").values():
        assert not {"root.pem", "root.key"} & set(secret["stringData"])


def test_every_kubernetes_variable_reference_is_defined():
    """The kubelet leaves an undefined $(VAR) as it is, silently."""
    config_maps = objects_by_kind("ConfigMap")
    for _, doc in kubernetes_objects():
        template = doc.get("spec", {}).get("template")
        for c in containers(template["spec"]) if template else []:
            defined = {
                key
                for source in c.get("envFrom", [])
                for key in config_maps[source["configMapRef"]["name"]]["data"]
            }
            for variable in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", variable.get("value", "")):
                    assert ref in defined, (
                        f"{c['name']}: env {variable['name']} uses $({ref}) before it is set"
                    )
                defined.add(variable["name"])
            for word in [*c.get("command", []), *c.get("args", [])]:
                for ref in re.findall(r"\$\((\w+)\)", str(word)):
                    assert ref in defined, (
                        f"{doc['metadata']['name']}/{c['name']}: $({ref}) undefined"
                    )


def test_tls_directories_are_secrets_holding_what_each_daemon_reads():
    secrets = objects_by_kind("Secret")
    for workload, name, files in (
        (objects_by_kind("StatefulSet")["keel-controller"], "controller", CONTROLLER_FILES),
        (objects_by_kind("DaemonSet")["keel-agent"], "agent", AGENT_FILES),
    ):
        tls_dir = option_value(keel_invocation(workload["metadata"]["name"]), "--tls-dir")
        mount = next(
            m for m in container(workload, name)["volumeMounts"] if m["mountPath"] == tls_dir
        )
        volume = next(
            v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
        )
        assert set(secrets[volume["secret"]["secretName"]]["stringData"]) == files


def test_etcd_is_three_members_behind_a_headless_service_named_in_the_endpoints():
    etcd = objects_by_kind("StatefulSet")["keel-etcd"]
    assert etcd["spec"]["replicas"] == 3
    assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.5\.\d+", container(etcd, "etcd")["image"])
    service = objects_by_kind("Service")[etcd["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    endpoints = objects_by_kind("ConfigMap")["keel-config"]["data"][env.ETCD_ENDPOINTS]
    assert endpoints.split(",") == [f"keel-etcd-{i}.keel-etcd:2379" for i in range(3)]
    initial = next(
        w for w in container(etcd, "etcd")["command"] if w.startswith("--initial-cluster=")
    )
    assert initial.count("=http://") == 3


def test_the_daemons_hold_no_kubernetes_api_rights():
    assert not objects_by_kind("ClusterRole") and not objects_by_kind("ClusterRoleBinding")
    for role in objects_by_kind("Role").values():
        for rule in role["rules"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}
            assert "secrets" not in rule["resources"]
    for binding in objects_by_kind("RoleBinding").values():
        assert all(not s["name"].startswith("keel-") for s in binding["subjects"])
    accounts = objects_by_kind("ServiceAccount")
    for kind in ("StatefulSet", "DaemonSet"):
        for workload in objects_by_kind(kind).values():
            pod = workload["spec"]["template"]["spec"]
            assert pod["serviceAccountName"] in accounts
            assert pod["automountServiceAccountToken"] is False


def test_network_policies_cover_the_controller_and_etcd_ports():
    ports = {}
    for policy in objects_by_kind("NetworkPolicy").values():
        app = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        ports[app] = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {"keel-controller": {7070, 7071, 9400}, "keel-etcd": {2379, 2380}}


# -------------------------------------------------------------------------- slurm
def test_sbatch_starts_one_agent_per_node_and_drains_them_on_exit():
    text = SBATCH.read_text()
    found = shell_invocations(text, "keel.sbatch")
    agent = invocations_of(("keel", "agent"), found)
    assert len(agent) == 1
    assert option_value(agent[0], "--node") == "$SLURMD_NODENAME"
    assert option_value(agent[0], "--slots") == "$SLURM_GPUS_ON_NODE"
    assert re.search(
        r"^srun --ntasks-per-node=1 .*start_agent &$", "\n".join(logical_lines(text)), re.MULTILINE
    )
    assert invocations_of(("keel", "submit"), found) and invocations_of(("keel", "events"), found)
    # The trap is set before anything is submitted, and stops the agents with SIGTERM.
    assert text.index("trap stop_agents EXIT") < text.index('keel submit "$JOB_SPEC"')
    assert 'kill -TERM "$AGENTS"' in text
    # Slurm's warning leaves the agents time to drain.
    warn_s = int(re.search(r"^#SBATCH --signal=B:TERM@(\d+)$", text, re.MULTILINE)[1])
    assert warn_s > int(re.search(r"DRAIN_TIMEOUT_S:-(\d+)", text)[1]) >= DEFAULT_DRAIN_TIMEOUT_S


def test_every_recipe_that_runs_etcd_bounds_its_database_as_keel_up_does():
    """Compaction and a quota, with keel up's values (``STORAGE_FLAGS``): without them
    etcd keeps every revision until NOSPACE at its 2 GiB default refuses every write."""
    found = []
    for doc in yaml_documents(KUBERNETES / "etcd.yaml"):
        for container in (
            doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        ):
            if container["command"][0].endswith("/etcd"):
                found.append(container["command"])
    assert found, "deploy/kubernetes/etcd.yaml runs no etcd container"
    for command in found:
        assert set(STORAGE_FLAGS) <= set(command), f"missing: {set(STORAGE_FLAGS) - set(command)}"


def test_each_agent_bootstraps_its_own_certificate_from_the_controllers_port():
    controller = keel_invocation("keel-controller")
    agent = keel_invocation("keel-agent")
    port = option_value(controller, "--bootstrap-port")
    assert "--allow-shared-agent-certificate" not in controller.words
    addresses = option_value(agent, "--bootstrap-address").split(",")
    assert addresses and all(a.endswith(f":{port}") for a in addresses)
    assert option_value(agent, "--cert-dir").startswith("/var/lib/keel/")  # the host's
