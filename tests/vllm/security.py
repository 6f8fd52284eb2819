"""Credentials for `make test-vllm` with security on, as an operator would set them up.

`pdreg keys generate` writes the registry's CURVE key pair and one pair per client
(each engine's sidecar, the router, `pdreg status`); the registry allows exactly those
client public keys (Ironhouse). Outsiders get well-formed pairs of their own that the
registry does not allow. Tokens live in files, mode 0600, passed with the
`--X-file` flags (a mounted Kubernetes Secret looks the same). Names: docs/operations.md,
"Credentials".
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cluster import PDREG, REPO

REGISTRY_KEY = "registry"


@dataclass(frozen=True)
class Security:
    root: Path
    api_key: str

    @property
    def server_dir(self) -> Path:
        return self.root / "server"

    @property
    def clients_dir(self) -> Path:
        return self.root / "clients"

    @property
    def outsiders_dir(self) -> Path:
        return self.root / "outsiders"

    def _file(self, name: str) -> str:
        return str(self.root / name)

    def registry_args(self) -> list[str]:
        return ["--token-file", self._file("token"),
                "--admin-token-file", self._file("admin-token"),
                "--curve-secret-key", str(self.server_dir / f"{REGISTRY_KEY}.key_secret"),
                "--allowed-clients", str(self.clients_dir)]

    def client_args(self, name: str, *, outsider: bool = False) -> list[str]:
        """A registry client's CURVE flags: the registry's public key, its own pair."""
        own = self.outsiders_dir if outsider else self.clients_dir
        return ["--registry-public-key", str(self.server_dir / f"{REGISTRY_KEY}.key"),
                "--curve-key", str(own / f"{name}.key_secret")]

    def member_args(self, name: str) -> list[str]:
        """A member that registers (sidecar, router): the fleet token and CURVE keys."""
        return ["--token-file", self._file("token"), *self.client_args(name)]

    def router_args(self, name: str) -> list[str]:
        return [*self.member_args(name), "--api-key-file", self._file("api-key")]


def create(root: Path, clients: list[str], outsiders: list[str]) -> Security:
    """Key pairs and token files under `root` (fresh per run)."""
    for directory, names in ((root / "server", [REGISTRY_KEY]), (root / "clients", clients),
                             (root / "outsiders", outsiders)):
        argv = [*PDREG, "keys", "generate", str(directory)]
        for name in names:
            argv += ["--name", name]
        subprocess.run(argv, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    api_key = secrets.token_urlsafe(24)
    for name, value in (("token", secrets.token_urlsafe(24)),
                        ("admin-token", secrets.token_urlsafe(24)), ("api-key", api_key)):
        path = root / name
        path.touch(mode=0o600)
        path.write_text(value + "\n")
    return Security(root, api_key)
