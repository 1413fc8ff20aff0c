"""Hostile input against a running server: does one bad request hurt the others?

    python -m loadtest.hostile_input            # launches a server (demo model) on free ports

A normal client keeps sending short streaming requests and records each one's TTFT. Meanwhile an attacker
sends, one kind at a time: a 10 MB prompt, the largest stop list the limits allow (max_stop_strings
strings of max_stop_str_len characters), a single 5 MB stop string, and 10,000 stop strings of 1 kB. Reported
per phase: the normal requests' TTFT (max and p50), what the attacker got back, and the model process's
resident memory (VmRSS now, VmHWM peak). Target: TTFT < 1 s throughout, memory bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

from inflight.config import EngineConfig


def stub_memory_mb(server_pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB of the Python-backend stub(s) in the server's process group."""
    rss = hwm = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != server_pid:
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"triton_python_backend_stub" not in cmd:
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except (OSError, ProcessLookupError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss += int(fields["VmRSS"].split()[0]) / 1024
        hwm += int(fields["VmHWM"].split()[0]) / 1024
    return rss, hwm


def attacks(config: EngineConfig) -> dict[str, tuple[str, dict]]:
    longest = [f"{i:05d}" + "~" * (config.max_stop_str_len - 5) for i in range(config.max_stop_strings)]
    return {
        "10 MB prompt": ("word " * 2_000_000, {"max_tokens": 16}),
        "largest allowed stop list": ("Hello world", {"max_tokens": 200, "ignore_eos": True, "stop": longest}),
        "one 5 MB stop string": ("Hello world", {"max_tokens": 16, "stop": ["x" * 5_000_000]}),
        "10,000 stop strings of 1 kB": ("Hello world", {"max_tokens": 16, "stop": ["y" * 1000] * 10_000}),
    }


def run(url: str, server_pid: int | None, config: EngineConfig, repeats: int) -> dict:
    from inflight_client import InferenceError, LLMClient

    client = LLMClient(url, timeout_s=120)
    client.generate("warm up", {"max_tokens": 4})
    results = {}
    for name, (prompt, params) in [("baseline", (None, None)), *attacks(config).items()]:
        ttfts: list[float] = []
        stop = threading.Event()

        def normal(ttfts: list[float] = ttfts, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                done = client.generate("The quick brown fox", {"max_tokens": 8, "temperature": 0})
                if done.ttft_s is not None:
                    ttfts.append(done.ttft_s)

        watcher = threading.Thread(target=normal, daemon=True)
        watcher.start()
        outcome = []
        started = time.monotonic()
        for _ in range(repeats if prompt is not None else 0):
            try:
                done = client.generate(prompt, params)
                outcome.append(f"ok ({done.num_output_tokens} tokens)")
            except InferenceError as e:
                outcome.append(e.message[:160])
        if prompt is None:
            time.sleep(3)
        time.sleep(0.5)  # normal requests after the attack too
        stop.set()
        watcher.join()
        rss, hwm = stub_memory_mb(server_pid) if server_pid else (None, None)
        results[name] = {
            "normal_ttft_max_s": max(ttfts) if ttfts else None,
            "normal_ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "normal_requests": len(ttfts),
            "attack_s": time.monotonic() - started,
            "attacker_got": sorted(set(outcome)),
            "stub_rss_mb": rss,
            "stub_peak_rss_mb": hwm,
        }
        print(
            f"{name:<30} TTFT max {results[name]['normal_ttft_max_s']:.3f} s, RSS {rss} MB (peak {hwm}): "
            f"{results[name]['attacker_got']}",
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="attack requests per kind")
    p.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = p.parse_args(argv)
    from inflight.demo_model import cached_demo_model
    from inflight.launcher.server import TritonServer

    engine_args = {"max_num_seqs": 16, "max_model_len": 2048, "num_kv_blocks": 512}
    config = EngineConfig(**engine_args)
    args.out.mkdir(parents=True, exist_ok=True)
    params = dict(engine_args, model=str(cached_demo_model()))
    log = args.out / "hostile_tritonserver.log"
    with TritonServer(parameters=params, http_port=0, grpc_port=0, metrics_port=0, log=log) as srv:
        srv.wait_ready(timeout_s=300)
        results = run(srv.grpc_url, srv.process.pid, config, args.repeats)
    (args.out / "hostile_input.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
