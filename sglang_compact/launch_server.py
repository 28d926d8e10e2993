"""`python -m sglang_compact.launch_server`: SGLang's server with the `compact` attention backend.

Takes every `sglang.launch_server` flag plus the `--compact-*` flags
(`sglang_compact/srt/args.py`), validates them once, and starts SGLang's own
server. With `--attention-backend compact` it turns on SGLang's head-major KV
pool (`SGLANG_USE_HND_KVCACHE=1`, inherited by the spawned scheduler processes)
and hands the `CompactConfig` to them on `ServerArgs`.

Bad flags exit with status 2 and a one-line reason on stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from sglang_compact.srt.args import BACKEND_NAME, build_config, split_args

PROG = "sglang_compact.launch_server"


class LaunchError(ValueError):
    pass


PREFILL_GRAPH_FLAGS = ("--disable-prefill-cuda-graph", "--cuda-graph-backend-prefill", "--disable-cuda-graph",
                       "--cuda-graph-config")


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _names_compact(argv: Sequence[str]) -> bool:
    return BACKEND_NAME in {_flag_value(argv, f) for f in
                            ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")}


def prepare(argv: Sequence[str]):
    """Parse and validate; returns SGLang's ServerArgs (with `_compact_config` when the backend is used)."""
    ours, sglang_argv = split_args(argv)
    if _flag_value(sglang_argv, "--device") == "cpu":
        # stand-ins for CUDA-only imports, here and (through the .pth hook that
        # scripts/setup_cpu.sh installs) in every spawned server process
        os.environ.setdefault("SGLANG_COMPACT_CPU_SHIM", "1")
        from sglang_compact.srt.cpu_shim import install_cpu_shims
        install_cpu_shims()
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()  # registers the `compact` backend and CLI choice (our entry point)
    if _names_compact(sglang_argv) and not any(a.split("=")[0] in PREFILL_GRAPH_FLAGS for a in sglang_argv):
        # the compact path plans per forward pass on the host; SGLang's prefill
        # CUDA graphs (on by default on CUDA) are not supported by it yet
        print(f"{PROG}: note: adding --disable-prefill-cuda-graph (decode CUDA graphs stay on)", file=sys.stderr)
        sglang_argv = [*sglang_argv, "--disable-prefill-cuda-graph"]
    server_args = prepare_server_args(sglang_argv)
    prefill, decode = server_args.get_attention_backends()
    if BACKEND_NAME not in (prefill, decode):
        defaults, _ = split_args([])
        if vars(ours) != vars(defaults):
            raise LaunchError("--compact-* flags need --attention-backend compact")
        return server_args
    if prefill != decode:
        raise LaunchError(f"--prefill-attention-backend {prefill} / --decode-attention-backend {decode}: 'compact' "
                          "must serve both (it switches the KV pool to the head-major layout, which the other "
                          "backends cannot read); use --attention-backend compact")
    if server_args.speculative_algorithm is not None:
        raise LaunchError(f"--speculative-algorithm {server_args.speculative_algorithm}: the compact backend does "
                          "not support speculative decoding")
    try:
        config = build_config(ours, server_args.page_size)
    except ValueError as e:
        raise LaunchError(f"{e} (with --page-size {server_args.page_size})") from None
    os.environ["SGLANG_USE_HND_KVCACHE"] = "1"
    # ServerArgs is read-only once resolved except for private names; it reaches
    # the scheduler processes pickled, attributes included
    server_args._compact_config = config
    return server_args


def compact_help() -> str:
    """The `--compact-*` flags' help (SGLang's parser, which prints the rest, does not know them)."""
    import argparse

    from sglang_compact.srt.args import add_compact_args
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, usage=argparse.SUPPRESS)
    add_compact_args(parser)
    return parser.format_help()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(f"{PROG} takes every sglang.launch_server flag (listed after these) and:\n")
        print(compact_help())
        sys.stdout.flush()
    try:
        server_args = prepare(argv)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
