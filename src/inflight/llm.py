"""Offline API in vLLM's shape: `LLM(model_dir, **engine_args).generate(prompts, sampling_params)`.

The engine outputs token ids; the output processor (the front's, inflight.text.output_processor) makes their
text and ends a request at a stop string, which the engine is then told to abort.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.errors import ErrorKind, InvalidRequestError
from inflight.lora_request import LoRARequest
from inflight.outputs import CompletionOutput, RequestOutput
from inflight.sampling_params import SamplingParams
from inflight.text.output_processor import RequestState, process_outputs


class LLM:
    def __init__(self, model: str | Path | None = None, **engine_args: Any) -> None:
        """`model`: an HF checkpoint directory, a .gguf file (or a directory holding one), "demo" (the random
        tiny demo model) or None: SmolLM2-135M-Instruct, the default model."""
        self._start(LLMEngine(model, EngineConfig.from_kwargs(engine_args)))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An LLM over an engine already built (with an EngineConfig); it must not step elsewhere."""
        llm = cls.__new__(cls)
        llm._start(engine)
        return llm

    def _start(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._next_id = 0
        # Per request in flight: its parameters, then (from its first output) the output processor's state.
        self._requests: dict[str, SamplingParams | RequestState] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- one step at a time (vLLM's LLMEngine: the engine and the output processor) -------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        params = params or SamplingParams()
        self.engine.add_request(request_id, prompt, params, priority=priority, lora_request=lora_request)
        self._requests[request_id] = params

    def abort_request(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs with their text. A request a stop string ended is aborted in the engine;
        what the engine still outputs for it (the abort's echo) is dropped."""
        outputs = [out for out in self.engine.step() if out.request_id in self._requests]
        if not outputs:
            return []
        processed = process_outputs([self._state(out) for out in outputs], outputs)
        for request_id in processed.reqs_to_abort:
            self.engine.abort_request(request_id)
        for out in processed.request_outputs:
            if out.finished:
                del self._requests[out.request_id]
        return processed.request_outputs

    def _state(self, out: RequestOutput) -> RequestState:
        state = self._requests[out.request_id]
        if isinstance(state, SamplingParams):
            state = self._requests[out.request_id] = RequestState(self.tokenizer, out.prompt_token_ids, state)
        return state

    # ---- whole requests ---------------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; outputs come back in input order. `lora_request`: one adapter for every
        prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts; give one or one each"
                )
        loras = [lora_request] * len(prompts) if not isinstance(lora_request, Seq) else list(lora_request)
        if len(loras) != len(prompts):
            raise InvalidRequestError(
                f"lora_request has {len(loras)} entries for {len(prompts)} prompts; give one or one each"
            )
        ids: list[str] = []
        results: dict[str, _Accumulator] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                rid = f"gen-{self._next_id}"
                self._next_id += 1
                self.add_request(rid, prompt, params, priority=priority[i] if priority else 0, lora_request=loras[i])
                ids.append(rid)
            results = {rid: _Accumulator(rid) for rid in ids}
            show = len(ids) >= 8 if use_tqdm is None else use_tqdm
            errors: list[tuple[str, str | None, str]] = []  # (kind, field, message)
            with tqdm(total=len(ids), desc="generate", unit="req", disable=not show) as bar:
                while self.has_unfinished_requests():
                    for out in self.step():
                        if out.error is not None:  # e.g. a grammar that cannot compile: the caller's input
                            errors.append((out.error_kind, out.error_field, out.error))
                        results[out.request_id].add(out)
                        if out.finished:
                            bar.update(1)
        except BaseException:  # also KeyboardInterrupt: the next call must not see this call's requests
            self._abort(ids)
            raise
        if errors:
            kind, field, message = errors[0]
            if ErrorKind(kind).is_users:
                raise InvalidRequestError(message, field, kind)
            raise RuntimeError(message)
        return [results[rid].result() for rid in ids]

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.abort_request(rid)
        while self.has_unfinished_requests():
            self.step()  # drains the abort echoes (and nothing else: generate owns the engine)
        for rid in ids:
            self._requests.pop(rid, None)  # what a step that raised left behind


class _Accumulator:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = []
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.num_cached_tokens = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt_token_ids = out.prompt_token_ids
        self.token_ids += out.new_token_ids
        self.text.append(out.new_text)
        if out.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.new_logprobs
        self.cumulative_logprob = out.cumulative_logprob
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason

    def result(self) -> CompletionOutput:
        return CompletionOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids,
            text="".join(self.text),
            finish_reason=self.finish_reason,
            logprobs=self.logprobs,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            num_cached_tokens=self.num_cached_tokens,
        )
