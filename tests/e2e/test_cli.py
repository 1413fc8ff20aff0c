"""The command lines: `inflight-client` against the session's server; `inflight serve` start and Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from e2e_util import wait_for
from helpers import PROMPTS

from inflight import SamplingParams
from inflight.launcher.server import LauncherError, TritonServer, free_port, free_ports


def test_client_cli_streams_text(server, offline_llm):
    prompt = PROMPTS[0]
    expected = offline_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].text
    cmd = [sys.executable, "-m", "inflight_client.cli", prompt, "--url", server.grpc_url]
    proc = subprocess.run(
        cmd + ["--max-tokens", "16", "--temperature", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
    assert "TTFT" in proc.stderr and "tokens/s" in proc.stderr


def test_client_cli_reports_bad_request(server):
    cmd = [sys.executable, "-m", "inflight_client.cli", "Hello", "--url", server.grpc_url, "--top-p", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith("inflight-client: top_p=2.0 is invalid")


def test_bad_engine_parameter_fails_model_load_naming_it(tmp_path):
    log = tmp_path / "server.log"
    server = TritonServer(
        parameters={"max_num_seqs": "lots"}, http_port=0, grpc_port=0, metrics_port=0, log=log
    ).start()
    try:
        with pytest.raises(LauncherError) as info:
            server.wait_ready(timeout_s=120)
    finally:
        server.stop()
    assert "max_num_seqs" in str(info.value)


def test_inflight_serve_starts_and_stops_on_ctrl_c(demo_model_dir, tmp_path):
    http, grpc, metrics, api = free_ports(4)
    # --model relative to where the command runs (tritonserver's Python backend runs elsewhere)
    model = Path(demo_model_dir)
    cmd = [sys.executable, "-m", "inflight.launcher.cli", "serve", "--model", model.name, "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--max-num-seqs", "2", "--num-kv-blocks", "6",
           "--max-model-len", "128", "--openai-port", str(api), "--openai-host", "127.0.0.1"]  # fmt: skip
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=model.parent)
    try:

        def ready() -> bool:
            try:
                return urllib.request.urlopen(f"http://localhost:{http}/v2/models/llm/ready", timeout=2).status == 200
            except OSError:
                return proc.poll() is not None  # died: stop waiting

        assert wait_for(ready, timeout_s=180, interval_s=0.5) and proc.poll() is None
        from inflight_client import LLMClient

        assert LLMClient(f"localhost:{grpc}").generate("Hello", {"max_tokens": 4}).text
        assert _openai_chat(f"http://127.0.0.1:{api}").choices[0].message.content
        # No max_tokens: the default, the rest of the context, is capped by the KV cache's 96 tokens.
        done = _openai_chat(f"http://127.0.0.1:{api}", max_tokens=None, extra_body={"ignore_eos": True})
        assert done.choices[0].finish_reason == "length" and done.usage.total_tokens == 96
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    for url in (f"http://localhost:{http}/v2/health/live", f"http://127.0.0.1:{api}/v1/models"):
        with pytest.raises(OSError):
            urllib.request.urlopen(url, timeout=2)


def _openai_chat(base_url: str, max_tokens: int | None = 4, **kwargs):
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Hello"}]
    return client.chat.completions.create(model="llm", messages=messages, max_tokens=max_tokens, **kwargs)


def test_inflight_openai_fronts_a_running_triton_and_stops_on_ctrl_c(server, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "inflight.launcher.cli", "openai", "--triton-url", server.grpc_url,
           "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    log = open(tmp_path / "openai.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def listening() -> bool:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                return proc.poll() is not None

        assert wait_for(listening, timeout_s=60, interval_s=0.2) and proc.poll() is None
        assert _openai_chat(f"http://127.0.0.1:{port}")  # the template comes from Triton's `model` parameter
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_server_log_names_the_dtype_it_runs_in(server, server_log, demo_model_dir):
    # dtype=auto is bf16 on a CPU with AMX / AVX512-BF16 and fp32 on others: the operator must see which.
    from e2e_util import ENGINE_ARGS

    from inflight.config import EngineConfig
    from inflight.engine.engine import bf16_probe
    from inflight.models.config import ModelConfig

    probe = bf16_probe(ModelConfig.load(demo_model_dir))  # the server measured it first; this reads its cache
    dtype, why = EngineConfig(**ENGINE_ARGS).resolve_dtype(torch.float32, probe)  # the demo checkpoint is fp32
    log = server_log.read_text(errors="replace")
    assert f"dtype {str(dtype).removeprefix('torch.')} on cpu ({why})" in log
    assert f"engine ready: dtype={str(dtype).removeprefix('torch.')}," in log
