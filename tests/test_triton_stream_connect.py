"""The OpenAI front's gRPC channel to Triton, opened before tritonserver listens (as `inflight serve` starts
both): a request that comes right after the server came up is served, not refused while the channel backs off
from its failed connects."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from inflight.launcher.server import free_port
from inflight.serving.openai.triton_stream import TritonLLM, TritonUnavailable


class _ConfigOnly(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Triton's ModelConfig RPC alone, with one parameter."""

    async def ModelConfig(self, request, context):  # noqa: N802 - the RPC's name
        config = service_pb2.ModelConfigResponse()
        config.config.name = request.name
        config.config.parameters["max_model_len"].string_value = "128"
        return config


def test_a_request_right_after_the_server_comes_up_is_served():
    port = free_port()

    async def scenario() -> dict:
        llm = TritonLLM(f"localhost:{port}")
        with contextlib.suppress(TritonUnavailable):
            await llm.parameters()  # nobody listens yet: the channel fails and backs off
        await asyncio.sleep(2.5)  # backoff grows while the server is still down
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_ConfigOnly(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            return await llm.parameters()
        finally:
            await llm.close()
            await server.stop(None)

    assert asyncio.run(scenario()) == {"max_model_len": "128"}
