"""`make image`: build deploy/Dockerfile with buildah, write it as an OCI archive, print
its digest and the commands that push it and pin the manifests to it.

    python deploy/build_image.py [--out DIR] [--base IMAGE] [--name NAME]

- The tag is the version and the commit, `0.1.0-g<12 hex>` (`-dirty` when the work tree
  has uncommitted changes): a new commit is a new tag, so a node never runs a stale
  image under an old name.
- The archive is `DIR/pdreg-TAG.oci.tar` (OCI image layout); its digest is the
  manifest's, the one `skopeo copy --preserve-digests` keeps when it pushes it and the
  one the manifests pin (`kustomize edit set image pdreg=REGISTRY/pdreg:TAG@DIGEST`).
- `--base` replaces the Dockerfile's digest-pinned base (a mirror of it, or the local
  stand-in that tests/image/build-base.sh makes where no registry can be reached).
- The package indexes this machine's pip uses go to the build as PIP_INDEX_URL /
  PIP_EXTRA_INDEX_URL (a local file:// index is served over loopback meanwhile); the
  locks' hashes decide which files pass.

Needs buildah (root, or rootless buildah set up); no container daemon, no registry.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import subprocess
import sys
import threading
import tomllib
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "deploy" / "Dockerfile"
BUILD_TIMEOUT_S = 1800

__all__ = ["build", "image_tag", "pip_index_args", "write_archive"]


def log(message: str) -> None:
    print(f"image: {message}", flush=True)


def image_tag() -> str:
    """pyproject's version and the commit: `0.1.0-g0123456789ab[-dirty]`."""
    with (REPO / "pyproject.toml").open("rb") as file:
        version = tomllib.load(file)["project"]["version"]
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                           check=True, capture_output=True, text=True).stdout.strip()
    return f"{version}-g{commit}{'-dirty' if dirty else ''}"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _served_index(directory: Path) -> Iterator[str]:
    """A file:// package index (DIRECTORY/simple, links relative to DIRECTORY) served
    over HTTP on 127.0.0.1 for the build's pip: chroot isolation shares this network,
    not this disk. Yields the index URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()


def pip_index_args(stack: contextlib.ExitStack) -> list[str]:
    """--build-arg for the indexes this machine's pip uses (env first, then pip's config):
    http(s) as they are, a local file://.../simple index served over loopback while the
    build runs."""
    args = []
    for name, key in (("PIP_INDEX_URL", "global.index-url"),
                      ("PIP_EXTRA_INDEX_URL", "global.extra-index-url")):
        value = os.environ.get(name)
        if value is None:
            got = subprocess.run([sys.executable, "-m", "pip", "config", "get", key],
                                 capture_output=True, text=True)
            value = got.stdout.strip() if got.returncode == 0 else ""
        urls = []
        for url in value.split():
            local = Path(urllib.parse.urlsplit(url).path)
            if url.startswith(("http://", "https://")):
                urls.append(url)
            elif url.startswith("file://") and local.name == "simple" and local.is_dir():
                urls.append(stack.enter_context(_served_index(local.parent)))
        if urls:
            args += ["--build-arg", f"{name}={' '.join(urls)}"]
    return args


def build(image: str, *, base: str | None = None, pull: str = "missing",
          extra_args: tuple[str, ...] = ()) -> None:
    """`buildah bud` of deploy/Dockerfile as IMAGE. Raises SystemExit with buildah's
    output on failure."""
    with contextlib.ExitStack() as stack:
        indexes = pip_index_args(stack)
        log(f"pip index for the build: {' '.join(indexes[1::2]) or 'pip default'}")
        result = subprocess.run(
            # --no-cache: buildah's layer cache does not key a RUN on what it bind-mounts
            # from another stage, so a cached install step would keep the previous wheel.
            # --format docker keeps the HEALTHCHECK (Compose reads it); the OCI archive
            # written from it carries an OCI manifest, which is what gets pushed.
            ["buildah", "bud", "--isolation", "chroot", "--format", "docker",
             f"--pull={pull}", "--no-cache", "-f", str(DOCKERFILE),
             "--ignorefile", str(DOCKERFILE.with_name("Dockerfile.dockerignore")),
             *(["--build-arg", f"BASE={base}"] if base else []), *indexes, *extra_args,
             "-t", image, str(REPO)],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if result.returncode != 0:
        raise SystemExit(f"buildah bud failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    # The image this replaced is left untagged: drop it, or every build keeps one more.
    subprocess.run(["buildah", "rmi", "--prune"], capture_output=True)


def write_archive(image: str, out: Path) -> tuple[Path, str]:
    """IMAGE as an OCI archive in OUT; (its path, the manifest's digest)."""
    out.mkdir(parents=True, exist_ok=True)
    name, _, tag = image.rpartition(":")
    archive = out / f"{name.rsplit('/', 1)[-1]}-{tag}.oci.tar"
    archive.unlink(missing_ok=True)
    digest_file = out / f".{archive.name}.digest"
    result = subprocess.run(["buildah", "push", "--quiet", "--format", "oci", "--digestfile",
                             str(digest_file), image, f"oci-archive:{archive}:{image}"],
                            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if result.returncode != 0:
        raise SystemExit(f"buildah push failed:\n{result.stdout}{result.stderr}")
    digest = digest_file.read_text().strip()
    digest_file.unlink()
    return archive, digest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "build" / "image",
                        help="where the OCI archive goes (default: build/image)")
    parser.add_argument("--base", default=None,
                        help="the base image instead of the Dockerfile's pinned one")
    parser.add_argument("--name", default="pdreg", help="the image's name (default: pdreg)")
    args = parser.parse_args()
    image = f"{args.name}:{image_tag()}"
    log(f"building {image} from {DOCKERFILE.relative_to(REPO)}"
        + (f" on {args.base}" if args.base else ""))
    build(image, base=args.base, pull="never" if args.base else "missing")
    archive, digest = write_archive(image, args.out)
    tag = image.rpartition(":")[2]
    print(f"image    {image}\narchive  {archive}\ndigest   {digest}\n"
          f"push     skopeo copy --preserve-digests oci-archive:{archive} "
          f"docker://REGISTRY/{args.name}:{tag}\n"
          f"pin      cd deploy/k8s/images && kustomize edit set image "
          f"pdreg=REGISTRY/{args.name}:{tag}@{digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
