"""A real etcd on loopback for tests and benchmarks: its own data dir and ports (below
32768), killed with the test, restartable on the same data (kill -9 and back).

Debian's `etcd-server` (etcd 3.4) provides the binary; `.ci/run` installs it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until

ETCD_START_TIMEOUT_S = 20.0
# Skipped where etcd is not installed, except in CI, which installs it and must run these.
requires_etcd = pytest.mark.skipif(
    (shutil.which("etcd") is None or shutil.which("etcdctl") is None)
    and not os.environ.get("CI"), reason="etcd not installed (apt-get install etcd-server "
                                         "etcd-client)")


class EtcdProcess:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.client_port = free_low_port()
        self.peer_port = free_low_port(avoid={self.client_port})
        self.proc: subprocess.Popen[bytes] | None = None
        self.scheme = "http"  # "https" with the TLS flags given to start()
        self.ca_file = ""  # checks an https etcd's certificate (health probes)
        self.log = data_dir.parent / f"{data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    def start(self, *extra: str) -> EtcdProcess:
        peer = f"http://127.0.0.1:{self.peer_port}"  # one member: peers never talk
        command = [
            _binary(), "--name", "e0", "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"e0={peer}", *extra]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=die_with_parent)
        if not wait_until(self.healthy, ETCD_START_TIMEOUT_S, poll_s=0.1):
            self.stop()
            raise RuntimeError(f"etcd did not start; its log: {self.log.read_text()[-2000:]}")
        return self

    def healthy(self) -> bool:
        if self.scheme == "https":  # no client certificate here: a TLS handshake will do
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=1.0):
                    return True
            except OSError:
                return False
        try:
            return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """kill -9: no goodbye to anyone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 5.0)

    def call(self, path: str, body: dict[str, object]) -> dict[str, object]:
        """One raw v3 gateway call (for tests that write what a registry never would)."""
        response = httpx.post(f"{self.url}{path}", json=body, timeout=5.0)
        response.raise_for_status()
        return response.json()


def _binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        raise RuntimeError("etcd is not installed: apt-get install etcd-server (.ci/run "
                           "installs it)")
    return found


@contextlib.contextmanager
def running_etcd(data_dir: Path) -> Iterator[EtcdProcess]:
    etcd = EtcdProcess(data_dir).start()
    try:
        yield etcd
    finally:
        etcd.stop()


def make_certificates(tmp_path: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed."""
    files = {name: tmp_path / f"{name}.pem" for name in (
        "ca", "ca_key", "server", "server_key", "client", "client_key")}

    def run(*argv: str) -> None:
        subprocess.run(["openssl", *argv], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", str(files["ca_key"]), "-out", str(files["ca"]))
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage="
                                       "serverAuth,clientAuth"),
                            ("client", "extendedKeyUsage=clientAuth")):
        csr, ext = tmp_path / f"{name}.csr", tmp_path / f"{name}.ext"
        ext.write_text(extension + "\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(files[f"{name}_key"]), "-out", str(csr))
        run("x509", "-req", "-in", str(csr), "-CA", str(files["ca"]), "-CAkey",
            str(files["ca_key"]), "-CAcreateserial", "-days", "1", "-extfile", str(ext),
            "-out", str(files[name]))
    return files
