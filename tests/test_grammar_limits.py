"""Issue 27, items 3 and 5: a request's grammar cannot stall the engine or the compiler for everyone else."""

from __future__ import annotations

import json
import threading
import time

import pytest

from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine, check_params
from inflight.engine.structured_output.compile_pool import CompilePool
from inflight.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams

# Ambiguous: the 40 `"a"*` of one x and the repetitions of x split a run of a's in ever more ways, so each
# token costs the Earley matcher more than the last (on the demo vocabulary, measured: 0.1 ms at token 1,
# 24 ms at 16, 290 ms at 31, 770 ms at 36 for accept_token alone).
AMBIGUOUS = "root ::= (x)*\nx ::= " + " ".join(['"a"*'] * 40)


def _engine(demo_model_dir, **kw) -> LLMEngine:
    args = dict(device="cpu", max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=128) | kw
    return LLMEngine(demo_model_dir, EngineConfig.from_kwargs(args))


def _run(engine: LLMEngine, requests: dict, deadline_s: float = 120) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    results = {rid: {"tokens": 0, "error": None, "finish_reason": None} for rid in requests}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"engine did not finish: {results}"
        for out in engine.step():
            results[out.request_id]["tokens"] += len(out.new_token_ids)
            if out.finished:
                results[out.request_id].update(error=out.error, finish_reason=out.finish_reason)
    return results


def test_ambiguous_grammar_is_aborted_at_its_first_slow_token(demo_model_dir):
    engine = _engine(demo_model_dir, max_grammar_step_time_s=0.02)
    bad = SamplingParams(max_tokens=300, min_tokens=300, structured_outputs={"grammar": AMBIGUOUS})
    r = _run(
        engine,
        {"bad": ("Hello", bad), "good": ("Hello", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))},
        deadline_s=60,
    )
    # A loaded machine only makes each token slower, so the abort comes sooner; without the limit the
    # grammar runs on into tokens each costing many times it (and the deadline above).
    assert r["bad"]["tokens"] < 31, r["bad"]
    assert r["good"]["error"] is None and r["good"]["tokens"] == 60
    err = r["bad"]["error"]
    assert r["bad"]["finish_reason"] == "abort" and "structured_outputs.grammar" in err
    assert "max_grammar_step_time_s=0.02" in err, err
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0


def test_grammar_time_is_bounded_per_request_in_total(demo_model_dir):
    # Only the total bounds here. The budget is wall-clock matcher time, so a cheap grammar must stay far
    # inside it even while other processes take the CPU: half a second for a few regex tokens.
    engine = _engine(demo_model_dir, max_grammar_time_s=0.5, max_grammar_step_time_s=60)
    bad = SamplingParams(max_tokens=300, min_tokens=300, structured_outputs={"grammar": AMBIGUOUS})
    r = _run(engine, {"bad": ("Hello", bad), "regex": ("Hi", SamplingParams(max_tokens=3, guided_regex="[a-z]+"))})
    err = r["bad"]["error"]
    assert r["bad"]["finish_reason"] == "abort" and "max_grammar_time_s=0.5 per request" in err, err
    assert r["bad"]["tokens"] < 300
    assert "structured_outputs.grammar" in err
    assert r["regex"]["error"] is None  # a cheap grammar stays far inside the budget


def _schema(nbytes: int, seed: int = 0) -> dict:
    props, i = {}, 0
    while len(json.dumps(props)) < nbytes:
        props[f"field_{seed}_{i}"] = {"type": "string", "maxLength": 20 + i % 7}
        i += 1
    return {"type": "object", "properties": props}


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "constraint, mention",
    [
        ({"json": _schema(70_000)}, "structured_outputs.json is 7"),
        ({"grammar": 'root ::= "' + "a" * 70_000 + '"'}, "max_grammar_spec_bytes=65536"),
        ({"json": _nested(20)}, "structured_outputs.json nests 41 levels deep: the limit is max_grammar_depth=32"),
        ({"regex": "(" * 40 + "a" + ")" * 40}, "structured_outputs.regex nests 40 levels"),
        ({"grammar": "root ::= " + "(" * 33 + '"a"' + ")" * 33}, "max_grammar_depth=32"),
    ],
)
def test_constraints_over_the_complexity_budget_are_rejected_before_compiling(demo_model_dir, constraint, mention):
    params = SamplingParams(max_tokens=4, structured_outputs=constraint)
    with pytest.raises(InvalidRequestError) as info:
        check_params(EngineConfig(device="cpu"), params)  # the front's check
    assert mention in str(info.value)
    engine = _engine(demo_model_dir)
    with pytest.raises(InvalidRequestError):
        engine.add_request("r", "Hello", params)
    assert not engine.structured_outputs.pool._cache  # nothing was compiled
    ok = SamplingParams(structured_outputs={"json": _nested(8)})  # 17 levels: inside the budget
    check_params(EngineConfig(device="cpu"), ok)


def test_compile_cache_is_bounded_by_bytes(demo_model_dir):
    engine = _engine(demo_model_dir)
    manager = engine.structured_outputs.pool
    one = manager.request(StructuredOutputsParams(regex="a[0-9]+")).future.result(timeout=60).grammar
    size = one.memory_size_bytes
    assert size > 0
    manager.config.max_grammar_cache_bytes = int(size * 3.5)
    futures = [manager.request(StructuredOutputsParams(regex=f"a[0-9]+{i}")).future for i in range(8)]
    for f in futures:
        f.result(timeout=60)
    manager.request(StructuredOutputsParams(regex="b+")).future.result(timeout=60)
    manager.request(StructuredOutputsParams(regex="c+"))  # evicts at this request
    assert 0 < manager.cache_bytes <= manager.config.max_grammar_cache_bytes
    assert len(manager._cache) <= 5
    assert StructuredOutputsParams(regex="c+").key in manager._cache  # the newest stay
    assert StructuredOutputsParams(regex="a[0-9]+0").key not in manager._cache  # the least recently used go


def test_small_constraints_compile_in_a_lane_of_their_own(demo_model_dir, monkeypatch):
    gate = threading.Event()
    compile_grammar = CompilePool.compile_grammar

    def slow_for_big(compiler, params):
        if len(params.key[1]) > 8000:
            gate.wait(60)  # a big schema: holds a compile worker
        return compile_grammar(compiler, params)

    monkeypatch.setattr(CompilePool, "compile_grammar", staticmethod(slow_for_big))
    manager = _engine(demo_model_dir).structured_outputs.pool
    try:
        big = [manager.request(StructuredOutputsParams(json=_schema(10_000, seed=i))) for i in range(3)]
        assert len({b.future for b in big}) == 3
        small = manager.request(StructuredOutputsParams(regex="[a-z]+"))
        assert small.future.result(timeout=30) is not None  # did not wait for the big ones
        assert not any(b.future.done() for b in big)
    finally:
        gate.set()
    for b in big:
        assert b.future.result(timeout=60) is not None
    manager.close()


def test_a_compile_past_its_timeout_stays_cached_and_a_retry_joins_it(demo_model_dir, monkeypatch):
    from inflight.engine.structured_output import compile_pool as structured_output

    gate = threading.Event()
    compile_grammar = CompilePool.compile_grammar
    calls = []

    def slow(compiler, params):
        calls.append(params.key)
        gate.wait(60)
        return compile_grammar(compiler, params)

    monkeypatch.setattr(CompilePool, "compile_grammar", staticmethod(slow))
    engine = _engine(demo_model_dir)
    engine.add_request("first", "Hello", SamplingParams(max_tokens=2, guided_regex="x+"))
    first = engine.structured_outputs._requests["first"].compile
    try:
        deadline = time.monotonic() + 30
        while first.job.started is None and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.setattr(structured_output, "COMPILE_TIMEOUT_S", 0.0)
        time.sleep(0.01)
        (out,) = engine.step()
        assert out.request_id == "first" and "compilation took over" in out.error
        monkeypatch.setattr(structured_output, "COMPILE_TIMEOUT_S", 60.0)
        engine.add_request("retry", "Hello", SamplingParams(max_tokens=2, guided_regex="x+"))
        retry = engine.structured_outputs._requests["retry"].compile
        assert retry.future is first.future  # joined the running compile, did not start a second one
        assert retry.error() is None
    finally:
        gate.set()
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.error) for o in outs] == [("retry", None)]
    assert calls == [StructuredOutputsParams(regex="x+").key]  # compiled once
