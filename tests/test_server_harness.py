"""`harness.server.SGLangServer` without SGLang: a stand-in server module (a tiny HTTP server) started the same way,
its output in a log file or in memory only, its failures reported with the output's tail, its group killed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from harness.server import GenerateResult, ServerError, SGLangServer, free_port

FAKE = r'''
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
print("fake server on", port, "args", " ".join(sys.argv[1:]), flush=True)
if "--port-taken-once" in sys.argv:   # as uvicorn reports a port another process bound first; once
    import pathlib
    flag = pathlib.Path(sys.argv[sys.argv.index("--port-taken-once") + 1])
    if not flag.exists():
        flag.write_text(str(port))
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
              "address already in use", flush=True)
        sys.exit(3)
if "--die" in sys.argv:
    print("fake server: dying on purpose", flush=True)
    sys.exit(3)


class H(http.server.BaseHTTPRequestHandler):
    def _send(self, body, ctype="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/metrics":
            self._send(b"sglang:compact_chunks_total 2.0\n", "text/plain")
        elif self.path.startswith("/v1/loads"):
            self._send(json.dumps({"loads": [{"num_used_tokens": 0}]}).encode())
        else:  # /health, /flush_cache
            self._send(b"")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/generate":
            self._send(json.dumps({"text": " hi", "output_ids": [5, 6], "meta_info": {"cached_tokens": 3},
                                   "request": body}).encode())
        else:
            self._send(b"Cache flushed.", "text/plain")

    def log_message(self, *a):
        print("request", self.path, flush=True)


http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture()
def fake_module(tmp_path) -> Path:
    d = tmp_path / "mod"
    d.mkdir()
    (d / "fake_sglang_server.py").write_text(FAKE)
    return d


def _server(mod_dir: Path, **kw) -> SGLangServer:
    # device="cuda": no CPU flags and no CPU shim environment (the stand-in needs neither)
    return SGLangServer("/no/model", module="fake_sglang_server", device="cuda", dtype=None, max_total_tokens=None,
                        max_running_requests=None, cwd=mod_dir, start_timeout=30, request_timeout=30,
                        env={"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(mod_dir)}, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_in_memory_output_writes_nothing(fake_module, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    srv = _server(fake_module, extra_args=["--flag", "1"])
    assert srv.log_path is None
    assert srv.command[:3] == [sys.executable, "-m", "fake_sglang_server"] and srv.command[-2:] == ["--flag", "1"]
    with srv:
        pid = srv.proc.pid
        assert srv.startup_seconds is not None and srv.base_url.endswith(f":{srv.port}")
        out = srv.generate(input_ids=[1, 2, 3], max_new_tokens=2, ignore_eos=True,
                           request={"return_logprob": True, "top_logprobs_num": 2})
        assert isinstance(out, GenerateResult) and out.output_ids == [5, 6] and out.text == " hi"
        assert out.cached_tokens == 3 and out.seconds > 0
        sent = out.raw["request"]
        assert sent["input_ids"] == [1, 2, 3] and sent["return_logprob"] is True and sent["top_logprobs_num"] == 2
        assert sent["sampling_params"] == {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}
        assert srv.post("/flush_cache", {}) == "Cache flushed."  # plain text answers come back as text
        srv.flush_cache()
        assert "sglang:compact_chunks_total 2.0" in srv.metrics()
        assert srv.get_json("/v1/loads?include=core") == {"loads": [{"num_used_tokens": 0}]}
        tail = srv.log_tail()
        assert tail.startswith("$ ") and "fake server on" in tail and "request /generate" in tail
    assert srv.proc is None and not _alive(pid)
    assert not any(cwd.iterdir()) and sorted(p.name for p in fake_module.iterdir()) == ["fake_sglang_server.py"]


def test_log_file_and_start_failure(fake_module, tmp_path):
    log = tmp_path / "logs" / "server.log"
    with _server(fake_module, log_path=log) as srv:
        srv.generate(text="hello", max_new_tokens=1)
    text = log.read_text()
    assert text.startswith("$ ") and "--model-path /no/model" in text and "request /generate" in text
    for log_path in (tmp_path / "dead.log", None):
        srv = _server(fake_module, extra_args=["--die"], log_path=log_path)
        with pytest.raises(ServerError, match="exited with code 3") as e:
            srv.start()
        assert "dying on purpose" in str(e.value) and srv.proc is None
    assert "dying on purpose" in (tmp_path / "dead.log").read_text()


def test_a_port_taken_before_the_server_binds_it_is_replaced(fake_module, tmp_path):
    """The server dies with "address already in use" on the port the harness chose: started again on a fresh
    port. A port the caller gave is not changed: the error is raised."""
    flag = tmp_path / "taken"
    srv = _server(fake_module, extra_args=["--port-taken-once", str(flag)])
    with srv:
        first = int(flag.read_text())
        assert srv.port != first and srv.base_url.endswith(f":{srv.port}")
        assert srv.command[srv.command.index("--port") + 1] == str(srv.port)
        assert srv.generate(text="hi", max_new_tokens=1).output_ids == [5, 6]
    flag.unlink()
    given = _server(fake_module, extra_args=["--port-taken-once", str(flag)], port=free_port())
    with pytest.raises(ServerError, match="address already in use"):
        given.start()


def test_env_overrides():
    os.environ["SGLANG_COMPACT_TEST_DROP_ME"] = "x"
    try:
        s = SGLangServer("/m", device="cuda", port=30003, env={"SGLANG_COMPACT_TEST_DROP_ME": None, "A_NEW_VAR": "1"})
    finally:
        del os.environ["SGLANG_COMPACT_TEST_DROP_ME"]
    assert "SGLANG_COMPACT_TEST_DROP_ME" not in s.env and s.env["A_NEW_VAR"] == "1" and s.env["HF_HUB_OFFLINE"] == "1"
    cpu = SGLangServer("/m", port=30004, cpu_flags=False, dtype=None, max_total_tokens=None, max_running_requests=None,
                       extra_args=["--x"])
    assert cpu.args == ["--model-path", "/m", "--host", "127.0.0.1", "--port", "30004", "--x"]
    assert cpu.env["SGLANG_USE_CPU_ENGINE"] == "1" and cpu.require_cpu_shim
