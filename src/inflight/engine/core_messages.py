"""What the front and the engine core process say to each other (msgpack via msgspec, over ZMQ).

Front -> core: `AddRequest`, `Abort` and `LoRAAdmin` (load or unload an adapter; answered by an `Output` that
finishes its request id, with an error if refused). Core -> front: `Ready` once after start, then one `StepOutputs`
per step (every request's delta of that step, and at most every ~0.25 s the engine's stats: its state and
its counts since the previous stats), and `Broken` if the engine cannot go on. Per-step structs are
array-like with defaults omitted: small and quick to encode.
"""

from __future__ import annotations

import pickle

import msgspec

from inflight.engine.stats import IterationStats, SchedulerStats
from inflight.errors import ErrorKind
from inflight.outputs import RequestOutput, TokenLogprob
from inflight.sampling_params import SamplingParams

# ---- front -> core ----------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: bytes  # a pickled SamplingParams (nested, optional parts; pickled once per request)
    arrival_time: float
    priority: int = 0
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)

    @classmethod
    def make(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        priority=0,
        lora_name: str | None = None,
    ):
        return cls(request_id, prompt_token_ids, pickle.dumps(params, protocol=5), arrival, priority, lora_name)

    def sampling_params(self) -> SamplingParams:
        return pickle.loads(self.params)


class Abort(msgspec.Struct, array_like=True, tag=True):
    request_ids: list[str]


class LoRAAdmin(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    request_id: str
    action: str  # "load" | "unload"
    lora_name: str
    lora_path: str | None = None


# ---- core -> front ----------------------------------------------------------------------------------


class Logprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: dict[int, float]


class Output(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's RequestOutput of one step, without its prompt (the front has it) and without text (the core
    does not detokenize: the front's output processor does)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None
    cumulative_logprob: float = 0.0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: str = "invalid"  # an ErrorKind's value
    error_field: str | None = None  # the request field at fault
    stop_reason: int | None = None  # the stop token that ended it (stop strings are the front's)

    @classmethod
    def of(cls, out: RequestOutput) -> Output:
        logprobs = None
        if out.new_logprobs is not None:
            logprobs = [Logprob(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs]
        return cls(
            out.request_id,
            out.new_token_ids,
            out.finished,
            out.finish_reason,
            logprobs,
            out.cumulative_logprob,
            out.num_output_tokens,
            out.num_cached_tokens,
            out.error,
            out.error_kind,
            out.error_field,
            out.stop_reason,
        )

    @classmethod
    def failure(cls, request_id: str, kind: ErrorKind, message: str, field: str | None = None) -> Output:
        return cls(
            request_id,
            [],
            finished=True,
            finish_reason="abort",
            error=message,
            error_kind=kind.value,
            error_field=field,
        )

    def to_request_output(self, prompt_token_ids: list[int]) -> RequestOutput:
        logprobs = None
        if self.logprobs is not None:
            logprobs = [TokenLogprob(lp.token_id, lp.logprob, lp.top) for lp in self.logprobs]
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=prompt_token_ids,
            new_token_ids=self.new_token_ids,
            new_text="",
            finished=self.finished,
            finish_reason=self.finish_reason,
            new_logprobs=logprobs,
            cumulative_logprob=self.cumulative_logprob,
            num_output_tokens=self.num_output_tokens,
            error=self.error,
            error_kind=self.error_kind,
            error_field=self.error_field,
            num_cached_tokens=self.num_cached_tokens,
            stop_reason=self.stop_reason,
        )


class Ready(msgspec.Struct, array_like=True, tag=True):
    """The core's handshake: what the front needs of the engine it cannot see."""

    pid: int
    max_model_len: int
    max_prompt_bytes: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    dtype: str
    model_weight_bytes: int  # bytes of the weights the core holds (packed GGUF blocks as they are)
    lora_names: list[str] = []  # the LoRA adapters registered at start-up
    max_loras: int = 0  # 0: LoRA is off


class StepOutputs(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    outputs: list[Output]
    scheduler_stats: SchedulerStats | None = None  # the engine's state now
    iteration_stats: IterationStats | None = None  # counts since the previous message's stats


class Broken(msgspec.Struct, array_like=True, tag=True):
    """The engine failed and could not recover: the core answers every request with an error from now on."""

    reason: str


ToCore = AddRequest | Abort | LoRAAdmin
FromCore = Ready | StepOutputs | Broken
