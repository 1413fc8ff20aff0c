"""KV events: replaying what the engine published reconstructs exactly the set of blocks its prefix cache
holds, after a random workload with shared prefixes and evictions; the wire is vLLM's."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from inflight import SamplingParams
from inflight.config import ConfigError, EngineConfig, KVEventsConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    external_hash,
)


def replay(batches: list[KVEventBatch]) -> set[int]:
    held: set[int] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                held |= set(event.block_hashes)
            else:
                assert isinstance(event, BlockRemoved) and set(event.block_hashes) <= held
                held -= set(event.block_hashes)
    return held


def subscribed(engine: LLMEngine, sub, timeout_s: float = 60) -> None:
    """ZMQ's slow joiner: a PUB socket drops what it sends before a subscription reaches it. Publish empty
    batches on the engine's socket until the subscriber receives one; from then on it gets every batch."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine.kv_events.publish([])
        if sub.poll(50):
            topic, _, payload = sub.recv_multipart()
            assert topic == b"kv" and msgspec.msgpack.decode(payload, type=KVEventBatch).events == []
            return
    pytest.fail(f"the subscriber received nothing in {timeout_s} s")


def test_replaying_the_events_gives_the_cached_blocks(demo_model_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    engine = LLMEngine(
        demo_model_dir,
        EngineConfig(device="cpu", max_num_seqs=8, num_kv_blocks=40, max_model_len=256, kv_events_config=config),
    )
    rng = random.Random(0)
    systems = [[rng.randrange(5, 300) for _ in range(40)] for _ in range(3)]  # shared prefixes
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches, seqs = [], []
    subscribed(engine, sub)
    for wave in range(6):
        for i in range(5):
            prompt = rng.choice(systems) + [rng.randrange(5, 300) for _ in range(rng.randrange(1, 30))]
            engine.add_request(f"w{wave}-{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        while sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            seqs.append(int.from_bytes(seq, "big"))
            batches.append(decoder.decode(payload))
    engine.close()
    sub.close(linger=0)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # nothing lost once subscribed
    assert any(isinstance(e, BlockRemoved) for b in batches for e in b.events), "the workload never evicted"
    held = replay(batches)
    expected = {external_hash(h) for h in engine.block_manager._cached}
    assert held == expected and expected


def test_every_event_chains_to_its_parent(demo_model_dir):
    engine = LLMEngine(demo_model_dir, EngineConfig(device="cpu", num_kv_blocks=64, max_model_len=256))
    engine.block_manager._events = []  # record without a socket
    prompt = list(range(10, 10 + 50))
    engine.add_request("a", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stored = [e for e in engine.block_manager.take_events() if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == (50 + 20 - 1) // 16  # full blocks of prompt + output (the last token has no KV)
    assert stored[0].parent_block_hash is None and stored[0].token_ids[:16] == prompt[:16]
    for prev, event in zip(stored, stored[1:]):
        assert event.parent_block_hash == prev.block_hashes[-1]
    assert engine.block_manager.take_events() == []


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("{not json", "kv_events_config is not valid JSON"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher='kafka' is invalid"),
        ({"endpoint": "tcp://*:1", "port": 3}, r"unknown key\(s\) \['port'\]"),
    ],
)
def test_bad_kv_events_config_is_named(value, match):
    with pytest.raises(ConfigError, match=match):
        KVEventsConfig.parse(value)
    with pytest.raises(ConfigError, match=match):  # at once, before any model loads
        EngineConfig(device="cpu", kv_events_config=value)
    assert not KVEventsConfig.parse(None).enabled
