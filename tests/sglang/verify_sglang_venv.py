"""Check that the SGLang virtualenv is what setup.sh built: pinned versions, workarounds.

    .venv-sglang/bin/python tests/sglang/verify_sglang_venv.py SGLANG_VERSION TORCH_VERSION

Exits 1 naming each thing that is off. Importing sglang's HTTP server and Mooncake's
engine also proves the dependency set is whole (a missing module fails here, in a second,
rather than as an engine that never becomes healthy).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

# Flags the check script passes (workaround 3 and the P/D set-up), with a choice it needs.
REQUIRED_FLAGS = {
    "--disable-overlap-schedule": None,
    "--disaggregation-decode-retraction-backup": "cpu_tensor",
    "--disaggregation-transfer-backend": "mooncake_tcp",
    "--disaggregation-bootstrap-port": None,
    "--disaggregation-mode": "prefill",
    "--max-total-tokens": None,
}


def problems(sglang_version: str, torch_version: str) -> list[str]:
    found: list[str] = []
    installed = importlib.metadata.version("sglang")
    if installed != sglang_version:
        found.append(f"sglang is {installed}, setup pins {sglang_version}")
    torch_installed = importlib.metadata.version("torch").split("+")[0]
    if torch_installed != torch_version:
        found.append(f"torch is {torch_installed}, sglang {sglang_version} needs {torch_version}")
    sgl_kernel = importlib.import_module("sgl_kernel")
    if not getattr(sgl_kernel, "PDREG_PLACEHOLDER", False):
        found.append(f"sgl_kernel at {sgl_kernel.__file__} is not pdreg's placeholder "
                     "(workaround 1)")
    try:
        conn = importlib.import_module("sglang.srt.disaggregation.mooncake.conn")
    except ImportError as exc:
        return [*found, f"cannot import sglang's Mooncake connector: {exc!r}"]
    sender = getattr(conn, "MooncakeKVSender", None)
    if sender is None or not hasattr(sender, "supports_host_tensor_indices"):
        found.append(f"{conn.__file__}: MooncakeKVSender.supports_host_tensor_indices is gone; "
                     "workaround 2 no longer applies to this sglang")
    elif sender.supports_host_tensor_indices is not False:
        found.append(f"{conn.__file__}: MooncakeKVSender.supports_host_tensor_indices is "
                     f"{sender.supports_host_tensor_indices!r}, must be False (workaround 2; "
                     "prefill dies 'Found no NVIDIA driver')")
    for module in ("sglang.srt.entrypoints.http_server", "mooncake.engine"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # any import failure is the finding
            found.append(f"cannot import {module}: {type(exc).__name__}: {exc}")
    server_args = importlib.import_module("sglang.srt.server_args")
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    actions = {option: action for action in parser._actions
               for option in action.option_strings}
    for flag, choice in REQUIRED_FLAGS.items():
        action = actions.get(flag)
        if action is None:
            found.append(f"sglang's launch_server has no {flag} (the flags of workaround 3 "
                         "and of P/D serving)")
        elif choice is not None and action.choices is not None and choice not in action.choices:
            found.append(f"sglang's {flag} no longer accepts {choice!r} ({action.choices})")
    return found


def main() -> int:
    found = problems(sys.argv[1], sys.argv[2])
    for problem in found:
        print(f"[setup] workaround check: {problem}", file=sys.stderr)
    if not found:
        print("[setup] sglang venv verified: versions pinned, sgl_kernel placeholder, "
              "Mooncake sender patched, server imports")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
