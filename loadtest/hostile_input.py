"""Hostile input against a real `inflight serve`: does one bad request, or one dead process, hurt anyone else?

    make hostile                                   # = python -m loadtest.hostile_input (demo model)
    python -m loadtest.hostile_input --only grammar top_p

The launcher runs as a user would start it (tritonserver, the engine process, the OpenAI port). A normal
client keeps streaming short requests over gRPC and records each one's TTFT. Meanwhile one attack at a time:
oversized prompts and stop lists, sampling values at the edge of their ranges, grammars that are slow,
ambiguous, huge or match nothing, oversized OpenAI bodies, Triton's admin APIs without the launch's secret,
and the engine process and the model's stub killed mid-stream. Per attack, one line: what the attacker got
(status or error), the normal requests' TTFT max and p50, and the memory of the whole server (every
process under the launcher) after the attack against before it. Targets (issue 27): a clear 4xx or served
within bounds, normal TTFT < 2 s throughout, memory back within 10%, and the server still serving.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:  # imported in main(): the soak's Locust process runs the attacks without torch
    from inflight.config import EngineConfig

ENGINE_ARGS = {"max_num_seqs": 16, "max_model_len": 2048, "num_kv_blocks": 512}
TTFT_LIMIT_S = 2.0
MEMORY_SLACK = 0.10


# ---- processes -----------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    try:
        root = psutil.Process(pid)
        return [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return [pid]


def cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def find(root: int, needle: str) -> int | None:
    return next((p for p in descendants(root) if p != root and needle in cmdline(p)), None)


# ---- the attacks -----------------------------------------------------------------------------------------


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 120):
    """(status, first 160 characters of the answer) of one HTTP request."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read(4096).decode(errors="replace")[:160]
    except urllib.error.HTTPError as e:
        return e.code, e.read(4096).decode(errors="replace")[:160]
    except OSError as e:
        return None, repr(e)[:160]


def openai_post(api: str, path: str, payload: dict | bytes, headers: dict | None = None) -> tuple[int | None, str]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    if len(body) > 1 << 20:
        return post_announced(api, path, body, headers)
    return http("POST", f"{api}{path}", body, {"Content-Type": "application/json", **(headers or {})})


def post_announced(api: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int | None, str]:
    """A large body announced by its Content-Length: a server that refuses it answers before reading it, so
    the answer is read first (a client still writing would only see the connection close)."""
    import http.client
    import select
    import urllib.parse

    url = urllib.parse.urlsplit(api)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    conn.putrequest("POST", path)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        conn.putheader(name, value)
    conn.endheaders()
    early = bool(select.select([conn.sock], [], [], 2.0)[0])
    if not early:  # it wants the body
        try:
            conn.send(body)
        except OSError as e:
            return None, f"closed while sending ({e!r})"[:160]
    resp = conn.getresponse()
    text = resp.read(4096).decode(errors="replace")[:160]
    conn.close()
    return resp.status, ("answered before the body was sent: " if early else "") + text


def big_schema(salt: int, size_bytes: int = 210_000) -> dict:
    """A JSON schema of about `size_bytes` (many enum-typed properties), distinct per `salt`."""
    props, n = {}, 0
    while len(json.dumps(props)) < size_bytes:
        props[f"field_{salt}_{n}"] = {"enum": [f"v{salt}_{n}_{k}" for k in range(8)]}
        n += 1
    return {"type": "object", "properties": props, "required": list(props)[:4]}


# An ambiguous EBNF: each level may match the same run of "a" in many ways, so the matcher's work per token
# grows with every level (issue 27 item 3).
AMBIGUOUS = "\n".join(["root ::= (x0)*"] + [f'x{i} ::= (x{i + 1})* "a"*' for i in range(40)] + ['x40 ::= "a"*'])


class Attack:
    def __init__(self, name: str, fn: Callable[[], Any], in_flight_ok: bool = False) -> None:
        self.name, self.fn, self.in_flight_ok = name, fn, in_flight_ok


def attacks(ctx: dict[str, Any], config: EngineConfig) -> list[Attack]:
    from inflight_client import InferenceError

    client, api, http_url, launcher = ctx["client"], ctx["api"], ctx["http"], ctx["launcher"]
    post = partial(openai_post, headers=ctx.get("api_headers"))  # the front's API key, where it has one

    def grpc(prompt: str, params: dict) -> str:
        try:
            done = client.generate(prompt, params)
            return f"served ({done.num_output_tokens} tokens, {done.finish_reason})"
        except InferenceError as e:
            return f"{e.code or 'error'}: {e.message[:120]}"

    longest = [f"{i:05d}" + "~" * (config.max_stop_str_len - 5) for i in range(config.max_stop_strings)]

    def tiny_schema_during_big_compiles() -> str:
        waits = []
        threads = [
            threading.Thread(
                target=lambda s=s: waits.append(
                    post(
                        api,
                        "/v1/chat/completions",
                        {
                            "model": "llm",
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 8,
                            "response_format": {
                                "type": "json_schema",
                                "json_schema": {"name": "big", "schema": big_schema(s)},
                            },
                        },
                    )[0]  # fmt: skip
                )
            )
            for s in (int(time.time()), int(time.time()) + 1)
        ]
        for t in threads:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        tiny = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        status, _ = post(api, "/v1/chat/completions", {
            "model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "tiny", "schema": tiny}},
        })  # fmt: skip
        tiny_s = time.monotonic() - t0
        for t in threads:
            t.join()
        return f"tiny schema {status} in {tiny_s:.2f} s; the two 210 KB schemas: {sorted(waits)}"

    def kill_engine_core() -> str:
        core = find(launcher.pid, "inflight.engine.core") or find(launcher.pid, "multiprocessing.spawn")
        if core is None:
            return "no engine process found"
        stream = client.stream("Once upon a time", {"max_tokens": 400, "ignore_eos": True, "temperature": 0})
        next(iter(stream))
        os.kill(core, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            list(stream)
            ended = "the stream ended without an error"
        except InferenceError as e:
            ended = f"in-flight stream failed after {time.monotonic() - t0:.2f} s ({e.message[:60]})"
        return ended + "; " + served_again(t0)

    def kill_stub() -> str:
        stub = find(launcher.pid, "triton_python_backend_stub")
        if stub is None:
            return "no stub found"
        os.kill(stub, signal.SIGKILL)
        return served_again(time.monotonic(), timeout_s=180)

    def served_again(t0: float, timeout_s: float = 120) -> str:
        while time.monotonic() - t0 < timeout_s:
            try:
                client.generate("Hello", {"max_tokens": 2})
                return f"served again after {time.monotonic() - t0:.1f} s"
            except InferenceError:
                time.sleep(0.25)
        return f"NOT served again within {timeout_s:.0f} s"

    admin = [
        ("POST", "/v2/systemsharedmemory/region/probe/register", {"key": "/probe", "offset": 0, "byte_size": 64}),
        ("POST", "/v2/logging", {"log_verbose_level": 3, "log_error": False}),
        ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}),
        ("POST", "/v2/repository/models/llm/unload", {}),
    ]
    return [
        Attack("baseline", lambda: time.sleep(3) or "nothing"),
        Attack("10 MB prompt", lambda: grpc("word " * 2_000_000, {"max_tokens": 16})),
        Attack(
            "largest allowed stop list", lambda: grpc("Hello", {"max_tokens": 200, "ignore_eos": True, "stop": longest})
        ),
        Attack("one 5 MB stop string", lambda: grpc("Hello", {"max_tokens": 16, "stop": ["x" * 5_000_000]})),
        Attack("top_p=1e-300", lambda: grpc("Hello", {"max_tokens": 16, "temperature": 1.0, "top_p": 1e-300})),
        Attack(
            "temperature 1e-300, huge top_k",
            lambda: grpc("Hello", {"max_tokens": 16, "temperature": 1e-300, "top_k": 2**62}),
        ),
        Attack(
            "ambiguous grammar, min_tokens",
            lambda: grpc("Hello", {"max_tokens": 64, "min_tokens": 64, "structured_outputs": {"grammar": AMBIGUOUS}}),
        ),  # fmt: skip
        Attack(
            "grammar that matches nothing",
            lambda: grpc("Hello", {"max_tokens": 8, "structured_outputs": {"grammar": 'root ::= root "a"'}}),
        ),  # fmt: skip
        Attack("two 210 KB schemas, then a tiny one", tiny_schema_during_big_compiles),
        Attack(
            "OpenAI: 100 MB prompt",
            lambda: post(api, "/v1/completions", {"model": "llm", "prompt": "word " * 20_000_000, "max_tokens": 4}),
        ),  # fmt: skip
        Attack(
            "OpenAI: 4M token ids",
            lambda: post(api, "/v1/completions", {"model": "llm", "prompt": [7] * 4_000_000, "max_tokens": 4}),
        ),  # fmt: skip
        Attack(
            "OpenAI: 600k chat messages",
            lambda: post(
                api,
                "/v1/chat/completions",
                {"model": "llm", "messages": [{"role": "user", "content": "hi"}] * 600_000, "max_tokens": 4},
            ),
        ),  # fmt: skip
        Attack(
            "OpenAI: chat_template_kwargs.messages",
            lambda: post(
                api,
                "/v1/chat/completions",
                {
                    "model": "llm",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "chat_template_kwargs": {"messages": []},
                },
            ),
        ),  # fmt: skip
        Attack(
            "Triton admin APIs, no secret",
            lambda: [http(m, f"{http_url}{path}", json.dumps(b).encode())[0] for m, path, b in admin],
        ),  # fmt: skip
        Attack("kill -9 the engine process", kill_engine_core, in_flight_ok=True),
        Attack("kill -9 the model's stub", kill_stub, in_flight_ok=True),
    ]


# ---- the run ---------------------------------------------------------------------------------------------


def run(ctx: dict[str, Any], config: EngineConfig, only: list[str] | None) -> dict[str, Any]:
    from inflight_client import InferenceError

    client, launcher = ctx["client"], ctx["launcher"]
    client.generate("warm up", {"max_tokens": 4})
    results: dict[str, Any] = {}
    start_mb = 0.0
    for attack in attacks(ctx, config):
        if only and attack.name != "baseline" and not any(o.lower() in attack.name.lower() for o in only):
            continue
        ttfts: list[float] = []
        failures: list[str] = []
        stop = threading.Event()

        def normal(ttfts=ttfts, failures=failures, stop=stop) -> None:
            while not stop.is_set():
                try:
                    done = client.generate("The quick brown fox", {"max_tokens": 8, "temperature": 0})
                    if done.ttft_s is not None:
                        ttfts.append(done.ttft_s)
                except InferenceError as e:
                    failures.append(e.message[:80])
                    time.sleep(0.1)

        before = rss_mb(descendants(launcher.pid))
        start_mb = start_mb if results else before
        watcher = threading.Thread(target=normal, daemon=True)
        watcher.start()
        started = time.monotonic()
        try:
            got = attack.fn()
        except Exception as e:  # the driver's own failure is a finding too
            got = f"driver error: {e!r}"[:200]
        elapsed = time.monotonic() - started
        time.sleep(1.0)  # normal requests after the attack too
        stop.set()
        watcher.join()
        time.sleep(1.0)
        after = rss_mb(descendants(launcher.pid))
        row = {
            "attacker_got": got if isinstance(got, str) else repr(got),
            "attack_s": round(elapsed, 2),
            "normal_ttft_max_s": round(max(ttfts), 3) if ttfts else None,
            "normal_ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "normal_requests": len(ttfts),
            "normal_failures": len(failures),
            "memory_mb_before": round(before),
            "memory_mb_after": round(after),
            "memory_vs_run_start": round(after / start_mb, 3),
        }
        ok_ttft = row["normal_ttft_max_s"] is not None and row["normal_ttft_max_s"] < TTFT_LIMIT_S
        ok_memory = after <= before * (1 + MEMORY_SLACK)
        row["met"] = bool((ok_ttft or attack.in_flight_ok) and ok_memory and (attack.in_flight_ok or not failures))
        results[attack.name] = row
        print(
            f"{'ok  ' if row['met'] else 'MISS'} {attack.name:<38} TTFT max {row['normal_ttft_max_s']} s "
            f"(p50 {row['normal_ttft_p50_s']}, {len(failures)} failed), memory {before:.0f} -> {after:.0f} MB "
            f"({row['memory_vs_run_start']:.2f}x the run's start), "
            f"{elapsed:.1f} s: {row['attacker_got'][:150]}",
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=None, help="attacks whose name contains one of these words")
    p.add_argument("--model", default="demo")
    p.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = p.parse_args(argv)
    from inflight_client import LLMClient

    from inflight.config import EngineConfig
    from inflight.launcher.server import free_port

    args.out.mkdir(parents=True, exist_ok=True)
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    cmd = [sys.executable, "-m", "inflight.launcher.cli", "serve", "--model", args.model,
           "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
           "--metrics-port", str(ports["metrics"]), "--openai-port", str(ports["openai"]),
           "--openai-host", "127.0.0.1"]  # fmt: skip
    for k, v in ENGINE_ARGS.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    log = open(args.out / "hostile_server.log", "w")  # noqa: SIM115 - lives as long as the server
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        api = f"http://127.0.0.1:{ports['openai']}"
        while http("GET", f"{api}/health", timeout=2)[0] != 200:
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up; see {args.out / 'hostile_server.log'}")
            time.sleep(0.5)
        ctx = {
            "client": LLMClient(f"localhost:{ports['grpc']}", timeout_s=120),
            "api": api,
            "http": f"http://localhost:{ports['http']}",
            "launcher": launcher,
        }
        results = run(ctx, EngineConfig(**ENGINE_ARGS), args.only)
    finally:
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
        log.close()
    (args.out / "hostile_input.json").write_text(json.dumps(results, indent=2))
    missed = [name for name, row in results.items() if not row["met"]]
    print(
        f"{len(results) - len(missed)} of {len(results)} cases within bounds"
        + (f"; missed: {missed}" if missed else "")
    )
    return results


if __name__ == "__main__":
    main()
