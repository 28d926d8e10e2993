"""Start a real SGLang 0.5.17 server (CPU or CUDA) for the evaluation, the benchmarks and the tests.

The one server harness of the repository: the eval CLI (`harness.eval`), `scripts/bench_ttft.py`,
`scripts/gpu/{accuracy_h200,serving_check,smollm2_h200}.py` and the tests (``tests/serving.py``
re-exports it with the tests' log folder) all start their servers with it.

    with SGLangServer(model_path, page_size=16, chunked_prefill_size=256, log_path=log) as srv:
        out = srv.generate(input_ids=[...], max_new_tokens=16)
        out.output_ids, out.meta_info["cached_tokens"], out.seconds

What it does:
* runs ``python -m sglang.launch_server`` (``module=`` to change it) in its
  own process group on a free loopback port (``port=`` to pick one), with the
  CPU flags below on the CPU;
* environment: ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU platform),
  ``TRITON_INTERPRET=1`` (the paged allocator's Triton kernels
  ``alloc_extend_kernel`` / ``alloc_decode_kernel`` run on CPU tensors when
  ``--page-size`` > 1), ``SGLANG_COMPACT_CPU_SHIM=1`` (the ``.pth`` start-up
  hook of ``sglang_compact.srt.cpu_shim`` stands in for ``sgl_kernel`` and
  ``torchvision`` in every server process); offline Hugging Face. ``env=``
  adds to it (a ``None`` value removes a variable);
* streams the server's stdout+stderr into ``log_path``, only the path it is
  given: with ``log_path=None`` the output is kept in memory (the last
  ``LOG_TAIL_BYTES``) and nothing is written;
* waits for ``/health`` (raising ``ServerError`` with the log's tail if the
  server dies or the timeout passes); a server that dies because another
  process bound the port it was given first is started again on a new port
  (when the port was the harness's choice);
* ``generate()`` posts to ``/generate`` (greedy by default) and returns the
  output ids, text, ``meta_info`` (``cached_tokens``, ``prompt_tokens``...) and
  the request's wall time; ``post`` / ``get_json`` / ``get_text`` / ``metrics``
  for the other endpoints (``/metrics`` is served with ``--enable-metrics``);
* always kills the whole process group on exit (SIGTERM, then SIGKILL after
  ``stop_grace`` seconds).

CPU flags (``BASE_ARGS``, unless ``cpu_flags=False``): ``--device cpu
--attention-backend torch_native`` (CPU x86 defaults to ``intel_amx``, which
needs the real sgl_kernel), ``--disable-cuda-graph --skip-server-warmup``,
``--sampling-backend pytorch``, and a small ``--max-total-tokens`` /
``--max-running-requests`` to keep the KV pool and req_to_token small.

``device="cuda"`` drops the CPU flags and the CPU environment (no shim):
SGLang's own GPU defaults plus the arguments given. ``None`` for ``dtype``,
``max_total_tokens`` or ``max_running_requests`` leaves that flag out (to
SGLang, or to ``extra_args``); ``max_total_tokens=None`` leaves the KV pool size
to ``--mem-fraction-static``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

BASE_ARGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-cuda-graph",
    "--skip-server-warmup",
]

SERVER_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "TRITON_INTERPRET": "1",
    "SGLANG_COMPACT_CPU_SHIM": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
# the part of SERVER_ENV that is not about the CPU (device="cuda")
CPU_ONLY_ENV = ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET", "SGLANG_COMPACT_CPU_SHIM")
LOG_TAIL_BYTES = 64 << 10  # kept in memory when there is no log file
PORT_TAKEN = "address already in use"   # uvicorn's bind error ([Errno 98]) in the server's output
PORT_RETRIES = 2


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_shim_hook_installed() -> bool:
    """True when the ``.pth`` start-up hook of the CPU shim is in site-packages."""
    import site
    import sysconfig

    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    dirs.update(getattr(site, "getsitepackages", lambda: [])())
    return any(os.path.exists(os.path.join(d, "sglang_compact_cpu_shim.pth")) for d in dirs)


@dataclass
class GenerateResult:
    output_ids: List[int]
    text: str
    meta_info: Dict[str, Any] = field(default_factory=dict)
    raw: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the request
    token_times: List[float] = field(default_factory=list)  # streamed: time.monotonic() as each output token arrived

    @property
    def cached_tokens(self) -> int:
        return int(self.meta_info.get("cached_tokens", 0))


class ServerError(RuntimeError):
    pass


class SGLangServer:
    """A real SGLang server subprocess (context manager); on the CPU unless ``device="cuda"``."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        extra_args: Sequence[str] = (),
        page_size: Optional[int] = None,
        chunked_prefill_size: Optional[int] = None,
        dtype: Optional[str] = "float32",
        max_total_tokens: Optional[int] = 8192,
        max_running_requests: Optional[int] = 8,
        module: str = "sglang.launch_server",
        host: str = "127.0.0.1",
        port: Optional[int] = None,
        env: Optional[Mapping[str, Optional[str]]] = None,
        log_path: Optional[str | os.PathLike] = None,
        start_timeout: float = 240.0,
        request_timeout: float = 600.0,
        require_cpu_shim: bool = True,
        device: str = "cpu",
        cpu_flags: bool = True,
        cwd: Optional[str | os.PathLike] = None,
        stop_grace: float = 3.0,
    ):
        self.model_path = str(model_path)
        self.host = host
        self._port_chosen = port is None   # ours to change when another process takes it first
        self.port = port or free_port(host)
        self.base_url = f"http://{host}:{self.port}"
        self.module = module
        self.start_timeout = start_timeout
        self.request_timeout = request_timeout
        self.stop_grace = stop_grace
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device = device
        cpu = device == "cpu"
        self.require_cpu_shim = require_cpu_shim and cpu
        args = [
            "--model-path", self.model_path,
            "--host", host,
            "--port", str(self.port),
        ]
        if dtype is not None:
            args += ["--dtype", dtype]
        if max_total_tokens is not None:
            args += ["--max-total-tokens", str(max_total_tokens)]
        if max_running_requests is not None:
            args += ["--max-running-requests", str(max_running_requests)]
        if cpu and cpu_flags:
            args += BASE_ARGS
        if page_size is not None:
            args += ["--page-size", str(page_size)]
        if chunked_prefill_size is not None:
            args += ["--chunked-prefill-size", str(chunked_prefill_size)]
        args += list(extra_args)
        self.args = args
        self.env = dict(os.environ)
        self.env.update(SERVER_ENV if cpu else {k: v for k, v in SERVER_ENV.items() if k not in CPU_ONLY_ENV})
        for k, v in (env or {}).items():
            if v is None:
                self.env.pop(k, None)
            else:
                self.env[k] = v
        self.cwd = None if cwd is None else str(cwd)
        # may be changed until start(); None: the output is kept in memory only
        self.log_path: Optional[Path] = None if log_path is None else Path(log_path)
        self.proc: Optional[subprocess.Popen] = None
        self._log_file = None
        self._tail = bytearray()
        self._tail_lock = threading.Lock()
        self._reader: Optional[threading.Thread] = None
        self.startup_seconds: Optional[float] = None

    # ------------------------------------------------------------------ life
    @property
    def command(self) -> List[str]:
        return [sys.executable, "-m", self.module, *self.args]

    def start(self) -> "SGLangServer":
        """Start and wait for `/health`. A port we chose (none given) that another process binds first, between
        `free_port` and the server's bind (SGLang picks its own internal ports at start-up too), is replaced by a
        fresh one and the start retried, up to PORT_RETRIES times."""
        for attempt in range(PORT_RETRIES + 1):
            try:
                return self._start_once()
            except ServerError as e:
                if not (self._port_chosen and attempt < PORT_RETRIES and PORT_TAKEN in str(e)):
                    raise
                self._use_port(free_port(self.host))
        raise AssertionError("unreachable")

    def _use_port(self, port: int) -> None:
        i = self.args.index("--port")
        self.args[i + 1] = str(port)
        self.port = port
        self.base_url = f"http://{self.host}:{port}"

    def _start_once(self) -> "SGLangServer":
        if self.require_cpu_shim and not cpu_shim_hook_installed():
            raise ServerError(
                "the CPU shim start-up hook is not installed; run scripts/setup_cpu.sh "
                "(or: python -m sglang_compact.srt.cpu_shim --install-pth)"
            )
        header = ("$ " + " ".join(self.command) + "\n").encode()
        with self._tail_lock:
            self._tail = bytearray()
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")
            self._log_file.write(header)
            self._log_file.flush()
            out = self._log_file
        else:
            self._keep(header)
            out = subprocess.PIPE
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: killed as a whole
        )
        if self.log_path is None:
            self._reader = threading.Thread(target=self._read_output, args=(self.proc.stdout,), daemon=True,
                                            name=f"sglang-{self.port}-output")
            self._reader.start()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _keep(self, data: bytes) -> None:
        with self._tail_lock:
            self._tail += data
            if len(self._tail) > LOG_TAIL_BYTES:
                del self._tail[:-LOG_TAIL_BYTES]

    def _read_output(self, pipe) -> None:
        try:
            while True:
                data = pipe.read1(1 << 16)
                if not data:
                    break
                self._keep(data)
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"SGLang server exited with code {self.proc.returncode} during start-up; "
                    f"{self._log_name()}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        raise ServerError(
            f"SGLang server not healthy after {self.start_timeout:.0f}s; "
            f"{self._log_name()}:\n{self.log_tail()}"
        )

    def stop(self, grace: Optional[float] = None) -> None:
        grace = self.stop_grace if grace is None else grace
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                pgid = os.getpgid(proc.pid)
            except ProcessLookupError:
                pgid = None
            if pgid is not None:
                self._signal_group(pgid, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
                # Children (scheduler, detokenizer) may outlive the launcher.
                self._signal_group(pgid, signal.SIGKILL)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.join(timeout=grace)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):  # last resort
        try:
            self.stop(grace=1.0)
        except Exception:
            pass

    def _log_name(self) -> str:
        return f"log {self.log_path}" if self.log_path is not None else "output (kept in memory, no log file)"

    def log_tail(self, n_chars: int = 6000) -> str:
        if self.log_path is None:
            with self._tail_lock:
                data = bytes(self._tail)
        else:
            try:
                data = self.log_path.read_bytes()
            except OSError:
                return "<no log>"
        return data[-n_chars:].decode(errors="replace")

    # -------------------------------------------------------------- requests
    def _check_running(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise ServerError(f"server is not running; {self._log_name()}:\n{self.log_tail()}")

    def _open(self, path: str, payload: Dict[str, Any], timeout: Optional[float] = None):
        """The open response to a JSON POST (read it in a ``with``); an HTTP error status raises ServerError."""
        self._check_running()
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            return urllib.request.urlopen(req, timeout=self.request_timeout if timeout is None else timeout)
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            raise ServerError(f"{path} -> HTTP {e.code}: {body}\nlog tail:\n{self.log_tail()}") from e

    def post(self, path: str, payload: Dict[str, Any], timeout: Optional[float] = None) -> Any:
        """POST JSON; the reply's JSON (plain text where it is not JSON, as ``/flush_cache``'s)."""
        with self._open(path, payload, timeout) as r:
            body = r.read()
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def get_text(self, path: str, timeout: float = 60.0) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
            return r.read().decode(errors="replace")

    def get_json(self, path: str, timeout: float = 60.0) -> Any:
        return json.loads(self.get_text(path, timeout))

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics`` (served with ``--enable-metrics``)."""
        return self.get_text("/metrics")

    def generate(
        self,
        input_ids: Optional[Sequence[int]] = None,
        text: Optional[str] = None,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        request: Optional[Dict[str, Any]] = None,
        **sampling_params: Any,
    ) -> GenerateResult:
        """Greedy (temperature 0) generation for one prompt, ids or text.

        ``request``: more top-level fields of the request (e.g. ``return_logprob``, ``top_logprobs_num``,
        ``logprob_start_len``); other keyword arguments are sampling parameters."""
        if (input_ids is None) == (text is None):
            raise ValueError("give exactly one of input_ids and text")
        payload: Dict[str, Any] = {
            "sampling_params": dict(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                ignore_eos=ignore_eos,
                **sampling_params,
            )
        }
        if input_ids is not None:
            payload["input_ids"] = [int(t) for t in input_ids]
        else:
            payload["text"] = text
        payload.update(request or {})
        t0 = time.monotonic()
        out = self.post("/generate", payload)
        seconds = time.monotonic() - t0
        return GenerateResult(
            output_ids=list(out.get("output_ids", [])),
            text=out.get("text", ""),
            meta_info=out.get("meta_info", {}),
            raw=out,
            seconds=seconds,
        )

    def generate_stream(self, input_ids: Sequence[int], max_new_tokens: int) -> GenerateResult:
        """Greedy generation streamed (EOS ignored): the output ids, the last event's ``meta_info``, and in
        ``token_times`` the ``time.monotonic()`` at which each output token reached this client (tokens that arrive
        in one event share its time)."""
        payload = {"input_ids": [int(t) for t in input_ids], "stream": True,
                   "sampling_params": dict(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)}
        res = GenerateResult(output_ids=[], text="")
        t0 = time.monotonic()
        with self._open("/generate", payload) as r:
            for line in r:
                if not line.startswith(b"data:"):
                    continue
                body = line[5:].strip()
                if body == b"[DONE]":
                    break
                out = json.loads(body)
                if "error" in out:
                    raise ServerError(f"/generate (stream) -> {out['error']}\nlog tail:\n{self.log_tail()}")
                now = time.monotonic()
                new = list(out.get("output_ids", []))
                res.meta_info = out.get("meta_info", {})
                # the whole output so far, or only the new ids under --incremental-streaming-output
                n = int(res.meta_info.get("completion_tokens", len(res.output_ids) + len(new)))
                res.output_ids = new if len(new) == n else res.output_ids + new
                res.token_times += [now] * (n - len(res.token_times))
                res.raw = out
        res.seconds = time.monotonic() - t0
        return res

    def flush_cache(self, timeout: float = 30.0) -> None:
        """Empty the radix cache. SGLang refuses (400) while a request is still finishing, which can be just after
        its response arrived: retry until it accepts, for `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.base_url + "/flush_cache", timeout=30) as r:
                    r.read()
                return
            except urllib.error.HTTPError as e:
                if e.code != 400 or time.monotonic() > deadline:
                    raise ServerError(f"/flush_cache answered {e.code}: {e.read()[:200]!r}") from e
                time.sleep(0.25)
