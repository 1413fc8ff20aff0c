"""OpenAI request bodies (pydantic) and their translation into the model's `sampling_parameters`.

Only what the engine can honour is accepted: `n` > 1 and `best_of` > 1 get a 400 naming the field rather than
being silently ignored. Value ranges are checked by the model itself
(one set of limits), whose error names the request field at fault, mapped to the OpenAI one by `openai_param`.
Lists are bounded here, before pydantic builds their items (a body of millions of token ids or messages
would otherwise take seconds of the event loop to refuse).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

# Bounds on what pydantic builds per request (the body's size is bounded before, by the Guard).
MAX_MESSAGES = 8192  # chat messages
MAX_CONTENT_PARTS = 8192  # text parts, all messages together
MAX_LIST_ITEMS = 1024  # stop, stop_token_ids, logit_bias, tools, functions (the model bounds stop at 64)
MAX_CHOICES = 256  # choices of one request: prompts (a completions batch) times n
MAX_PROMPT_TOKEN_IDS = 1 << 20  # token ids of a request's prompts, all together (the model bounds each prompt)


def _too_long(field: str, n: int, limit: int, what: str = "items") -> PydanticCustomError:
    return PydanticCustomError("too_long", f"{field} has {n} {what}: the limit is {limit}")


def _bounded(field: str, value: Any, limit: int = MAX_LIST_ITEMS) -> Any:
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise _too_long(field, len(value), limit)
    return value


class RequestError(ValueError):
    """An error the front decides itself (a 400 unless `status` says otherwise); `param` is the OpenAI field."""

    def __init__(self, message: str, param: str | None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


class LoadLoRAAdapterRequest(BaseModel):
    """`POST /v1/load_lora_adapter` (vLLM's): register a PEFT adapter directory under a name."""

    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    """`POST /v1/unload_lora_adapter` (vLLM's): forget an adapter by name (`lora_int_id` is accepted, unused)."""

    lora_name: str = ""
    lora_int_id: int | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object); None: any object
    strict: bool | None = None


class ChatCompletionTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class _Sampling(BaseModel):
    """Fields both endpoints share, vLLM's extras included."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    @field_validator("stop", "stop_token_ids", "logit_bias", mode="before")
    @classmethod
    def _bound_lists(cls, value: Any, info) -> Any:
        return _bounded(info.field_name, value)

    def check_common(self, num_prompts: int = 1) -> None:
        if self.n < 1:
            raise RequestError(f"n={self.n} is invalid: must be >= 1", "n")
        if self.n * num_prompts > MAX_CHOICES:
            raise RequestError(
                f"n={self.n} for {num_prompts} prompt(s) asks for {self.n * num_prompts} choices: the limit is "
                f"{MAX_CHOICES}",
                "n",
            )
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", "stream_options")
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            raise RequestError(
                "response_format.type='json_schema' needs response_format.json_schema with a 'schema'",
                "response_format.json_schema",
            )

    def sampling_parameters(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """The model's `sampling_parameters` (unset fields keep the engine's defaults)."""
        fields = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                  "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")  # fmt: skip
        params: dict[str, Any] = {f: getattr(self, f) for f in fields if getattr(self, f) is not None}
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        if self.stop is not None:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.logit_bias:
            params["logit_bias"] = self.logit_bias  # keys: token ids as strings, which the model reads
        if logprobs is not None:
            params["logprobs"] = logprobs
        structured = structured_outputs(self.response_format)
        if structured is not None:
            params["structured_outputs"] = structured
        return params


def structured_outputs(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """response_format in vLLM's `structured_outputs` shape."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    assert response_format.json_schema is not None  # check_common
    return {"json": response_format.json_schema.schema_}


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _bound_prompts(cls, value: Any) -> Any:
        # Bounded before pydantic validates (millions of) token ids.
        if isinstance(value, list):
            if not value:
                raise PydanticCustomError("prompt_list", "prompt is an empty list")
            flat = not isinstance(value[0], (list, str))  # one prompt of token ids
            if not flat:
                _bounded("prompt", value, MAX_CHOICES)
            ids = len(value) if flat else sum(len(p) for p in value if isinstance(p, list))
            if ids > MAX_PROMPT_TOKEN_IDS:
                raise _too_long("prompt", ids, MAX_PROMPT_TOKEN_IDS, "token ids")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group: a string, a list of strings, token ids, or lists of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    def check(self) -> list[str | list[int]]:
        """The prompts, after the checks only the front can make."""
        prompts = self.prompts
        self.check_common(len(prompts))
        if self.best_of not in (None, 1):
            raise RequestError(f"best_of={self.best_of} is not supported: only 1 (send n for more samples)", "best_of")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.echo and self.logprobs is not None:
            raise RequestError("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
        if any(isinstance(p, list) and not p for p in prompts):
            raise RequestError("prompt has an empty list of token ids", "prompt")
        return prompts


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: the template may read them
    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # text parts: joined, as vLLM does for string-content templates
            message["content"] = "\n".join(part.text for part in self.content)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None
    # vLLM's extras for the template
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _bound_messages(cls, value: Any) -> Any:
        _bounded("messages", value, MAX_MESSAGES)
        if isinstance(value, list):
            parts = sum(len(m["content"]) for m in value if isinstance(m, dict) and isinstance(m.get("content"), list))
            if parts > MAX_CONTENT_PARTS:
                raise _too_long("messages", parts, MAX_CONTENT_PARTS, "content parts")
        return value

    @field_validator("tools", "functions", mode="before")
    @classmethod
    def _bound_tools(cls, value: Any, info) -> Any:
        return _bounded(info.field_name, value)

    def check(self) -> None:
        self.check_common()
        if self.functions:
            raise RequestError("functions (deprecated by OpenAI) are not supported: send tools", "functions")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise RequestError("tool_choice needs tools: the request names none", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            names = ", ".join(t.function.name for t in self.tools)
            raise RequestError(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools ({names})",
                "tool_choice",
            )
        if self.tools and len({t.function.name for t in self.tools}) < len(self.tools):
            raise RequestError("tools name a function twice", "tools")
        calls = self.tools and self.effective_tool_choice != "none"
        if calls and self.response_format is not None and self.response_format.type != "text":
            raise RequestError("response_format cannot be combined with tool calls (tool_choice)", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        reserved = sorted({"messages", "add_generation_prompt"} & set(self.chat_template_kwargs or {}))
        if reserved:
            raise RequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: it is a field of the request itself",
                "chat_template_kwargs",
            )

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when there are tools, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a text prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @field_validator("messages", mode="before")
    @classmethod
    def _bound_messages(cls, value: Any) -> Any:
        return _bounded("messages", value, MAX_MESSAGES)


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize`."""

    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _bound_tokens(cls, value: Any) -> Any:
        return _bounded("tokens", value, MAX_PROMPT_TOKEN_IDS)


def openai_param(field: str | None, request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The OpenAI field behind the request field a model error names (its `field`)."""
    if field is None:
        return None
    chat = isinstance(request, ChatCompletionRequest)
    if field in ("text_input", "prompt", "prompt_token_ids"):
        return "messages" if chat else "prompt"
    if field == "max_tokens" and chat and request.max_completion_tokens is not None:
        return "max_completion_tokens"
    if field == "logprobs" and chat:
        return "top_logprobs"
    if field == "structured_outputs":
        return "response_format"
    if field == "lora_name":  # the front names the adapter from `model`
        return "model"
    return field
