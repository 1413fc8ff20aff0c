"""LLMEngine: requests in, per-step deltas out. Owned by one thread; nothing else touches its state.

step() = schedule → forward → sample → append → finish/free → detokenize → outputs + stats. Detokenization and
stop strings are the output processor's (inflight.text.output_processor): an engine built with
`detokenize=False` (the engine core process's) outputs token ids only and leaves them to the front.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from inflight.config import ConfigError, EngineConfig
from inflight.engine.kv_cache import BlockManager
from inflight.engine.kv_events import AllBlocksCleared, ZmqEventPublisher
from inflight.engine.scheduler import Scheduler, SchedulerOutput
from inflight.engine.sequence import FinishReason, Sequence, SequenceStatus
from inflight.engine.spec_decode.decoder import SpecDecodeCounters, SpecDecoder
from inflight.engine.spec_decode.verify import append_in_rounds
from inflight.engine.stats import EngineSnapshot, StepStats
from inflight.engine.structured_output import StructuredOutputManager, check_structured_outputs
from inflight.executor.model_runner import ModelRunner
from inflight.executor.sampler import Sampler
from inflight.model_source import resolve_model
from inflight.models.config import ModelConfig, config_errors
from inflight.models.loader import load_model, load_tokenizer, weight_bytes
from inflight.ops import dtype_probe
from inflight.outputs import RequestOutput, TokenLogprob
from inflight.sampling_params import InvalidRequestError, SamplingParams
from inflight.text.output_processor import RequestState, process_outputs

logger = logging.getLogger(__name__)


def bf16_probe(cfg: ModelConfig) -> Callable[[], float | None]:
    """How much faster bf16 runs the model's widest GEMM (its MLP's gate and up projections) here."""
    return lambda: dtype_probe.bf16_speedup(cfg.hidden_size, 2 * cfg.intermediate_size)


class LLMEngine:
    def __init__(
        self, model_dir: str | Path | None = None, config: EngineConfig | None = None, detokenize: bool = True
    ) -> None:
        """`model_dir`: an HF checkpoint directory, a GGUF file (or a directory holding one), "demo", or None
        for the default model (SmolLM2-135M-Instruct, inflight.model_source). `detokenize=False`: outputs carry
        token ids only and stop strings are not looked for (whoever reads the outputs runs the output
        processor, and aborts a request that a stop string ended)."""
        self.config = config = config or EngineConfig()
        self.device = torch.device(config.device)
        with config_errors():
            model_dir = resolve_model(model_dir)
        ckpt = ModelConfig.load(model_dir)
        self.dtype, why = config.resolve_dtype(ckpt.torch_dtype, bf16_probe(ckpt))
        logger.info("dtype %s on %s (%s)", str(self.dtype).removeprefix("torch."), self.device, why)
        self.model, self.model_config = load_model(model_dir, self.dtype, self.device, config.weight_format)
        self.model_weight_bytes = weight_bytes(self.model)
        logger.info("model weights: %.1f MiB", self.model_weight_bytes / 2**20)
        self.tokenizer = load_tokenizer(model_dir)
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        # A prompt's text is bounded before it is tokenized: tokenizing 10 MB takes seconds.
        self.max_prompt_bytes = config.max_prompt_bytes or 16 * self.max_model_len
        self.eos_token_ids = set(mc.eos_token_ids)

        self.num_kv_blocks = self._num_kv_blocks()
        block_size = config.block_size
        if config.kv_reservation == "max_length" and self.num_kv_blocks * block_size < self.max_model_len:
            raise ConfigError(
                f"kv_reservation='max_length' needs max_model_len={self.max_model_len} tokens per sequence but the "
                f"KV cache holds {self.num_kv_blocks * block_size}; lower max_model_len or raise the KV budget"
            )
        events = config.kv_events_config
        self.block_manager = BlockManager(
            self.num_kv_blocks, block_size, config.enable_prefix_caching, record_events=events.enabled
        )
        self.kv_events = ZmqEventPublisher(events) if events.enabled else None
        if self.kv_events is not None:  # a router forgets what an earlier engine on this endpoint held
            self.kv_events.publish([AllBlocksCleared()])
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.runner = ModelRunner(
            self.model,
            self.num_kv_blocks,
            block_size,
            self.max_model_len,
            self.dtype,
            self.device,
            config.resolved_attention_backend(),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enforce_eager=config.enforce_eager,
        )
        self.sampler = Sampler(mc.vocab_size, sorted(self.eos_token_ids))
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, mc.vocab_size, sorted(self.eos_token_ids), config=config
        )
        self._rng = random.Random(config.seed)
        self._seqs: dict[str, Sequence] = {}
        # Per request, the output processor's state; None: the outputs' reader detokenizes (the front).
        self._request_states: dict[str, RequestState] | None = {} if detokenize else None
        self._aborted: list[Sequence] = []
        self.last_step_stats: StepStats | None = None
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "steps": 0}
        spec = config.speculative_config
        self.spec_decoder = SpecDecoder(spec, self.max_model_len) if spec is not None else None

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, cfg.block_size, self.dtype)
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
    ) -> None:
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise InvalidRequestError(f"request_id={request_id!r} is already in flight")
        self.check_params(params)
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else self._check_token_ids(prompt)
        self._check_fits(len(token_ids), params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            seed=seed,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
        )
        self._seqs[request_id] = seq
        if self._request_states is not None:
            self._request_states[request_id] = RequestState(self.tokenizer, token_ids, params)
        try:
            if params.structured_outputs is not None:
                self.structured_outputs.add(seq)  # compiles in the background; admitted once ready
            self.scheduler.add(seq)
        except BaseException:  # half-registered would be a request nobody finishes
            del self._seqs[request_id]
            if self._request_states is not None:
                del self._request_states[request_id]
            seq.status = SequenceStatus.FINISHED  # a pending grammar compile then forgets it
            raise
        self.counters["prompt_tokens"] += len(token_ids)

    def tokenize(self, prompt: str) -> list[int]:
        """Prompt text -> token ids, bounded by max_prompt_bytes. Thread-safe (it reads only the
        tokenizer and the config)."""
        return tokenize_prompt(self.tokenizer, prompt, self.max_prompt_bytes, self.max_model_len)

    def check_params(self, params: SamplingParams) -> None:
        """The engine's bounds on one request's parameters. Thread-safe."""
        check_params(self.config, params)

    def _check_token_ids(self, prompt: list[int]) -> list[int]:
        if not prompt:
            raise InvalidRequestError("prompt_token_ids is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        return list(prompt)

    def _check_fits(self, num_prompt: int, params: SamplingParams) -> None:
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt} tokens; it must be shorter than max_model_len={self.max_model_len}"
            )
        total = num_prompt + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} is too large: prompt ({num_prompt} tokens) + max_tokens must be "
                f"<= max_model_len={self.max_model_len}, so max_tokens <= {self.max_model_len - num_prompt}"
            )
        capacity = self.num_kv_blocks * self.config.block_size
        if total > capacity:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens={params.max_tokens} exceeds the KV cache capacity of "
                f"{capacity} tokens"
            )

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.finish(seq, FinishReason.ABORT)  # blocks go back now, not at the next step
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def close(self) -> None:
        """Release the threads the engine started (the grammar compile pool) and the KV events socket; call
        once it no longer steps."""
        self.structured_outputs.close()
        if self.kv_events is not None:
            self.kv_events.close()

    @property
    def spec_decode_counters(self) -> dict[str, int | tuple[int, ...]]:
        """vLLM's spec_decode counters (all 0 when speculation is off), per position as a tuple."""
        counters = self.spec_decoder.counters if self.spec_decoder is not None else SpecDecodeCounters()
        return counters.as_dict()

    def snapshot(self) -> EngineSnapshot:
        c = self.counters
        return EngineSnapshot(
            steps=c["steps"],
            prompt_tokens=c["prompt_tokens"],
            generation_tokens=c["generation_tokens"],
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
            **self.spec_decode_counters,
        )

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ---- the loop -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = [self._finish_output(seq, []) for seq in self._aborted]
        self._aborted.clear()
        for seq, error in self.structured_outputs.take_failed():
            self.scheduler.finish(seq, FinishReason.ABORT)
            outputs.append(self._finish_output(seq, [], error=error))
        outputs = self._process_text(outputs)
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self.counters["preemptions"] = self.scheduler.num_preemptions
        if not sched.seqs:
            if not outputs and self.structured_outputs.has_pending:
                self.structured_outputs.wait_for_compile(0.01)  # idle but for compiles: do not spin
            return outputs
        num_running = len(self.scheduler.running)
        drafts = sched.spec_token_ids or [()] * len(sched.seqs)
        decode = [
            n
            for s, n, d in zip(sched.seqs, sched.num_scheduled_tokens, drafts)
            if n == 1 + len(d) and s.num_computed_tokens == s.num_tokens - 1
        ]
        num_decode = (len(decode), sum(decode))  # sequences, tokens (a verifying one's drafts too)
        parts, failed = self._run_isolating(sched)
        if len(failed) > 1 and not parts:  # every sequence failed: the engine's failure, not theirs
            raise failed[0][1]
        for part, _, _, _ in parts:
            drafted = part.spec_token_ids is not None
            for i, (seq, n) in enumerate(zip(part.seqs, part.num_scheduled_tokens)):
                # drafts count once accepted (_process_verified)
                seq.num_computed_tokens += n - len(part.spec_token_ids[i]) if drafted else n
                self.block_manager.cache_full_blocks(seq)
        for part, result, sampling, sampled in parts:
            if result.num_spec_tokens is None:
                outputs += self._process_samples(sampling, sampled)
            else:
                outputs += self._process_verified(part, result, sampling, sampled)
        failures = []
        for seq, error in failed:
            self.scheduler.finish(seq, FinishReason.ABORT)
            message = f"the engine failed while running this request: {error!r}"
            failures.append(self._finish_output(seq, [], error=message, error_kind="internal"))
        outputs += self._process_text(failures)
        forward_time = sum(result.forward_time_s for _, result, _, _ in parts)
        self._record_stats(sched, num_running, num_decode, t0, forward_time)
        if self.kv_events is not None:
            events = self.block_manager.take_events()
            if events:
                self.kv_events.publish(events)
        return outputs

    def _forward_and_sample(self, sched: SchedulerOutput):
        """One forward over `sched` and the tokens it samples; no engine state changes until it returns."""
        result = self.runner.execute(sched)
        sampling = [sched.seqs[i] for i in result.sample_rows]
        sampled = None
        if sampling:
            rows = sampling  # one logits row per sequence, d+1 for one verifying d drafts
            if result.num_spec_tokens is not None:
                rows = [s for s, d in zip(sampling, result.num_spec_tokens.tolist()) for _ in range(d + 1)]
            bitmask = self.structured_outputs.grammar_bitmask(rows)
            with torch.inference_mode():  # the logits are the forward's inference tensors, masked in place
                sampled = self.sampler(result.logits, rows, bitmask, result.sampling_metadata, in_place=True)
        return result, sampling, sampled

    def _run_isolating(
        self, sched: SchedulerOutput, top: bool = True
    ) -> tuple[list[tuple], list[tuple[Sequence, Exception]]]:
        """Runs the step; if it fails, runs halves of it until the sequences that fail alone are found, so
        that one request's failure is its own. Rows do not depend on their neighbours, so the others'
        tokens are the ones the whole step would have given. If both halves of the whole step fail too,
        the failure is the engine's, not a request's: it is raised at once (three forwards, not 2N - 1)."""
        try:
            return [(sched, *self._forward_and_sample(sched))], []
        except Exception as error:
            if len(sched.seqs) == 1:
                return [], [(sched.seqs[0], error)]
            if top:
                logger.exception("a step of %d sequences failed; finding the one(s) it failed on", len(sched.seqs))
            first = error
        mid = len(sched.seqs) // 2
        halves = [sched.part(0, mid), sched.part(mid, len(sched.seqs))]
        outcomes = [self._try(half) if top else None for half in halves]
        if top and outcomes[0] is None and outcomes[1] is None:
            raise first
        parts, failed = [], []
        for half, outcome in zip(halves, outcomes):
            if outcome is not None:
                parts.append(outcome)
                continue
            p, f = self._run_isolating(half, top=False)
            parts += p
            failed += f
        return parts, failed

    def _try(self, sched: SchedulerOutput) -> tuple | None:
        try:
            return (sched, *self._forward_and_sample(sched))
        except Exception:
            return None

    def _process_verified(self, part: SchedulerOutput, result, seqs: list[Sequence], sampled) -> list[RequestOutput]:
        """Tokens of a step that verified drafts: each sequence's accepted drafts and the token after them, through
        the one-token path in rounds (spec_decode.verify). Sequences with logprobs do not speculate: their one
        row is their first."""
        drafts = [part.spec_token_ids[i] for i in result.sample_rows.tolist()]
        accepted = self.spec_decoder.verify(seqs, drafts, sampled.token_ids.tolist())
        row_logprobs = self._logprobs([s for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)], sampled)
        logprobs = None
        if row_logprobs is not None:
            logprobs = [row_logprobs[g] for g in itertools.accumulate((len(d) + 1 for d in drafts[:-1]), initial=0)]
        first = self._process_samples(seqs, [a[0] for a in accepted], logprobs)
        return append_in_rounds(seqs, accepted, first, self._process_samples, self._commit_accepted)

    def _commit_accepted(self, seq: Sequence) -> None:
        seq.num_computed_tokens += 1  # the KV of a draft counts once it is accepted
        self.block_manager.cache_full_blocks(seq)

    def _process_samples(self, seqs: list[Sequence], sampled, logprobs=None) -> list[RequestOutput]:
        """`sampled`: the sampler's output, or the tokens as a list (with `logprobs`, one per sequence)."""
        if not seqs:
            return []
        if isinstance(sampled, list):
            tokens = sampled
        else:
            tokens = sampled.token_ids.tolist()
            logprobs = self._logprobs(seqs, sampled)
        outputs = []
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            stop_token = self._is_stop_token(seq, tok)
            seq.output_token_ids.append(tok)
            if seq.structured is not None and not self.structured_outputs.accept(seq, tok):
                outputs.append(self._grammar_rejected(seq, tok))
                continue
            if seq.structured is not None and (error := self.structured_outputs.over_budget(seq)) is not None:
                self.scheduler.finish(seq, FinishReason.ABORT)  # its grammar would stall every other request
                outputs.append(self._finish_output(seq, [], error=error))
                continue
            new_lp = None
            if logprobs is not None and logprobs[i] is not None:
                new_lp = [logprobs[i]]
                seq.cumulative_logprob += logprobs[i].logprob
            if stop_token or self.structured_outputs.is_terminated(seq):  # grammar took a stop token
                reason = FinishReason.STOP
            elif len(seq.output_token_ids) >= seq.sampling_params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
            else:
                outputs.append(self._output(seq, [tok], new_lp, finished=False))
                continue
            self.scheduler.finish(seq, reason)
            outputs.append(self._finish_output(seq, [tok], new_lp, stop_reason=tok if stop_token else None))
        self.counters["generation_tokens"] += len(tokens)
        return self._process_text(outputs)

    def _process_text(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs with their text, when this engine detokenizes: a request a stop string ended finishes
        here, so the next round of a verifying step, or the next step, has no token for it."""
        states = self._request_states
        if states is None or not outputs:
            return outputs
        processed = process_outputs([states[out.request_id] for out in outputs], outputs)
        for request_id in processed.reqs_to_abort:
            seq = self._seqs[request_id]
            self.scheduler.finish(seq, FinishReason.STOP)
            self._release(seq)
        for out in processed.request_outputs:
            if out.finished:
                del states[out.request_id]
        return processed.request_outputs

    def _grammar_rejected(self, seq: Sequence, tok: int) -> RequestOutput:
        """The grammar refused the sampled token: it allowed none (the user's grammar matches nothing), or the
        bitmask let through a token it should not have (an engine bug)."""
        self.scheduler.finish(seq, FinishReason.ABORT)
        if self.structured_outputs.allows_no_token(seq):
            kind, n = seq.sampling_params.structured_outputs.kind, len(seq.output_token_ids) - 1
            error = f"structured_outputs.{kind} matches nothing: no token may follow {n} output tokens"
            return self._finish_output(seq, [], error=error)
        error = f"internal error: the grammar rejected token {tok}"
        return self._finish_output(seq, [], error=error, error_kind="internal")  # no text, no stop string, for it

    def _is_stop_token(self, seq: Sequence, tok: int) -> bool:
        p = seq.sampling_params
        if len(seq.output_token_ids) + 1 <= p.min_tokens:  # as the sampler's mask (vLLM): the first min_tokens
            return False
        return (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids

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

    def _output(
        self, seq, new_tokens, new_lp, finished, error=None, error_kind="invalid", stop_reason=None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=new_tokens,
            new_text="",
            finished=finished,
            finish_reason=seq.finish_reason.value if finished and seq.finish_reason else None,
            new_logprobs=new_lp,
            cumulative_logprob=seq.cumulative_logprob,
            num_output_tokens=len(seq.output_token_ids),
            error=error,
            error_kind=error_kind,
            num_cached_tokens=seq.num_cached_tokens or 0,
            stop_reason=stop_reason,
        )

    def _finish_output(
        self,
        seq: Sequence,
        new_tokens: list[int],
        new_lp=None,
        error: str | None = None,
        error_kind: str = "invalid",
        stop_reason: int | None = None,
    ) -> RequestOutput:
        self._release(seq)
        return self._output(seq, new_tokens, new_lp, True, error, error_kind, stop_reason)

    def _release(self, seq: Sequence) -> None:
        """A finished sequence leaves the engine (its blocks went back in scheduler.finish)."""
        del self._seqs[seq.request_id]
        if self.spec_decoder is not None:
            self.spec_decoder.finish(seq)
        seq.structured = None  # the matcher goes with the request

    def _record_stats(
        self, sched, num_running: int, num_decode: tuple[int, int], t0: float, forward_time: float
    ) -> None:
        arrivals = [s.arrival_time for s in sched.seqs]
        self.counters["steps"] += 1
        self.last_step_stats = StepStats(
            time=time.monotonic(),
            num_running=num_running,
            num_waiting=len(self.scheduler.waiting),
            num_scheduled_seqs=len(sched.seqs),
            num_scheduled_tokens=sched.total_tokens,
            num_prefill_tokens=sched.total_tokens - num_decode[1],
            num_decode_seqs=num_decode[0],
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_kv_blocks_total=self.block_manager.num_blocks,
            num_kv_blocks_cached=self.block_manager.num_cached_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            arrival_spread_s=max(arrivals) - min(arrivals),
            step_time_s=time.perf_counter() - t0,
            forward_time_s=forward_time,
            max_num_seqs=self.config.max_num_seqs,
        )
        if self.spec_decoder is not None and sched.total_tokens == num_decode[1]:
            self.spec_decoder.observe_step(sched.total_tokens, self.last_step_stats.step_time_s)


def tokenize_prompt(tokenizer, prompt: str, max_prompt_bytes: int, max_model_len: int) -> list[int]:
    """Prompt text -> token ids, bounded by max_prompt_bytes (the front of a server calls it too)."""
    if not prompt:
        raise InvalidRequestError("prompt is empty: give at least one character")
    limit = max_prompt_bytes
    if len(prompt) * 4 > limit and len(prompt.encode("utf-8")) > limit:
        raise InvalidRequestError(
            f"prompt is {len(prompt.encode('utf-8'))} bytes: the limit is max_prompt_bytes={limit} "
            f"(16 bytes per token of max_model_len={max_model_len} unless set)"
        )
    return tokenizer.encode(prompt).ids


def check_params(cfg: EngineConfig, params: SamplingParams) -> None:
    """The engine's bounds on one request's parameters (the front of a server calls it too)."""
    check_structured_outputs(cfg, params.structured_outputs)
    if params.logprobs is not None and params.logprobs > cfg.max_logprobs:
        raise InvalidRequestError(
            f"logprobs={params.logprobs} is too large: the limit is max_logprobs={cfg.max_logprobs}"
        )
    if len(params.stop) > cfg.max_stop_strings:
        raise InvalidRequestError(
            f"stop has {len(params.stop)} strings: the limit is max_stop_strings={cfg.max_stop_strings}"
        )
    longest = max((len(s) for s in params.stop), default=0)
    if longest > cfg.max_stop_str_len:
        raise InvalidRequestError(
            f"stop has a string of {longest} characters: the limit is max_stop_str_len={cfg.max_stop_str_len}"
        )
    if len(params.stop_token_ids) > cfg.max_stop_strings:
        raise InvalidRequestError(
            f"stop_token_ids has {len(params.stop_token_ids)} ids: the limit is max_stop_strings={cfg.max_stop_strings}"
        )
