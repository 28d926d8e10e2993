"""`python -m sglang_compact.launch_server`: SGLang's server with the `compact` attention backend.

Takes every `sglang.launch_server` flag plus the `--compact-*` flags
(`sglang_compact/srt/args.py`), validates them once, and starts SGLang's own
server. With `--attention-backend compact` it turns on SGLang's head-major KV
pool (`SGLANG_USE_HND_KVCACHE=1`, inherited by the spawned scheduler processes)
and hands the `CompactConfig` to them on `ServerArgs`. With `--device cpu` (or
on a machine without CUDA) it sets what SGLang's CPU path needs itself.

Bad flags exit with status 2 and a one-line reason on stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from sglang_compact.srt.args import PROG, build_config, config_error_message, split_args
from sglang_compact.srt.model_checks import UnsupportedModelError, check_search_kernel, check_server_features
from sglang_compact.srt.plugin import BACKEND_NAME, names_compact

#: what SGLang 0.5.17's CPU path needs in every process of the server
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",      # SGLang's CPU platform
    "TRITON_INTERPRET": "1",           # the paged allocator's Triton kernels run on CPU tensors
    "SGLANG_COMPACT_CPU_SHIM": "1",    # stand-ins for CUDA-only imports (sglang_compact.srt.cpu_shim)
}


class LaunchError(ValueError):
    pass


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def prepare_environment(argv: Sequence[str]) -> None:
    """Before SGLang is imported: the CPU path's environment and import shims (here, and through the .pth
    hook that scripts/setup_cpu.sh installs, in every spawned server process)."""
    if _flag_value(argv, "--device") == "cpu" or not _cuda_available():
        for k, v in CPU_ENV.items():
            os.environ.setdefault(k, v)
        from sglang_compact.srt.cpu_shim import install_cpu_shims
        install_cpu_shims()


def prepare(argv: Sequence[str]):
    """Parse and validate; returns SGLang's ServerArgs (with the config attached when the backend is used)."""
    from sglang_compact.srt import compat

    ours, sglang_argv = split_args(argv)
    if names_compact(sglang_argv):
        os.environ["SGLANG_USE_HND_KVCACHE"] = "1"  # before SGLang reads it
    compat.load_plugins()  # registers the `compact` backend and CLI choice (our entry point)
    try:
        server_args = compat.prepare_server_args(sglang_argv)
    except ValueError as e:  # SGLang's own checks of its flags (a combination it refuses): its reason, one line
        raise LaunchError(" ".join(str(e).split())) from None
    prefill, decode = compat.attention_backends(server_args)
    if BACKEND_NAME not in (prefill, decode):
        defaults, _ = split_args([])
        if vars(ours) != vars(defaults):
            raise LaunchError("--compact-* flags need --attention-backend compact")
        return server_args
    if prefill != decode:
        raise LaunchError(f"--prefill-attention-backend {prefill} / --decode-attention-backend {decode}: 'compact' "
                          "must serve both (its head-major KV pool is unreadable to the other backends): use "
                          "--attention-backend compact")
    if server_args.speculative_algorithm is not None:
        raise LaunchError(f"--speculative-algorithm {server_args.speculative_algorithm}: the compact backend does "
                          "not support speculative decoding; drop the flag or use another backend")
    try:
        config = build_config(ours, server_args.page_size)
    except ValueError as e:
        raise LaunchError(config_error_message(e)) from None
    try:
        check_search_kernel(config, str(getattr(server_args, "device", None) or ""))
        check_server_features(server_args)
    except UnsupportedModelError as e:
        raise LaunchError(str(e)) from None
    chunk = server_args.chunked_prefill_size
    window = config.window_tokens(chunk)
    if chunk and chunk > 0 and chunk % window:
        raise LaunchError(f"--chunked-prefill-size {chunk} is not a multiple of the union window ({window} tokens): "
                          f"use a multiple of {window}, or --compact-union-window with a divisor of {chunk} that is "
                          f"a multiple of --page-size {server_args.page_size}")
    compat.attach_config(server_args, config)
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
    prepare_environment(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(f"{PROG} takes every sglang.launch_server flag (listed after these) and:\n")
        print(compact_help())
        sys.stdout.flush()
    try:
        server_args = prepare(argv)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    from sglang_compact.srt import compat
    compat.run_server(server_args)


if __name__ == "__main__":
    main()
