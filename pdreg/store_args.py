"""`pdreg registry`'s store flags: where admin intents live, and how to reach etcd."""

from __future__ import annotations

import argparse
import os
from typing import Final

from pdreg.args import Secret, add_secret_argument, secret_of
from registry.store.url import EtcdOptions

__all__ = ["STORE_ENV", "STORE_PASSWORD", "add_store_arguments", "store_options_of"]

STORE_ENV: Final = "PDREG_STORE"
STORE_PASSWORD: Final = Secret("store-password", "PDREG_STORE_PASSWORD",
                               "the password of --store-user for etcd")


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store", default=os.environ.get(STORE_ENV, "memory"),
        metavar="memory|file:PATH|etcd://HOST:PORT[,...][/PREFIX]",
        help=f"where admin intents (drain, evict/ban, cordon) live: memory (default; a "
             f"restart forgets them), file:PATH (one registry that restarts and keeps "
             f"them), or etcd shared by every registry, which also learn each other there "
             f"(or ${STORE_ENV})")
    parser.add_argument("--store-ca", default=None, metavar="FILE",
                        help="etcd over TLS, its certificate checked against this CA (PEM)")
    parser.add_argument("--store-cert", default=None, metavar="FILE",
                        help="etcd over TLS with this client certificate (PEM; with "
                             "--store-key)")
    parser.add_argument("--store-key", default=None, metavar="FILE",
                        help="the private key of --store-cert (PEM)")
    parser.add_argument("--store-user", default=None, metavar="NAME",
                        help="etcd user (etcd's own authentication; with --store-password-file)")
    add_secret_argument(parser, STORE_PASSWORD)
    parser.add_argument("--registry-id", default=None, metavar="ID",
                        help="this registry's name in the replica set (default: its "
                             "advertised control address)")
    parser.add_argument("--advertise-host", default=None, metavar="HOST",
                        help="the host clients reach this registry by, as the replica set "
                             "shows it (default: --host; the host name when --host is "
                             "0.0.0.0)")


def store_options_of(args: argparse.Namespace) -> EtcdOptions:
    if bool(args.store_cert) != bool(args.store_key):
        raise SystemExit("pdreg registry: --store-cert and --store-key go together")
    password = secret_of(args, STORE_PASSWORD)
    if bool(args.store_user) != bool(password):
        raise SystemExit("pdreg registry: --store-user and --store-password(-file) go "
                         "together")
    return EtcdOptions(ca_file=args.store_ca or "", cert_file=args.store_cert or "",
                       key_file=args.store_key or "", user=args.store_user or "",
                       password=password)
