"""`GET /v1/models` and vLLM's runtime LoRA endpoints, `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter`, over the Triton model's `lora_admin` input.

The model lists its adapters to anyone; loading and unloading take the server's LoRA admin key, which the
launcher gives both tritonserver and this front when runtime updating is allowed (an API key is set, or
`--allow-runtime-lora-updating`). Without the key here, the two endpoints answer 404 saying how to allow them
(in vLLM they do not exist unless VLLM_ALLOW_RUNTIME_LORA_UPDATING is set).
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from inflight.errors import ErrorKind
from inflight.serving.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from inflight.serving.openai.served_model import ServedModel
from inflight.serving.openai.serving_engine import error_response
from inflight.serving.openai.triton_stream import ModelError, TritonTimeout, TritonUnavailable

log = logging.getLogger(__name__)

RUNTIME_UPDATING_OFF = (
    "runtime LoRA updating is off on this server: start it with `inflight serve --allow-runtime-lora-updating` "
    "(or with an API key), or give `inflight openai` the server's LoRA admin key (--lora-admin-key or "
    "$INFLIGHT_LORA_ADMIN_KEY)"
)


class OpenAIServingModels:
    """The model list (the base model, then each adapter with `parent` = the base's served name) and the
    adapters' load and unload."""

    def __init__(self, model: ServedModel, lora_admin_key: str | None) -> None:
        self.model = model
        self.lora_admin_key = lora_admin_key

    async def show_available_models(self) -> dict:
        served = self.model
        base = {"id": served.served_model_name, "object": "model", "created": served.created, "owned_by": "inflight",
                "root": served.root or served.served_model_name, "parent": None}  # fmt: skip
        if served.limits is not None:
            base["max_model_len"] = served.limits.max_model_len
        try:
            adapters = await served.adapters()
        except TritonUnavailable as e:  # the base model is still what this front serves
            log.warning("cannot list the LoRA adapters: %s", e)
            adapters = {}
        cards = [
            {
                "id": name,
                "object": "model",
                "created": served.created,
                "owned_by": "inflight",
                "root": path,
                "parent": served.served_model_name,
            }  # fmt: skip
            for name, path in sorted(adapters.items())
        ]
        return {"object": "list", "data": [base, *cards]}

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        if self.lora_admin_key is None:
            return error_response(404, RUNTIME_UPDATING_OFF, code="not_found")
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.",
                                  "lora_name" if not name else "lora_path")  # fmt: skip
        if name == self.model.served_model_name:
            return error_response(400, f"lora_name={name!r} is the base model's name", "lora_name")
        try:
            if name in await self.model.adapters(max_age_s=0):
                return error_response(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
            await self._admin({"action": "load", "lora_name": name, "lora_path": path})
        except (ModelError, TritonUnavailable) as e:
            return self._admin_error(e, name)
        self.model.adapter_loaded(name, path)
        log.info("loaded LoRA adapter %r from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        if self.lora_admin_key is None:
            return error_response(404, RUNTIME_UPDATING_OFF, code="not_found")
        name = body.lora_name
        if not name:
            return error_response(400, "lora_name must be provided.", "lora_name")
        try:
            if name not in await self.model.adapters(max_age_s=0):
                return self._not_found(name)
            await self._admin({"action": "unload", "lora_name": name})
        except (ModelError, TritonUnavailable) as e:
            return self._admin_error(e, name)
        self.model.adapter_loaded(name, None)
        log.info("unloaded LoRA adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _admin(self, body: dict) -> dict:
        try:
            return await self.model.llm.lora_admin(body | {"key": self.lora_admin_key})
        finally:
            self.model.forget_adapters()  # whatever happened, the next look-up asks the model

    @staticmethod
    def _not_found(name: str) -> JSONResponse:
        return error_response(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "not_found")

    def _admin_error(self, e: ModelError | TritonUnavailable, name: str) -> JSONResponse:
        if isinstance(e, TritonTimeout):
            return error_response(504, str(e), code="timeout")
        if isinstance(e, TritonUnavailable):
            return error_response(503, str(e), code="service_unavailable")
        if e.field == "lora_admin":  # the key or the model's set-up: the server's fault, not the request's
            status = 503 if e.kind is ErrorKind.UNAVAILABLE else 500
            return error_response(status, f"the model refused LoRA admin: {e.message}")
        if e.kind is ErrorKind.UNAVAILABLE:  # e.g. an adapter in use by unfinished requests
            return error_response(409, e.message, e.field, "conflict")
        if not e.kind.is_users:
            return error_response(500, e.message)
        if e.field == "lora_name" and "not a known" in e.message:
            return self._not_found(name)
        return error_response(400, e.message, e.field)
