"""Command-line pieces shared by several subcommands.

Secrets (tokens, keys) are read, in this order, from the flag, from `--X-file FILE`, or
from the environment variable, the same way for every command, so Kubernetes Secrets
work as files or as variables.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from registry.client import REGISTRY_ENV
from registry.security import ClientCurve, KeyFileError, ServerCurve, is_loopback

__all__ = [
    "ADMIN_TOKEN", "ALLOWED_CLIENTS_ENV", "API_KEY", "CA_FILE_ENV", "CURVE_KEY_ENV",
    "CURVE_SECRET_KEY_ENV",
    "REGISTRY_PUBLIC_KEY_ENV", "TOKEN", "Secret", "add_client_curve_arguments",
    "add_label_argument", "add_registry_argument", "add_registry_http_arguments",
    "add_secret_argument",
    "add_server_curve_arguments", "client_curve_of", "insecure_refusal", "is_loopback",
    "labels_of", "registry_http_of", "secret_of", "secrets_of", "server_curve_of",
]

REGISTRY_PUBLIC_KEY_ENV: Final = "PDREG_REGISTRY_PUBLIC_KEY"
CURVE_KEY_ENV: Final = "PDREG_CURVE_KEY"
CURVE_SECRET_KEY_ENV: Final = "PDREG_CURVE_SECRET_KEY"
ALLOWED_CLIENTS_ENV: Final = "PDREG_ALLOWED_CLIENTS"


def add_registry_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--registry", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                        help=f"registry control address(es) (default ${REGISTRY_ENV} "
                             f"or 127.0.0.1:7600)")


def add_label_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--label", dest="labels", action="append", type=_label, default=[],
                        metavar="KEY=VALUE",
                        help="member label, repeatable (e.g. zone=a, rack=r12)")


def labels_of(args: argparse.Namespace) -> dict[str, str]:
    return dict(args.labels)


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--label {text!r}: expected KEY=VALUE")
    return key, value


# --- secrets -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Secret:
    """One credential: `--{flag}`, `--{flag}-file`, `${env}`."""

    flag: str
    env: str
    what: str

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")


TOKEN: Final = Secret("token", "PDREG_TOKEN", "fleet token: registrations must carry it")
ADMIN_TOKEN: Final = Secret("admin-token", "PDREG_ADMIN_TOKEN",
                            "admin token: drain and evict must carry it")
API_KEY: Final = Secret("api-key", "PDREG_API_KEY",
                        "router API key: clients send Authorization: Bearer KEY")


def add_secret_argument(parser: argparse.ArgumentParser, secret: Secret,
                        what: str | None = None) -> None:
    parser.add_argument(f"--{secret.flag}", dest=secret.dest, default=None, metavar="TEXT",
                        help=f"{what or secret.what}. On the command line it shows in `ps` "
                             f"to every user of the machine: prefer --{secret.flag}-file "
                             f"or ${secret.env}")
    parser.add_argument(f"--{secret.flag}-file", dest=f"{secret.dest}_file", default=None,
                        metavar="FILE", help=f"read --{secret.flag} from FILE (a mounted "
                                             f"Secret); trailing newlines are ignored")


def secret_of(args: argparse.Namespace, secret: Secret) -> str:
    """What a client sends: the first line of `secrets_of` (a file may hold the new
    token first and the old one after it, while registries accept both)."""
    lines = [line.strip() for line in secrets_of(args, secret).splitlines() if line.strip()]
    return lines[0] if lines else ""


def secrets_of(args: argparse.Namespace, secret: Secret) -> str:
    """Every token a registry accepts, one per line: the flag, else the file's content,
    else the environment variable, else "". Several lines are several tokens (rotation:
    the old and the new accepted together)."""
    value = getattr(args, secret.dest, None)
    if value:
        return str(value)
    path = getattr(args, f"{secret.dest}_file", None)
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise SystemExit(f"--{secret.flag}-file {path}: {exc.strerror or exc}") from None
        if not text:
            raise SystemExit(f"--{secret.flag}-file {path} is empty")
        return text
    return os.environ.get(secret.env, "")


# --- CURVE keys ----------------------------------------------------------------------


def add_client_curve_arguments(parser: argparse.ArgumentParser) -> None:
    """`--registry-public-key FILE` and `--curve-key FILE`: a CURVE client of the registry."""
    parser.add_argument("--registry-public-key", default=None, metavar="FILE",
                        help=f"the registry's CURVE public key file (NAME.key); with "
                             f"--curve-key, talk to a CURVE registry "
                             f"(or ${REGISTRY_PUBLIC_KEY_ENV})")
    parser.add_argument("--curve-key", default=None, metavar="FILE",
                        help=f"this client's own CURVE key pair (NAME.key_secret) "
                             f"(or ${CURVE_KEY_ENV})")


def client_curve_of(args: argparse.Namespace) -> ClientCurve | None:
    """The client's CURVE keys from flags or environment; None when neither names any."""
    server_key = args.registry_public_key or os.environ.get(REGISTRY_PUBLIC_KEY_ENV, "")
    own_key = args.curve_key or os.environ.get(CURVE_KEY_ENV, "")
    if not server_key and not own_key:
        return None
    if not server_key or not own_key:
        missing = ("--registry-public-key", REGISTRY_PUBLIC_KEY_ENV) if not server_key \
            else ("--curve-key", CURVE_KEY_ENV)
        raise SystemExit(f"CURVE needs both keys: give {missing[0]} (or ${missing[1]})")
    try:
        return ClientCurve.from_files(server_key, own_key)
    except KeyFileError as exc:
        raise SystemExit(str(exc)) from None


def add_server_curve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--curve-secret-key", default=None, metavar="FILE",
                        help=f"encrypt and authenticate the ZeroMQ sockets with CURVE, "
                             f"using this key pair (NAME.key_secret) "
                             f"(or ${CURVE_SECRET_KEY_ENV})")
    parser.add_argument("--allowed-clients", default=None, metavar="DIR",
                        help=f"with CURVE, only client public keys (*.key) found in DIR may "
                             f"connect; default: any key (or ${ALLOWED_CLIENTS_ENV})")


def server_curve_of(args: argparse.Namespace) -> ServerCurve | None:
    secret_key = args.curve_secret_key or os.environ.get(CURVE_SECRET_KEY_ENV, "")
    allowed = args.allowed_clients or os.environ.get(ALLOWED_CLIENTS_ENV, "")
    if not secret_key:
        if allowed:
            raise SystemExit("--allowed-clients needs --curve-secret-key "
                             f"(or ${CURVE_SECRET_KEY_ENV})")
        return None
    try:
        return ServerCurve.from_files(secret_key, allowed or None)
    except KeyFileError as exc:
        raise SystemExit(str(exc)) from None


# --- the registry's HTTP side ---------------------------------------------------------

CA_FILE_ENV: Final = "PDREG_CA_FILE"


def add_registry_http_arguments(parser: argparse.ArgumentParser) -> None:
    """`--https` / `--ca-file`: reach a registry that serves HTTPS (--tls-cert)."""
    parser.add_argument("--https", action="store_true",
                        help="the registry's HTTP side serves HTTPS (its --tls-cert), "
                             "checked against the system's CAs")
    parser.add_argument("--ca-file", default=None, metavar="FILE",
                        help=f"HTTPS, checked against this CA bundle (PEM), e.g. a "
                             f"self-signed --tls-cert (or ${CA_FILE_ENV})")


def registry_http_of(args: argparse.Namespace) -> tuple[str, str | bool]:
    """(scheme, httpx `verify`) for the registry's HTTP side."""
    ca_file = getattr(args, "ca_file", None) or os.environ.get(CA_FILE_ENV, "")
    if ca_file:
        return "https", ca_file
    return ("https", True) if getattr(args, "https", False) else ("http", True)


# --- exposure --------------------------------------------------------------------------


def insecure_refusal(command: str, host: str, *, secured: bool, insecure: bool,
                     what: str = "with neither CURVE nor a token") -> str | None:
    """The one-line reason `command` ("registry", "registry-admin", "registry-curve" or
    "router") must not start, or None.

    Bound beyond loopback with no credential at all, anyone who reaches the port could
    change membership or use the fleet; `--insecure` is the explicit way to want that.
    """
    if secured or insecure or is_loopback(host):
        return None
    risk, fix = _EXPOSURE[command]
    name = command.partition("-")[0]
    return (f"pdreg {name}: refusing to listen on {host} {what}: {risk}; add {fix}, or "
            f"--insecure to run it anyway")


_EXPOSURE = {
    "registry": ("anyone who can reach it could register an engine and receive prompts",
                 "--token and/or --curve-secret-key"),
    # CURVE with any client key: the registry's public key is handed to every client, so
    # a key pair made up on the spot would register an engine.
    "registry-curve": ("anyone with a key pair of their own could register an engine",
                       "--allowed-clients DIR and/or --token"),
    "registry-admin": ("anyone who can reach its HTTP port could drain, evict and ban "
                       "members", "--admin-token (or --admin-token-file), or --http-port -1"),
    "router": ("anyone who can reach it could send it prompts",
               "--api-key (and --token or --registry-public-key/--curve-key)"),
}
