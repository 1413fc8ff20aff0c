"""Offline API in vLLM's shape: `LLM(model_dir, **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.outputs import CompletionOutput
from inflight.sampling_params import InvalidRequestError, SamplingParams


class LLM:
    def __init__(self, model: str | Path | None = None, **engine_args: Any) -> None:
        """`model`: an HF checkpoint directory, a .gguf file (or a directory holding one), "demo" (the random
        tiny demo model) or None: SmolLM2-135M-Instruct, the default model."""
        self.engine = LLMEngine(model, EngineConfig.from_kwargs(engine_args))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: Seq[int] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; outputs come back in input order."""
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
        engine = self.engine
        ids: list[str] = []
        results: dict[str, _Accumulator] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                rid = f"gen-{self._next_id}"
                self._next_id += 1
                engine.add_request(rid, prompt, params, priority=priority[i] if priority else 0)
                ids.append(rid)
            results = {rid: _Accumulator(rid) for rid in ids}
            show = len(ids) >= 8 if use_tqdm is None else use_tqdm
            errors: list[str] = []
            with tqdm(total=len(ids), desc="generate", unit="req", disable=not show) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.error is not None:  # e.g. a grammar that cannot compile: the caller's input
                            errors.append((out.error_kind, out.error))
                        acc = results[out.request_id]
                        acc.add(out)
                        if out.finished:
                            bar.update(1)
        except BaseException:  # also KeyboardInterrupt: the next call must not see this call's requests
            self._abort(ids)
            raise
        if errors:
            kind, message = errors[0]
            raise InvalidRequestError(message) if kind == "invalid" else RuntimeError(message)
        return [results[rid].result() for rid in ids]

    def _abort(self, ids: list[str]) -> None:
        engine = self.engine
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()  # drains the abort echoes (and nothing else: generate owns the engine)


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

    def add(self, out) -> None:
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
