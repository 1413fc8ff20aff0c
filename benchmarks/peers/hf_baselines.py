"""The peers on the same checkpoint and trace: HF `generate` in static batches, and HF continuous batching.

Both get exact output lengths (EOS disabled) and count only the tokens each request asked for, so the
padding a static batch computes for its finished rows is cost, not throughput.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from benchmarks.common.metrics import RunResult
from benchmarks.common.trace import TraceRequest


def load_hf_model(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()


class _StepClock(LogitsProcessor):
    """Called once per decoding step, after the forward: its timestamps are the batch's token times."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def _generate_batch(model, batch: Sequence[TraceRequest], pad_id: int) -> list[float]:
    """Left-padded `generate` until the batch's longest request is done; returns each step's time."""
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - r.prompt_len :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    steps = max(r.output_len for r in batch)
    clock = _StepClock()
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=steps,
        min_new_tokens=steps,  # EOS can never end a row early: exact lengths, as for every other system
        do_sample=False,
        pad_token_id=pad_id,
        logits_processor=LogitsProcessorList([clock]),
    )
    return clock.times


def run_hf_static(
    model_dir: str | Path,
    trace: Sequence[TraceRequest],
    batch_size: int,
    progress: bool = True,
    pad_id: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> RunResult:
    """A static batcher: when idle, it takes every arrived request (up to `batch_size`) and runs them together.
    A request's latency ends at the step that produced its last useful token (as if streamed)."""
    model = load_hf_model(model_dir, device, dtype)
    _generate_batch(model, [TraceRequest("warmup", tuple(range(3, 35)), 4, 0.0)], pad_id)
    pending = sorted(trace, key=lambda r: r.arrival_s)
    ttft, latency, tokens = [], [], 0
    bar = tqdm(total=len(pending), desc="hf static", unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()
    end = t0
    while pending:
        now = time.perf_counter() - t0
        if pending[0].arrival_s > now:
            time.sleep(pending[0].arrival_s - now)
            continue
        n = next((i for i, r in enumerate(pending) if r.arrival_s > now), len(pending))
        batch, pending = pending[: min(n, batch_size)], pending[min(n, batch_size) :]
        times = _generate_batch(model, batch, pad_id)
        for r in batch:
            arrived = t0 + r.arrival_s
            ttft.append(times[0] - arrived)
            latency.append(times[r.output_len - 1] - arrived)
            tokens += r.output_len
        end = times[-1]
        bar.update(len(batch))
    bar.close()
    return RunResult(
        name="hf static",
        output_tokens=tokens,
        wall_s=end - t0,
        ttft_s=ttft,
        latency_s=latency,
        max_num_seqs=batch_size,
        config={"batch_size": batch_size, "padding": "left"},
    )


def run_hf_continuous(
    model_dir: str | Path,
    trace: Sequence[TraceRequest],
    max_num_seqs: int,
    max_batch_tokens: int = 2048,
    page_size: int = 256,
    progress: bool = True,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> RunResult:
    """transformers' continuous-batching manager with per-request `max_new_tokens`, fed at arrival times."""
    # Imported here: transformers releases before 5.2x lack it, and the static baseline must not need it.
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf_model(model_dir, device, dtype)
    max_len = max(r.prompt_len + r.output_len for r in trace)
    # Enough pages that HF never runs short of KV: its scheduler, not memory, decides the batch.
    num_blocks = max_num_seqs * (math.ceil(max_len / page_size) + 1)
    cb_config = ContinuousBatchingConfig(
        max_requests_per_batch=max_num_seqs,
        max_batch_tokens=max_batch_tokens,
        num_blocks=num_blocks,
        page_size=page_size,
        allow_block_sharing=False,  # random prompts share no prefix; don't pay for looking
    )
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(r.output_len for r in trace))
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.start()
    try:
        manager.add_request(list(range(3, 35)), request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        while (res := manager.get_result(timeout=60)) is not None and not res.is_finished():
            pass
        return _feed_and_collect(manager, trace, progress)
    finally:
        manager.stop(block=True)


def _feed_and_collect(manager, trace: Sequence[TraceRequest], progress: bool) -> RunResult:
    pending = sorted(trace, key=lambda r: r.arrival_s)
    arrival: dict[str, float] = {}
    results = {}
    bar = tqdm(total=len(pending), desc="hf continuous", unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()
    nxt = 0
    while len(results) < len(pending):
        now = time.perf_counter()
        while nxt < len(pending) and t0 + pending[nxt].arrival_s <= now:
            r = pending[nxt]
            arrival[r.request_id] = t0 + r.arrival_s
            manager.add_request(
                list(r.prompt_token_ids),
                request_id=r.request_id,
                max_new_tokens=r.output_len,
                record_timestamps=True,
                eos_token_id=-1,
            )
            nxt += 1
        wait = (t0 + pending[nxt].arrival_s - time.perf_counter()) if nxt < len(pending) else 1.0
        res = manager.get_result(timeout=max(0.001, min(wait, 1.0)))
        if res is None:
            if not manager.is_running():
                raise RuntimeError("HF continuous batching: the generation thread died (see its log above)")
            continue
        if res.is_finished():
            if res.error is not None:
                raise RuntimeError(f"HF continuous batching failed request {res.request_id}: {res.error}")
            results[res.request_id] = res
            bar.update(1)
    bar.close()
    ends = {rid: res.timestamps[-1] for rid, res in results.items()}
    cfg = manager.continuous_batching_config
    return RunResult(
        name="hf continuous",
        output_tokens=sum(len(res.generated_tokens) for res in results.values()),
        wall_s=max(ends.values()) - t0,
        ttft_s=[res.timestamps[0] - arrival[rid] for rid, res in results.items()],
        latency_s=[ends[rid] - arrival[rid] for rid in results],
        max_num_seqs=cfg.max_requests_per_batch,
        config={k: getattr(cfg, k) for k in ("page_size", "num_blocks", "max_batch_tokens")},
    )
