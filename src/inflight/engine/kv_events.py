"""KV cache events in vLLM's wire format, for KV-aware routers (NVIDIA Dynamo's `ZmqSource`, llm-d).

The prefix cache reports what it holds as it changes: `BlockStored` when full blocks are registered under
their chained hash, `BlockRemoved` when one is evicted, `AllBlocksCleared` when the whole cache goes (the
engine starting: a router must forget what a restarted engine held). A batch per engine step goes out on a
ZMQ PUB socket as the multipart message (topic, 8-byte big-endian sequence number, msgpack payload), as
vLLM's `ZmqEventPublisher` sends it. Block hashes are the low 64 bits of our sha256 chain, as integers
(vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec

from inflight.config import KVEventsConfig


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag is the class name, as vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: bytes) -> int:
    """The hash a router sees: the low 64 bits of the block's sha256 chain hash."""
    return int.from_bytes(block_hash[-8:], "big")


class ZmqEventPublisher:
    """A PUB socket that sends one `KVEventBatch` per call (binds endpoints with a wildcard, else connects)."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        endpoint = config.endpoint
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._topic = config.topic.encode()
        self._seq = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, events: list[KVCacheEvent]) -> None:
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
        self._pub.send_multipart((self._topic, next(self._seq).to_bytes(8, "big"), payload))

    def close(self) -> None:
        self._pub.close(linger=0)
