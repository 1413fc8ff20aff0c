"""The engine core process and its wire format: messages round-trip, and a core process gives the same
tokens as the in-process engine (greedy), leaves text and stop strings to the front's output processor, takes
aborts, and answers bad requests with an error output."""

from __future__ import annotations

import time

import msgspec
import pytest

from inflight.config import EngineConfig
from inflight.engine import core_messages
from inflight.engine.core import CoreSpec
from inflight.engine.core_client import CoreClient
from inflight.engine.engine import LLMEngine
from inflight.engine.stats import EngineSnapshot, IterationStats, SchedulerStats, StepStats
from inflight.errors import ErrorKind
from inflight.llm import LLM
from inflight.models.loader import load_tokenizer
from inflight.outputs import RequestOutput, TokenLogprob
from inflight.sampling_params import SamplingParams
from inflight.text.output_processor import RequestState, process_outputs

CONFIG = EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=256)


def _roundtrip(message, kind):
    return msgspec.msgpack.Decoder(kind).decode(msgspec.msgpack.Encoder().encode(message))


def test_step_outputs_round_trip():
    out = RequestOutput(
        "r1",
        [1, 2],
        [7],
        "",  # the core sends no text
        True,
        "stop",
        [TokenLogprob(7, -0.5, {7: -0.5, 9: -1.25})],
        -0.5,
        3,
        None,
        "invalid",
        None,
        16,
        7,
    )
    stats = StepStats(1.0, 1, 0, 1, 1, 0, 1, 2, 64, 0, 0.0, 0.01, 0.005, 4)
    state = SchedulerStats(1, 0, 2, 62, 0, 4, stats, 0.5)
    counts = IterationStats(steps=5, prompt_tokens=2, spec_decode_num_accepted_tokens_per_pos=(2, 1))
    failure = core_messages.Output.failure("r2", ErrorKind.LIMIT, "max_tokens=9 is too large", "max_tokens")
    message = core_messages.StepOutputs([core_messages.Output.of(out), failure], state, counts)
    back = _roundtrip(message, core_messages.FromCore)
    assert back == message
    assert back.outputs[0].to_request_output([1, 2]) == out
    assert (back.outputs[1].error_kind, back.outputs[1].error_field) == ("limit", "max_tokens")
    assert back.scheduler_stats.last_step.occupancy == 0.25 and back.iteration_stats == counts


def test_iteration_stats_are_the_counts_between_two_snapshots_and_add_up():
    def snap(steps, generated, per_pos):
        return EngineSnapshot(
            steps, 4, generated, 0, 0, 0, 0, 8, 4, None, spec_decode_num_accepted_tokens_per_pos=per_pos
        )

    first, second = snap(3, 5, (1,)), snap(7, 12, (2, 1))
    a, b = IterationStats.between(None, first), IterationStats.between(first, second)
    assert (a.steps, a.generation_tokens, a.prompt_tokens) == (3, 5, 4)
    assert (b.steps, b.generation_tokens, b.prompt_tokens, b.spec_decode_num_accepted_tokens_per_pos) == (
        4,
        7,
        0,
        (1, 1),
    )
    total = a + b
    assert (total.steps, total.generation_tokens, total.spec_decode_num_accepted_tokens_per_pos) == (7, 12, (2, 1))
    assert not IterationStats.between(second, second) and total


def test_requests_round_trip():
    params = SamplingParams(temperature=0.5, max_tokens=9, stop=["x"], structured_outputs={"choice": ["a", "b"]})
    add = core_messages.AddRequest.make("r", [3, 4], params, 12.5, priority=2)
    back = _roundtrip(add, core_messages.ToCore)
    assert back == add and back.sampling_params() == params
    assert _roundtrip(core_messages.Abort(["a", "b"]), core_messages.ToCore) == core_messages.Abort(["a", "b"])


@pytest.fixture(scope="module")
def core(demo_model_dir):
    client = CoreClient(CoreSpec(demo_model_dir, CONFIG))
    client.start()
    yield client
    client.close()


def _run(core: CoreClient, until: set[str], timeout_s: float = 60) -> dict[str, list[core_messages.Output]]:
    outputs: dict[str, list[core_messages.Output]] = {}
    deadline = time.monotonic() + timeout_s
    while until and time.monotonic() < deadline:
        for message in core.poll(0.5):
            for out in getattr(message, "outputs", []):
                outputs.setdefault(out.request_id, []).append(out)
                if out.finished:
                    until.discard(out.request_id)
    assert not until, f"unfinished: {until}"
    return outputs


def _in_process(model_dir, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[RequestOutput]]:
    llm = LLM.from_engine(LLMEngine(model_dir, CONFIG))  # with the output processor: text
    for rid, ids in prompts.items():
        llm.add_request(rid, ids, params)
    outputs: dict[str, list[RequestOutput]] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _front(
    core, prompts, params, got: dict[str, list[core_messages.Output]]
) -> tuple[dict[str, list[RequestOutput]], set]:
    """What the front makes of the core's outputs: the output processor over each request's step messages."""
    tokenizer = load_tokenizer(core.spec.model_dir)
    texts, aborted = {}, set()
    for rid, outs in got.items():
        state = RequestState(tokenizer, prompts[rid], params)
        for out in outs:
            if state.stopped:
                break  # the front drops what the core made after a stop string
            processed = process_outputs([state], [out.to_request_output(prompts[rid])])
            texts.setdefault(rid, []).extend(processed.request_outputs)
            aborted.update(processed.reqs_to_abort)
    return texts, aborted


def test_core_process_matches_the_in_process_engine(core, demo_model_dir):
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6, 7], "c": [9, 10, 11, 12, 13, 14]}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    for rid, ids in prompts.items():
        core.add(core_messages.AddRequest.make(rid, ids, params, time.monotonic()))
    want = _in_process(demo_model_dir, prompts, params)
    got = _run(core, set(prompts))
    front, _ = _front(core, prompts, params, got)
    for rid in prompts:
        tokens = [t for o in got[rid] for t in o.new_token_ids]
        assert tokens == [t for o in want[rid] for t in o.new_token_ids]
        assert "".join(o.new_text for o in front[rid]) == "".join(o.new_text for o in want[rid])
        assert got[rid][-1].finish_reason == "length" and got[rid][-1].num_output_tokens == 24
        assert got[rid][-1].cumulative_logprob == pytest.approx(want[rid][-1].cumulative_logprob)


def test_core_outputs_token_ids_only_and_leaves_stop_strings_to_the_front(core, demo_model_dir):
    # The core's engine does not detokenize: a stop string the in-process engine stops at, the core runs past
    # (to max_tokens); the front's output processor cuts the text, tokens and logprobs there and aborts it.
    prompts = {"s": [3, 1, 4, 1, 5, 9, 2, 6]}
    full = _in_process(demo_model_dir, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = "".join(o.new_text for o in full["s"])
    stop = text[len(text) // 3 :][:4]
    assert stop.strip(), text
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1, stop=[stop])
    want = _in_process(demo_model_dir, prompts, params)
    assert want["s"][-1].finish_reason == "stop" and want["s"][-1].num_output_tokens < 24
    core.add(core_messages.AddRequest.make("s", prompts["s"], params, time.monotonic()))
    got = _run(core, {"s"})
    assert [t for o in got["s"] for t in o.new_token_ids] == [t for o in full["s"] for t in o.new_token_ids]
    assert got["s"][-1].finish_reason == "length" and not any(hasattr(o, "new_text") for o in got["s"])
    front, aborted = _front(core, prompts, params, got)
    assert aborted == {"s"}
    for field in ("new_text", "new_token_ids", "new_logprobs"):
        assert [getattr(o, field) for o in front["s"]] == [getattr(o, field) for o in want["s"]], field
    last, expected = front["s"][-1], want["s"][-1]
    assert (last.finish_reason, last.stop_reason, last.num_output_tokens) == ("stop", stop, expected.num_output_tokens)
    assert last.cumulative_logprob == expected.cumulative_logprob and expected.stop_reason == stop


def test_core_aborts_and_rejects(core):
    core.add(
        core_messages.AddRequest.make(
            "long", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), time.monotonic()
        )
    )
    core.add(core_messages.AddRequest.make("bad", [1, 2, 3], SamplingParams(max_tokens=10_000), time.monotonic()))
    core.add(core_messages.AddRequest.make("oov", [10**6], SamplingParams(max_tokens=2), time.monotonic()))
    errors = _run(core, {"bad", "oov"})
    assert errors["bad"][-1].error_kind == "limit" and "max_model_len=256" in errors["bad"][-1].error
    assert "outside the vocabulary" in errors["oov"][-1].error
    core.abort(["long"])
    state = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (state is None or state.num_running):
        for message in core.poll(0.2):
            state = getattr(message, "scheduler_stats", None) or state
    assert state is not None and state.num_running == 0 and state.num_kv_blocks_used == 0
