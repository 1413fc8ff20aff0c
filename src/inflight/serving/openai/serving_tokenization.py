"""vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer as the model itself applies it
(a text prompt with its special tokens; chat messages rendered by the template first)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.responses import JSONResponse, Response

from inflight.serving.openai.chat_template import ChatTemplateError
from inflight.serving.openai.protocol import DetokenizeRequest, RequestError, TokenizeRequest
from inflight.serving.openai.renderer import PromptRenderer
from inflight.serving.openai.served_model import ServedModel
from inflight.serving.openai.serving_engine import error_response
from inflight.serving.openai.triton_stream import TritonUnavailable


class OpenAIServingTokenization:
    def __init__(self, model: ServedModel) -> None:
        self.model = model

    async def tokenize(self, body: TokenizeRequest) -> Response:
        try:
            renderer = await self._renderer(body.model)
            if body.messages is not None:
                messages = [m.for_template() for m in body.messages]
                self.model.check_chat_size(messages, body.chat_template_kwargs or {})
                try:
                    prompt = await asyncio.to_thread(
                        renderer.chat_prompt, messages, body.add_generation_prompt, **(body.chat_template_kwargs or {})
                    )
                except ChatTemplateError as e:
                    raise RequestError(str(e), "messages") from None
            elif body.prompt is not None:
                prompt = body.prompt
                self.model.check_prompt_size(prompt)
            else:
                raise RequestError("send prompt (text) or messages (a chat)", "prompt")
            encoding = await asyncio.to_thread(
                renderer.tokenizer.encode, prompt, add_special_tokens=body.add_special_tokens
            )
            answer: dict[str, Any] = {
                "count": len(encoding.ids),
                "max_model_len": renderer.max_model_len,
                "tokens": encoding.ids,
                "token_strs": encoding.tokens if body.return_token_strs else None,
            }
            return JSONResponse(answer)
        except (RequestError, TritonUnavailable) as e:
            return _error(e)

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        try:
            renderer = await self._renderer(body.model)
            vocab = renderer.tokenizer.get_vocab_size(with_added_tokens=True)
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"tokens has id(s) {bad[:5]} outside the vocabulary [0, {vocab})", "tokens")
            return JSONResponse({"prompt": renderer.tokenizer.decode(body.tokens, skip_special_tokens=False)})
        except (RequestError, TritonUnavailable) as e:
            return _error(e)

    async def _renderer(self, model: str | None) -> PromptRenderer:
        """The served model's renderer, with a tokenizer (`model`, if named, must be one this front serves)."""
        if model is not None:
            await self.model.resolve_model(model)
        renderer = await self.model.renderer()
        if renderer.tokenizer is None:
            raise RequestError(f"no tokenizer for {renderer.model_dir} on this front", None, status=503)
        return renderer


def _error(e: RequestError | TritonUnavailable) -> Response:
    if isinstance(e, RequestError):
        return error_response(e.status, e.message, e.param, e.code)
    return error_response(503, str(e), code="service_unavailable")
