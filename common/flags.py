"""The command-line flags every daemon and the CLI share: how to reach etcd securely
and which TLS files to present, whose values become settings through ``common.tls``,
and how to log (``common.logs``)."""

from __future__ import annotations

import click

from common import env, logs

FILE = click.Path(exists=True, dir_okay=False)


def _apply(command, options):
    for option in reversed(options):
        command = option(command)
    return command


def etcd_options(command):
    """``--etcd-ca``, ``--etcd-cert``, ``--etcd-key``, ``--etcd-user``,
    ``--etcd-password``."""
    return _apply(
        command,
        [
            click.option(
                "--etcd-ca",
                type=FILE,
                default=None,
                help="CA certificate of etcd's server certificate: talk to etcd over TLS.",
            ),
            click.option(
                "--etcd-cert",
                type=FILE,
                default=None,
                help="Client certificate for etcd (with --etcd-key and --etcd-ca).",
            ),
            click.option("--etcd-key", type=FILE, default=None, help="Private key of --etcd-cert."),
            click.option(
                "--etcd-user", default=None, help="etcd user, when etcd has authentication enabled."
            ),
            click.option(
                "--etcd-password",
                envvar=env.ETCD_PASSWORD,
                default=None,
                help=f"Password of --etcd-user (env {env.ETCD_PASSWORD}; prefer it: "
                f"flags show in ps).",
            ),
        ],
    )


def tls_options(party: str, uses: str, ca_help: str = "CA certificate that signs every party"):
    """``--tls-dir``, ``--ca``, ``--cert``, ``--key`` for ``party``'s certificate;
    ``uses`` says which files of the TLS directory it takes."""

    def decorate(command):
        return _apply(
            command,
            [
                click.option(
                    "--tls-dir",
                    type=click.Path(exists=True, file_okay=False),
                    default=None,
                    help=f"Directory from `keel certs init`: use its {uses}; turns on mutual TLS.",
                ),
                click.option(
                    "--ca", type=FILE, default=None, help=f"{ca_help} (overrides --tls-dir)."
                ),
                click.option(
                    "--cert",
                    type=FILE,
                    default=None,
                    help=f"The {party} certificate (overrides --tls-dir).",
                ),
                click.option(
                    "--key",
                    type=FILE,
                    default=None,
                    help=f"The {party} private key (overrides --tls-dir).",
                ),
            ],
        )

    return decorate


def log_options(command):
    """``--log-format`` and ``--log-level`` (``common.logs``), both None when not given."""
    return _apply(
        command,
        [
            click.option(
                "--log-format",
                type=click.Choice(logs.FORMATS),
                default=None,
                help=f"Log lines as JSON objects or as text for a person (default: "
                f"console on a terminal, else json; env {env.LOG_FORMAT}).",
            ),
            click.option(
                "--log-level",
                type=click.Choice(logs.LEVELS),
                default=None,
                help=f"Drop log lines below this level (default: info; env {env.LOG_LEVEL}).",
            ),
        ],
    )


def metrics_options(bound_to: str, exported: str = ""):
    """``--metrics-listen`` and ``--metrics-address-file`` (``common.metrics``): a bare
    ``:PORT`` binds ``bound_to``, the address the daemon advertises."""

    def apply(command):
        return _apply(
            command,
            [
                click.option(
                    "--metrics-listen",
                    metavar="[HOST]:PORT",
                    help=f"Serve Prometheus metrics (/metrics{exported}) here; a bare "
                    f":PORT binds {bound_to}; port 0 picks a free one. HTTPS with "
                    f"this daemon's certificate under mutual TLS. Not served "
                    f"without it.",
                ),
                click.option(
                    "--metrics-address-file",
                    type=click.Path(dir_okay=False),
                    help="Write the metrics host:port here once serving.",
                ),
            ],
        )

    return apply


def hang_options(command):
    """``--hang-floor-s`` and ``--first-step-timeout-s``: how long a rank that reports
    steps may go without one (``keel up``, ``keel run``)."""
    return _apply(
        command,
        [
            click.option(
                "--hang-floor-s",
                type=float,
                default=30.0,
                show_default=True,
                help="Floor of the hang timeout; a rank is hung after max(this, 10 x "
                "its median step time) without progress. The trainer's "
                "collective timeout is raised to fit it (at least 1.2 x (floor + "
                "the 5 s stop grace)).",
            ),
            click.option(
                "--first-step-timeout-s",
                type=float,
                default=0.0,
                help="A rank that reports steps (the reference trainer, any script "
                "using trainer.runtime) and has not reported its first step this "
                "long after starting is hung (default: 120 s, or --hang-floor-s "
                "if longer). A script that never reports is judged by its exits "
                "only.",
            ),
        ],
    )
