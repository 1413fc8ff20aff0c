"""LLMEngine: requests in, per-step outputs of token ids out. Owned by one thread; nothing else touches its state.

step() = schedule -> forward -> sample -> the scheduler's update_from_output -> outputs + stats. Text (detokenizing,
stop strings) is the output processor's (inflight.text.output_processor): the front runs it on the engine core's
outputs, and the offline `LLM` on this engine's.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inflight.config import ConfigError, EngineConfig
from inflight.engine.isolation import run_isolating
from inflight.engine.kv_cache import BlockManager
from inflight.engine.kv_events import AllBlocksCleared, ZmqEventPublisher
from inflight.engine.lora import LoRAManager
from inflight.engine.scheduler import Scheduler, SchedulerOutput, request_output
from inflight.engine.sequence import FinishReason, Sequence
from inflight.engine.spec_decode.decoder import SpecDecodeCounters, SpecDecoder
from inflight.engine.stats import EngineSnapshot, StepStats
from inflight.engine.structured_output import StructuredOutputManager
from inflight.engine.validation import (
    check_fits,
    check_logit_bias_ids,
    check_params,
    check_prompt_token_ids,
    tokenize_prompt,
)
from inflight.errors import InvalidRequestError
from inflight.executor.model_runner import ModelRunner
from inflight.executor.sampler import Sampler
from inflight.executor.tensor_parallel import TensorParallelWorkers
from inflight.limits import default_max_prompt_bytes, resolve_max_model_len
from inflight.lora_request import LoRARequest
from inflight.model_source import gguf_metadata, resolve_model
from inflight.models.config import ModelConfig, config_errors
from inflight.models.loader import check_tensor_parallel, load_model, load_tokenizer, weight_bytes
from inflight.models.lora import AdapterError
from inflight.models.parallel import SINGLE
from inflight.ops import dtype_probe
from inflight.outputs import RequestOutput, TokenLogprob
from inflight.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)


def bf16_probe(cfg: ModelConfig) -> Callable[[], float | None]:
    """How much faster bf16 runs the model's widest GEMM (its MLP's gate and up projections) here."""
    return lambda: dtype_probe.bf16_speedup(cfg.hidden_size, 2 * cfg.intermediate_size)


class LLMEngine:
    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: the engine core gets token ids and needs it only to compile a grammar. The model
        is loaded by then, so what was parsed from a GGUF file for it (the vocabulary's arrays) is not kept."""
        tokenizer = load_tokenizer(self.model_dir)
        gguf_metadata.cache_clear()
        return tokenizer

    def __init__(self, model_dir: str | Path | None = None, config: EngineConfig | None = None) -> None:
        """`model_dir`: an HF checkpoint directory, a GGUF file (or a directory holding one), "demo", or None
        for the default model (SmolLM2-135M-Instruct, inflight.model_source)."""
        self.config = config = config or EngineConfig()
        self.device = torch.device(config.device)
        with config_errors():
            model_dir = resolve_model(model_dir)
        ckpt = ModelConfig.load(model_dir)
        self.dtype, why = config.resolve_dtype(ckpt.torch_dtype, bf16_probe(ckpt))
        logger.info("dtype %s on %s (%s)", str(self.dtype).removeprefix("torch."), self.device, why)
        # Tensor parallel: ranks 1..N-1 load their shards while this process, rank 0, loads its own
        self.workers: TensorParallelWorkers | None = None
        tp = SINGLE
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(ckpt, config.tensor_parallel_size)
            self.workers = TensorParallelWorkers(model_dir, config, self.dtype)
            tp = self.workers.tp
        self.model, self.model_config = load_model(model_dir, self.dtype, self.device, config.weight_format, tp)
        if self.workers is not None:
            self.workers.join()
        self.model_weight_bytes = weight_bytes(self.model)
        logger.info("model weights: %.1f MiB", self.model_weight_bytes / 2**20)
        self.model_dir = model_dir
        mc = self.model_config
        # The rules a client of the served model applies to the same config (inflight.limits).
        self.max_model_len = resolve_max_model_len(config.max_model_len, mc.max_position_embeddings)
        self.max_prompt_bytes = config.max_prompt_bytes or default_max_prompt_bytes(self.max_model_len)
        self.eos_token_ids = set(mc.eos_token_ids)
        # Before the runner: CPU layer stacks and CUDA graphs take the adapter slots as they find them.
        self.lora = LoRAManager(self.model, mc, config) if config.enable_lora else None
        for name, path in (config.lora_modules or {}).items():
            try:
                self.lora.add(name, path)
            except AdapterError as e:
                raise ConfigError(str(e)) from None

        self.num_kv_blocks = self._num_kv_blocks()
        block_size = config.block_size
        if config.kv_reservation == "max_length" and self.num_kv_blocks * block_size < self.max_model_len:
            raise ConfigError(
                f"kv_reservation='max_length' needs max_model_len={self.max_model_len} tokens per sequence but the "
                f"KV cache holds {self.num_kv_blocks * block_size}; lower max_model_len or raise the KV budget"
            )
        events = config.kv_events_config
        # Blocks behind the window are given back only where every layer is local (a global layer reads them all)
        windows = mc.layer_sliding_windows
        all_local = bool(windows) and all(w is not None for w in windows)
        self.block_manager = BlockManager(
            self.num_kv_blocks,
            block_size,
            config.enable_prefix_caching,
            record_events=events.enabled,
            sliding_window=min(windows) if all_local else None,
        )
        self.kv_events = ZmqEventPublisher(events) if events.enabled else None
        if self.kv_events is not None:  # a router forgets what an earlier engine on this endpoint held
            self.kv_events.publish([AllBlocksCleared()])
        self.structured_outputs = StructuredOutputManager(
            lambda: self.tokenizer, mc.vocab_size, sorted(self.eos_token_ids), config
        )
        self.scheduler = Scheduler(
            config, self.block_manager, self.max_model_len, self.eos_token_ids, self.structured_outputs
        )
        runner_args = dict(
            num_blocks=self.num_kv_blocks,
            block_size=block_size,
            max_model_len=self.max_model_len,
            attention_backend=config.resolved_attention_backend(),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enforce_eager=config.enforce_eager,
        )
        workers = self.workers
        self.runner = ModelRunner(
            self.model,
            dtype=self.dtype,
            device=self.device,
            workers=workers,
            num_threads=workers.num_threads if workers is not None else None,
            **runner_args,
        )
        if workers is not None:
            workers.start_runners(runner_args)  # the workers' runners, as this one
        self.sampler = Sampler(mc.vocab_size, sorted(self.eos_token_ids))
        self._rng = random.Random(config.seed)
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.last_step_stats: StepStats | None = None
        self.num_steps = 0  # forward passes run
        self.num_prompt_tokens = 0  # prompt tokens of the requests added
        spec = config.speculative_config
        self.spec_decoder = SpecDecoder(spec, self.max_model_len) if spec is not None else None

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = ModelRunner.kv_bytes_per_block(
            self.model_config, cfg.block_size, self.dtype, cfg.tensor_parallel_size
        )
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        else:
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.gpu_memory_utilization) - (1 << 30)  # 1 GiB headroom for activations
        blocks = budget // per_block
        if blocks < 1:
            raise ConfigError(f"KV budget of {budget} bytes holds no block of {per_block} bytes")
        # More blocks than max_num_seqs full-length sequences could ever use is wasted memory.
        cap = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        return int(min(blocks, cap))

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """`lora_request`: run it with that adapter (by name; one with a path not yet known is registered)."""
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise InvalidRequestError(f"request_id={request_id!r} is already in flight")
        check_params(self.config, params)
        check_logit_bias_ids(params, self.model_config.vocab_size)
        adapter = self._adapter_for(lora_request)
        if isinstance(prompt, str):
            token_ids = self.tokenize(prompt)
        else:
            token_ids = check_prompt_token_ids(prompt, self.model_config.vocab_size)
        check_fits(len(token_ids), params.max_tokens, self.max_model_len, self.num_kv_blocks * self.config.block_size)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            seed=seed,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
        )
        if adapter is not None:
            seq.lora_name, seq.lora_id, seq.lora_key = adapter.name, adapter.lora_id, adapter.cache_key
        self._seqs[request_id] = seq
        try:
            if params.structured_outputs is not None:
                self.structured_outputs.add(request_id, params.structured_outputs)  # admitted once compiled
            self.scheduler.add(seq)
        except BaseException:  # half-registered would be a request nobody finishes
            del self._seqs[request_id]
            self.structured_outputs.remove(request_id)
            raise
        self.num_prompt_tokens += len(token_ids)

    def _adapter_for(self, lora_request: LoRARequest | None):
        if lora_request is None:
            return None
        if self.lora is None:
            raise InvalidRequestError(
                f"lora_name={lora_request.lora_name!r}: LoRA is not enabled on this model (enable_lora)", "lora_name"
            )
        if lora_request.lora_path is not None and lora_request.lora_name not in self.lora.adapters:
            self.add_lora(lora_request)
        return self.lora.check_name(lora_request.lora_name)

    # ---- adapters ----------------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Register an adapter by name and directory (InvalidRequestError names it and why it is refused)."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is not enabled on this model (enable_lora)", "lora_name")
        if lora_request.lora_path is None:
            raise InvalidRequestError(f"LoRA adapter {lora_request.lora_name!r}: lora_path is required", "lora_path")
        try:
            self.lora.add(lora_request.lora_name, lora_request.lora_path, lora_request.lora_int_id)
        except AdapterError as e:
            raise InvalidRequestError(str(e), "lora_path") from None

    def remove_lora(self, name: str) -> None:
        """Forget an adapter; refused while an unfinished request runs with it (it would break)."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is not enabled on this model (enable_lora)", "lora_name")
        self.lora.check_name(name)
        users = sum(1 for s in self._seqs.values() if s.lora_name == name and not s.is_finished)
        if users:
            raise InvalidRequestError(
                f"LoRA adapter {name!r} is in use by {users} unfinished request(s): unload it once they finish",
                "lora_name",
                kind="unavailable",
            )
        self.lora.remove(name)

    def list_loras(self) -> list[str]:
        return sorted(self.lora.adapters) if self.lora is not None else []

    def tokenize(self, prompt: str) -> list[int]:
        """Prompt text -> token ids, bounded by max_prompt_bytes. Thread-safe (it reads only the
        tokenizer and the config)."""
        return tokenize_prompt(self.tokenizer, prompt, self.max_prompt_bytes, self.max_model_len)

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.finish(seq, FinishReason.ABORT)  # blocks go back now, not at the next step
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def close(self) -> None:
        """Release the threads the engine started (the grammar compile pool), the KV events socket and the
        tensor-parallel worker processes; call once it no longer steps."""
        self.structured_outputs.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.workers is not None:
            self.workers.close()

    def on_rank_failure(self, callback: Callable[[str], None]) -> None:
        """Tensor parallel: `callback(reason)` runs, on a watching thread, as soon as a worker rank dies (the engine
        cannot step again: its next step raises EngineDeadError). Nothing to watch with one rank."""
        if self.workers is not None:
            self.workers.on_failure = callback

    def warm_up(self) -> int:
        """Meet every step size once before serving (see `ModelRunner.warm_up`); the output layer sees a step's
        sequences, with their draft tokens where speculation is on. Returns the number of calls."""
        spec = self.config.speculative_config
        head_rows = self.config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
        return self.runner.warm_up(head_rows)

    @property
    def spec_decode_counters(self) -> dict[str, int | tuple[int, ...]]:
        """vLLM's spec_decode counters (all 0 when speculation is off), per position as a tuple."""
        counters = self.spec_decoder.counters if self.spec_decoder is not None else SpecDecodeCounters()
        return counters.as_dict()

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            steps=self.num_steps,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.scheduler.num_generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_kv_blocks_free=self.block_manager.num_free_blocks,
            num_kv_blocks_cached=self.block_manager.num_cached_blocks,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            max_num_seqs=self.config.max_num_seqs,
            last_step=self.last_step_stats,
            grammar_cache_bytes=self.structured_outputs.pool.cache_bytes,
            **self.spec_decode_counters,
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}

        def adapters(seqs: list[Sequence]) -> tuple[str, ...]:
            return tuple(sorted({s.lora_name for s in seqs if s.lora_name is not None}))

        return {
            "running_lora_adapters": adapters(self.scheduler.running),
            "waiting_lora_adapters": adapters(self.scheduler.waiting),
            "max_lora": self.config.max_loras,
        }

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ---- the loop -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = [request_output(seq, []) for seq in self._aborted]
        self._aborted.clear()
        for request_id, error in self.structured_outputs.take_failed():
            seq = self._seqs[request_id]
            if seq.is_finished:  # aborted this step: its abort output is made already
                continue
            self.scheduler.finish(seq, FinishReason.ABORT)
            outputs.append(request_output(seq, [], error=error, error_field="structured_outputs"))
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.seqs:
            if not outputs and self.structured_outputs.has_pending:
                self.structured_outputs.wait_for_compile(0.01)  # idle but for compiles: do not spin
            return self._release_finished(outputs)
        num_running = len(self.scheduler.running)
        if self.lora is not None:
            sched.lora_slots = self.lora.slots_for([s.lora_name for s in sched.seqs])
        parts, failed = run_isolating(sched, self._forward_and_sample)
        if len(failed) > 1 and not parts:  # every sequence failed: the engine's failure, not theirs
            raise failed[0][1]
        for part, (result, sampling, sampled) in parts:
            outputs += self._update_from_output(part, result, sampling, sampled)
        for seq, error in failed:
            self.scheduler.finish(seq, FinishReason.ABORT)
            message = f"the engine failed while running this request: {error!r}"
            outputs.append(request_output(seq, [], error=message, error_kind="internal"))
        forward_time = sum(result.forward_time_s for _, (result, _, _) in parts)
        self._record_stats(sched, num_running, t0, forward_time)
        if self.kv_events is not None:
            events = self.block_manager.take_events()
            if events:
                self.kv_events.publish(events)
        return self._release_finished(outputs)

    def _forward_and_sample(self, sched: SchedulerOutput):
        """One forward over `sched` and the tokens it samples; no engine state changes until it returns."""
        result = self.runner.execute(sched)
        sampling = [sched.seqs[i] for i in result.sample_rows]
        sampled = None
        if sampling:
            rows = sampling  # one logits row per sequence, d+1 for one verifying d drafts
            if result.num_spec_tokens is not None:
                rows = [s for s, d in zip(sampling, result.num_spec_tokens.tolist()) for _ in range(d + 1)]
            bitmask = self.structured_outputs.grammar_bitmask([s.request_id for s in rows])
            with torch.inference_mode():  # the logits are the forward's inference tensors, masked in place
                sampled = self.sampler(result.logits, rows, bitmask, result.sampling_metadata, in_place=True)
        return result, sampling, sampled

    def _update_from_output(self, part: SchedulerOutput, result, seqs: list[Sequence], sampled) -> list[RequestOutput]:
        """The sampled tokens per sequence (a verifying one's: the drafts it accepted and the token after them,
        spec_decode.verify) and their logprobs, through the scheduler's update. Sequences with logprobs do not
        speculate: their one row is their first."""
        if not seqs:
            return self.scheduler.update_from_output(part, [], [], None)
        tokens = sampled.token_ids.tolist()
        if result.num_spec_tokens is None:
            return self.scheduler.update_from_output(part, seqs, [[t] for t in tokens], self._logprobs(seqs, sampled))
        drafts = [part.spec_token_ids[i] for i in result.sample_rows.tolist()]
        accepted = self.spec_decoder.verify(seqs, drafts, tokens)
        row_logprobs = self._logprobs([s for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)], sampled)
        logprobs = None
        if row_logprobs is not None:
            logprobs = [row_logprobs[g] for g in itertools.accumulate((len(d) + 1 for d in drafts[:-1]), initial=0)]
        return self.scheduler.update_from_output(part, seqs, accepted, logprobs)

    def _logprobs(self, seqs: list[Sequence], sampled) -> list[TokenLogprob | None] | None:
        if sampled.logprobs is None:
            return None
        lps = sampled.logprobs.tolist()
        top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        out: list[TokenLogprob | None] = []
        for i, seq in enumerate(seqs):
            n = seq.sampling_params.logprobs
            if n is None:
                out.append(None)
                continue
            top = dict(zip(top_ids[i][:n], top_lps[i][:n])) if top_ids is not None and n else {}
            out.append(TokenLogprob(token_id=int(sampled.token_ids[i]), logprob=lps[i], top=top))
        return out

    def _release_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A finished request leaves the engine (its blocks went back in scheduler.finish)."""
        for out in outputs:
            if out.finished:
                seq = self._seqs.pop(out.request_id)
                if self.spec_decoder is not None:
                    self.spec_decoder.finish(seq)
                self.structured_outputs.remove(out.request_id)
        return outputs

    def _record_stats(self, sched: SchedulerOutput, num_running: int, t0: float, forward_time: float) -> None:
        arrivals = [s.arrival_time for s in sched.seqs]
        self.num_steps += 1
        self.last_step_stats = StepStats(
            time=time.monotonic(),
            num_running=num_running,
            num_waiting=len(self.scheduler.waiting),
            num_scheduled_seqs=len(sched.seqs),
            num_scheduled_tokens=sched.total_tokens,
            num_prefill_tokens=sched.total_tokens - sched.num_decode_tokens,
            num_decode_seqs=sched.num_decode_seqs,
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_kv_blocks_total=self.block_manager.num_blocks,
            num_kv_blocks_cached=self.block_manager.num_cached_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            arrival_spread_s=max(arrivals) - min(arrivals),
            step_time_s=time.perf_counter() - t0,
            forward_time_s=forward_time,
            max_num_seqs=self.config.max_num_seqs,
        )
        if self.spec_decoder is not None and sched.total_tokens == sched.num_decode_tokens:
            self.spec_decoder.observe_step(sched.total_tokens, self.last_step_stats.step_time_s)
