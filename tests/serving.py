"""Test-side name for the CPU server harness, which lives in `sglang_compact.eval.server`
(the evaluation starts the same servers): `SGLangServer`, `SERVER_ENV`, `free_port`,
`cpu_shim_hook_installed`, `GenerateResult`, `ServerError`."""

from sglang_compact.eval.server import (  # noqa: F401
    BASE_ARGS,
    DEFAULT_LOG_DIR,
    REPO_ROOT,
    SERVER_ENV,
    GenerateResult,
    ServerError,
    SGLangServer,
    cpu_shim_hook_installed,
    free_port,
)
