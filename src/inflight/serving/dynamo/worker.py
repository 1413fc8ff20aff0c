"""`inflight dynamo-worker`: one Triton replica registered with NVIDIA Dynamo as a token-in, token-out
`LLMEngine` (dynamo.common.backend), with the replica's KV events as its `ZmqSource`.

    inflight dynamo-worker --triton-url 127.0.0.1:8001 --discovery-backend file --request-plane tcp --event-plane zmq

Needs the optional Dynamo install (scripts/install_dynamo.sh). The worker exits when its tritonserver stays
unreachable for `--exit-after-unready` seconds: Dynamo then drops it from discovery and routes elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import AsyncGenerator
from pathlib import Path

from dynamo._core import Context
from dynamo.common.backend.engine import EngineConfig, GenerateChunk, GenerateRequest, LLMEngine, LlmRegistration
from dynamo.common.backend.publisher import KvEventSource, ZmqSource
from dynamo.common.backend.run import run
from dynamo.common.backend.worker import WorkerConfig
from dynamo.llm import ModelInput
from dynamo.llm.exceptions import InvalidArgument, WorkerUnavailable

from inflight.limits import ModelLimits
from inflight.model_source import ModelSourceError, resolve_model
from inflight.serving.dynamo.request import finish_reason, router_endpoint, sampling_parameters, usage
from inflight.serving.openai.triton_stream import ModelError, TritonLLM, TritonUnavailable

log = logging.getLogger("inflight.dynamo")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inflight dynamo-worker", description=__doc__.splitlines()[0])
    p.add_argument("--triton-url", default="127.0.0.1:8001", help="the replica's tritonserver gRPC address")
    p.add_argument("--triton-model", default="llm")
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint for Dynamo's tokenizer and chat template (default: the replica's `model` parameter)",
    )
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's)")
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="the replica's KV-event PUB socket to relay (default: from its kv_events_config; "
        "'none' = no KV events, the router then only approximates)",
    )
    p.add_argument("--namespace", default="inflight")
    p.add_argument("--component", default="backend")
    p.add_argument("--endpoint", default="generate")
    p.add_argument("--endpoint-types", default="chat,completions")
    p.add_argument("--discovery-backend", default="file", help="file | etcd | kubernetes (Dynamo's)")
    p.add_argument("--request-plane", default="tcp")
    p.add_argument("--event-plane", default="zmq")
    p.add_argument(
        "--exit-after-unready",
        type=float,
        default=1.0,
        help="leave the cluster once tritonserver is unreachable this long (seconds; 0 = never)",
    )
    return p


class TritonReplicaEngine(LLMEngine):
    """Forwards Dynamo's token requests to one tritonserver over gRPC streaming (the OpenAI front's client)."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.llm: TritonLLM | None = None
        self.kv_source: ZmqSource | None = None
        self.context_length: int | None = None
        self._watch: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}  # per request: its outputs, or _ABORTED from abort()
        self._suspect = asyncio.Event()

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[TritonReplicaEngine, WorkerConfig]:
        ns = build_parser().parse_args(argv)
        engine = cls(ns)
        # Dynamo's model card (tokenizer, chat template, context length) comes from the checkpoint directory;
        # the registration happens after start(), which resolves it from the replica when --model is absent.
        params = await engine._replica_parameters()
        ns.model = engine._resolve_model(ns.model or params.get("model", ""))
        ns.served_model_name = ns.served_model_name or Path(ns.model).name
        engine.params = params
        config = WorkerConfig(
            namespace=ns.namespace,
            component=ns.component,
            endpoint=ns.endpoint,
            model_name=ns.model,
            served_model_name=ns.served_model_name,
            model_input=ModelInput.Tokens,
            endpoint_types=ns.endpoint_types,
            discovery_backend=ns.discovery_backend,
            request_plane=ns.request_plane,
            event_plane=ns.event_plane,
            enable_kv_routing=True,
        )
        return engine, config

    async def _replica_parameters(self) -> dict[str, str]:
        llm = TritonLLM(self.ns.triton_url, self.ns.triton_model)
        try:
            for _ in range(600):  # the replica may still be loading its model
                if await llm.ready():
                    return await llm.parameters()
                await asyncio.sleep(0.5)
            raise SystemExit(
                f"inflight dynamo-worker: model '{self.ns.triton_model}' at {self.ns.triton_url} not ready"
            )
        finally:
            await llm.close()

    @staticmethod
    def _resolve_model(spec: str) -> str:
        try:
            return str(resolve_model(spec))
        except ModelSourceError as e:
            raise SystemExit(f"inflight dynamo-worker: model {spec!r}: {e}") from None

    async def start(self, worker_id: int) -> EngineConfig:
        del worker_id
        self.llm = TritonLLM(self.ns.triton_url, self.ns.triton_model)
        params = self.params
        # The replica's limits as its config publishes them; the KV capacity where num_kv_blocks is set.
        limits = ModelLimits.from_parameters(params, _checkpoint_context_length(self.ns.model))
        self.context_length = limits.max_model_len
        endpoint = self.ns.kv_events_endpoint
        if endpoint is None:
            found = router_endpoint(params.get("kv_events_config"))
            if found is not None:
                self.kv_source = ZmqSource(endpoint=found[0], topic=found[1], dp_rank=0)
        elif endpoint != "none":
            self.kv_source = ZmqSource(endpoint=endpoint, topic="", dp_rank=0)
        if self.kv_source is None:
            log.warning("the replica publishes no KV events: the KV router can only approximate what it caches")
        else:
            log.info("relaying the replica's KV events from %s", self.kv_source.endpoint)
        if self.ns.exit_after_unready > 0:
            self._watch = asyncio.get_running_loop().create_task(self._watch_replica())
        return EngineConfig(
            model=self.ns.model,
            served_model_name=self.ns.served_model_name,
            llm=LlmRegistration(
                context_length=self.context_length,
                kv_cache_block_size=limits.block_size or 16,
                total_kv_blocks=limits.num_kv_blocks,
                max_num_seqs=limits.max_num_seqs,
                max_num_batched_tokens=limits.max_num_batched_tokens,
            ),
        )

    async def kv_event_sources(self) -> list[KvEventSource]:
        return [self.kv_source] if self.kv_source is not None else []

    async def generate(self, request: GenerateRequest, context: Context) -> AsyncGenerator[GenerateChunk, None]:
        assert self.llm is not None
        prompt = list(request.get("token_ids") or [])
        params = sampling_parameters(dict(request), self.context_length)
        request_id = context.id() or ""
        stream = self.llm.generate(prompt, params, stream=True, request_id=request_id, token_ids=True)
        # One task pumps the replica's responses into a queue that abort() can also end: a queue put and get a
        # token, where waiting on the stream and an abort event together made a task and a wait per token.
        queue: asyncio.Queue = asyncio.Queue()
        pump = asyncio.ensure_future(_pump(stream, queue))
        self._queues[request_id] = queue
        completion_tokens = 0
        held = None  # what ended a merge below, handled next
        try:
            while True:
                if held is not None:
                    out, held = held, None
                else:
                    out = await queue.get()
                if out is _ABORTED:  # leaving cancels the request on Triton (its KV blocks go back)
                    yield {"token_ids": [], "index": 0, "finish_reason": "cancelled"}
                    return
                if out is _ENDED:
                    return
                if isinstance(out, Exception):
                    raise out
                ids = list(out.token_ids or [])
                # Responses that queued up while the last chunk was on its way go as one chunk (as the model's
                # responder merges its deltas when sending falls behind): one message through Dynamo, not many.
                while not out.final and not queue.empty():
                    nxt = queue.get_nowait()
                    if nxt is _ABORTED or nxt is _ENDED or isinstance(nxt, Exception):
                        held = nxt
                        break
                    out = nxt
                    ids += out.token_ids or []
                completion_tokens += len(ids)
                chunk: GenerateChunk = {"token_ids": ids, "index": 0}
                if out.final:
                    chunk["finish_reason"] = finish_reason(out.finish_reason) or "stop"
                    chunk["completion_usage"] = usage(out.num_input_tokens, completion_tokens, out.num_cached_tokens)
                yield chunk
                if out.final:
                    return
        except ModelError as e:
            if e.kind.is_users:
                raise InvalidArgument(e.message) from None
            raise RuntimeError(e.message) from None  # the replica's engine failed: an internal error
        except TritonUnavailable as e:
            self._suspect.set()  # check the replica now rather than at the next poll
            # Dynamo's frontend may move the request to another worker (its --migration-limit).
            raise WorkerUnavailable(str(e)) from None
        finally:
            self._queues.pop(request_id, None)
            if not pump.done():
                pump.cancel()  # the stream's own cleanup cancels the request on the server
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            await stream.aclose()

    async def abort(self, context: Context) -> None:
        queue = self._queues.get(context.id() or "")
        if queue is not None:
            queue.put_nowait(_ABORTED)

    async def _watch_replica(self) -> None:
        """Leave the cluster when the replica is gone: a SIGTERM runs Dynamo's graceful shutdown, which
        unregisters this worker, so the router stops sending it requests."""
        assert self.llm is not None
        down_since = None
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._suspect.wait(), 0.25 if down_since else 1.0)
            self._suspect.clear()
            if await self.llm.ready():
                down_since = None
                continue
            now = loop.time()
            down_since = down_since or now
            if now - down_since >= self.ns.exit_after_unready:
                log.error("tritonserver at %s unreachable for %.1fs: leaving", self.ns.triton_url, now - down_since)
                os.environ.setdefault("DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS", "0")  # nothing to drain
                os.kill(os.getpid(), signal.SIGTERM)
                return

    async def cleanup(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self.llm is not None:
            await self.llm.close()
            self.llm = None


_ABORTED, _ENDED = object(), object()


async def _pump(stream: AsyncGenerator, queue: asyncio.Queue) -> None:
    """The stream's outputs into `queue`, then _ENDED, or the exception it raised."""
    try:
        async for out in stream:
            queue.put_nowait(out)
        queue.put_nowait(_ENDED)
    except Exception as e:  # handed to the consumer, which raises it in its own task (a cancel is not caught)
        queue.put_nowait(e)


def _checkpoint_context_length(model: str) -> int | None:
    path = Path(model) / "config.json"
    try:
        return int(json.loads(path.read_text()).get("max_position_embeddings"))
    except (OSError, ValueError, TypeError):
        return None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(TritonReplicaEngine, argv)
    return 0
