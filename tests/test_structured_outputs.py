"""Structured outputs on the demo model (random weights): JSON schema, regex, choice and an EBNF grammar
are enforced in the batched sampler, unconstrained neighbours are untouched, preemption keeps outputs
valid, and bad constraints are rejected naming the field and the reason."""

from __future__ import annotations

import ast
import concurrent.futures as cf
import json
import re
import time

import pytest
import torch

from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.structured_output.compile_pool import CompileJob, GrammarCompile
from inflight.llm import LLM
from inflight.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

# Nested objects, arrays, enums, bounded integers, required fields. Strings and arrays are bounded so
# that a random-weight model finishes well inside max_tokens: every output must finish and validate.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "address"],
}
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL = r"[a-z0-9._]{1,12}@[a-z0-9]{1,10}\.(com|org|net)"
CHOICES = ["positive", "negative", "neutral"]
# Arithmetic with bounded repetition and one level of parentheses, so every output can end.
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" inner ")"
inner ::= num (("+" | "-" | "*" | "/") num){0,3}
num ::= "0" | [1-9] [0-9]{0,2}
"""
PROMPTS = ["Hello world", "The model runs", "A quiet river flows", "Tell me a story about the ocean"]
# A mix of samplers for the constrained rows: the mask must hold whatever sampling follows it.
SAMPLERS = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.2, top_k=20),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
]


def _engine(demo_model_dir, **kw) -> LLMEngine:
    args = dict(device="cpu", max_num_seqs=64, max_num_batched_tokens=1024, num_kv_blocks=512) | kw
    return LLMEngine(demo_model_dir, EngineConfig.from_kwargs(args))


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, dict]:
    engine = LLM.from_engine(engine)  # with the output processor: text
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    results = {rid: {"tokens": [], "text": "", "finish_reason": None, "error": None} for rid in requests}
    deadline = time.monotonic() + 600
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        for out in engine.step():
            r = results[out.request_id]
            r["tokens"] += out.new_token_ids
            r["text"] += out.new_text
            if out.finished:
                r["finish_reason"], r["error"] = out.finish_reason, out.error
    return results


def _arithmetic_ok(text: str) -> bool:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


def _constrained_requests() -> dict[str, tuple[str, SamplingParams]]:
    kinds = (
        [("json", {"json": SCHEMA, "disable_any_whitespace": True}, 160)] * 16
        + [("date", {"regex": DATE}, 24)] * 8
        + [("email", {"regex": EMAIL}, 40)] * 8
        + [("choice", {"choice": CHOICES}, 16)] * 8
        + [("arith", {"grammar": ARITHMETIC}, 64)] * 8
    )
    out = {}
    for i, (kind, so, max_tokens) in enumerate(kinds):
        params = SamplingParams(
            max_tokens=max_tokens, seed=1000 + i, structured_outputs=so, **SAMPLERS[i % len(SAMPLERS)]
        )
        out[f"{kind}-{i}"] = (PROMPTS[i % len(PROMPTS)], params)
    return out


def _check(rid: str, result: dict) -> None:
    text = result["text"]
    assert result["error"] is None, (rid, result["error"])
    assert result["finish_reason"] == "stop", (rid, result["finish_reason"], text)  # the grammar ended
    kind = rid.split("-")[0]
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "date":
        assert re.fullmatch(DATE, text), (rid, text)
    elif kind == "email":
        assert re.fullmatch(EMAIL, text), (rid, text)
    elif kind == "choice":
        assert text in CHOICES, (rid, text)
    else:
        assert _arithmetic_ok(text), (rid, text)


def test_64_requests_in_one_batch_all_valid_and_neighbours_untouched(demo_model_dir):
    constrained = _constrained_requests()
    free = {
        f"free-{i}": (PROMPTS[i % len(PROMPTS)] + " and", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        for i in range(16)
    }
    assert len(constrained) + len(free) == 64
    engine = _engine(demo_model_dir)
    both = _run(engine, constrained | free)
    assert engine.scheduler.num_preemptions == 0
    for rid in constrained:
        _check(rid, both[rid])
    kinds_seen = {rid.split("-")[0] for rid in constrained}
    assert kinds_seen == {"json", "date", "email", "choice", "arith"}

    # Unconstrained greedy rows give exactly the tokens they give with no constrained neighbour ...
    alone = _run(engine, free)
    for rid in free:
        assert both[rid]["tokens"] == alone[rid]["tokens"], rid
    # ... and a seeded constrained row gives the same tokens whatever its neighbours (batch invariance).
    picked = {rid: constrained[rid] for rid in ("json-1", "json-4", "email-29", "arith-44")}
    solo = _run(engine, picked)
    for rid in picked:
        assert solo[rid]["tokens"] == both[rid]["tokens"], rid


def test_constraint_changes_the_output(demo_model_dir):
    """The mask is applied: the same seeded request without its constraint does not produce JSON."""
    engine = _engine(demo_model_dir)
    params = dict(temperature=0.0, max_tokens=160, seed=3)
    so = {"json": SCHEMA, "disable_any_whitespace": True}
    r = _run(
        engine,
        {
            "c": ("Hello world", SamplingParams(structured_outputs=so, **params)),
            "u": ("Hello world", SamplingParams(**params)),
        },
    )
    jsonschema.validate(json.loads(r["c"]["text"]), SCHEMA)
    assert not r["u"]["text"].lstrip().startswith("{")


def test_preempted_constrained_request_stays_valid(demo_model_dir):
    """Tiny KV cache: constrained requests are preempted (recomputed) mid-generation and stay valid,
    token-identical to a run without preemption (the matcher state survives recompute)."""
    requests = {
        f"json-{i}": (
            PROMPTS[i] * 3,
            SamplingParams(
                temperature=1.0,
                seed=7 + i,
                max_tokens=160,
                structured_outputs={"json": SCHEMA, "disable_any_whitespace": True},
            ),
        )
        for i in range(4)
    }
    roomy = _run(_engine(demo_model_dir), requests)
    tight_engine = _engine(demo_model_dir, num_kv_blocks=24, max_num_seqs=4)
    tight = _run(tight_engine, requests)
    assert tight_engine.scheduler.num_preemptions > 0
    for rid in requests:
        _check(rid, tight[rid])
        assert tight[rid]["tokens"] == roomy[rid]["tokens"], rid


def test_grammar_that_can_only_end_finishes_with_stop_despite_min_tokens(demo_model_dir):
    engine = _engine(demo_model_dir)
    r = _run(
        engine,
        {
            "c": ("Hello", SamplingParams(temperature=0, max_tokens=30, min_tokens=20, guided_choice=["yes", "no"])),
            "i": (
                "Hello",
                SamplingParams(temperature=1, seed=1, max_tokens=30, ignore_eos=True, guided_regex="[ab]{3}"),
            ),
        },
    )
    assert r["c"]["finish_reason"] == "stop" and r["c"]["text"] in ("yes", "no")
    assert r["i"]["finish_reason"] == "stop" and re.fullmatch("[ab]{3}", r["i"]["text"])


def test_uncompilable_constraint_fails_only_its_request(demo_model_dir):
    engine = _engine(demo_model_dir)
    r = _run(
        engine,
        {
            "schema": ("Hello", SamplingParams(max_tokens=8, guided_json={"type": "nonsense"})),
            "regex": ("Hello", SamplingParams(max_tokens=8, structured_outputs={"regex": "(abc"})),
            "ebnf": ("Hello", SamplingParams(max_tokens=8, structured_outputs={"grammar": "root ::= undefined_rule"})),
            "good": ("Hello", SamplingParams(temperature=0, max_tokens=4)),
        },
    )
    assert "structured_outputs.json" in r["schema"]["error"] and "nonsense" in r["schema"]["error"]
    assert "structured_outputs.regex" in r["regex"]["error"] and "parenthesis" in r["regex"]["error"]
    assert "structured_outputs.grammar" in r["ebnf"]["error"] and "undefined_rule" in r["ebnf"]["error"]
    assert r["good"]["error"] is None and len(r["good"]["tokens"]) == 4
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0


def _replace_compile(engine: LLMEngine, request_id: str, compile_: GrammarCompile) -> None:
    """The request waits for `compile_` instead of its own (which may have finished already)."""
    manager = engine.structured_outputs
    manager._requests[request_id].compile = compile_
    manager._pending[request_id] = manager._requests[request_id]


def test_waiting_grammar_does_not_hold_up_the_queue_and_abort_drops_it(demo_model_dir):
    engine = _engine(demo_model_dir)
    engine.add_request("slow", "Hello", SamplingParams(max_tokens=4, guided_regex="a+"))
    slow = engine._seqs["slow"]
    never = GrammarCompile(StructuredOutputsParams(regex="a+"), CompileJob())  # a compile that never finishes
    never.job.future = cf.Future()
    _replace_compile(engine, "slow", never)
    engine.add_request("fast", "Hello", SamplingParams(temperature=0, max_tokens=3))
    outs = []
    for _ in range(5):
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["fast"]
    assert slow in engine.scheduler.waiting and slow.num_computed_tokens == 0
    engine.abort_request("slow")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("slow", "abort")]
    assert "slow" not in engine.structured_outputs and not engine.has_unfinished_requests()


def test_compile_cache_is_keyed_by_the_constraint(demo_model_dir):
    engine = _engine(demo_model_dir)
    manager = engine.structured_outputs.pool
    a = manager.request(StructuredOutputsParams.from_value({"json": {"type": "object", "required": ["a"]}}))
    b = manager.request(StructuredOutputsParams.from_value({"json": '{"required": ["a"], "type": "object"}'}))
    c = manager.request(StructuredOutputsParams.from_value({"json": {"type": "object"}}))
    assert a.future is b.future and a.future is not c.future
    assert a.future.result(timeout=60) is not None


@pytest.mark.parametrize(
    "params, mention",
    [
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "exactly one constraint"),
        ({"structured_outputs": {}}, "exactly one constraint"),
        ({"guided_regex": "a", "guided_choice": ["x"]}, "guided_regex and guided_choice"),
        ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "structured_outputs and guided_json"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json is not valid JSON"),
        ({"structured_outputs": {"json": 5}}, "structured_outputs.json=5"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice=[]"),
        ({"guided_choice": ["a", 1]}, "guided_choice=['a', 1]"),
        ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object=False"),
        ({"structured_outputs": {"regx": "a"}}, "unknown key(s) ['regx']"),
        ({"structured_outputs": "json"}, "structured_outputs='json'"),
    ],
)
def test_bad_constraints_name_the_field(params, mention):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(params)
    assert mention in str(info.value)


def test_older_guided_keys_and_string_values():
    assert SamplingParams.from_dict({"guided_json": json.dumps(SCHEMA)}).structured_outputs.json == SCHEMA
    assert SamplingParams.from_dict({"guided_json_object": "true"}).structured_outputs.json_object is True
    assert SamplingParams.from_dict({"guided_choice": ["a", "b"]}).structured_outputs.choice == ("a", "b")
    so = SamplingParams.from_json(json.dumps({"structured_outputs": {"regex": "a+"}})).structured_outputs
    assert so.key == ("regex", "a+", False)
    assert SamplingParams().structured_outputs is None


def test_grammar_that_never_compiles_fails_after_the_timeout(demo_model_dir, monkeypatch):
    from inflight.engine.structured_output import compile_pool as structured_output

    engine = _engine(demo_model_dir)
    engine.add_request("stuck", "Hello", SamplingParams(max_tokens=4, guided_regex="a+"))
    request = GrammarCompile(StructuredOutputsParams(regex="a+"), CompileJob(started=time.monotonic()))
    future = request.job.future = cf.Future()  # a compile that began and never ends
    _replace_compile(engine, "stuck", request)
    engine.structured_outputs.pool._cache[request.params.key] = request.job
    assert engine.step() == []  # still compiling: waits
    monkeypatch.setattr(structured_output, "COMPILE_TIMEOUT_S", 0.0)
    (out,) = engine.step()
    assert out.finished and "structured_outputs.regex" in out.error and "compilation took over" in out.error
    assert not engine.has_unfinished_requests()
    # A queued compile is dropped, and the timeout is no verdict on the grammar: the next request recompiles.
    assert future.cancelled() and not request.is_ready
    assert request.params.key not in engine.structured_outputs.pool._cache


def test_compile_timeout_counts_only_the_compile_not_the_queue(demo_model_dir, monkeypatch):
    import threading

    from inflight.engine.structured_output import compile_pool as structured_output

    manager = _engine(demo_model_dir).structured_outputs.pool
    manager.request(StructuredOutputsParams(regex="a")).future.result(timeout=60)  # the pool exists now
    gate = threading.Event()
    pool = manager._lane(StructuredOutputsParams(regex="b+").key)  # small constraints' lane
    busy = [pool.submit(gate.wait) for _ in range(pool._max_workers)]  # other, slow compiles
    try:
        queued = manager.request(StructuredOutputsParams(regex="b+"))
        monkeypatch.setattr(structured_output, "COMPILE_TIMEOUT_S", 0.0)
        assert queued.error() is None  # queued behind the others: it has not begun compiling
        monkeypatch.setattr(structured_output, "COMPILE_QUEUE_TIMEOUT_S", 0.0)
        waited = manager.request(StructuredOutputsParams(regex="c+"))
        assert "waited over 0s for a grammar compiler" in waited.error() and waited.future.cancelled()
    finally:
        gate.set()
    assert all(f.result(timeout=60) for f in busy) and queued.future.result(timeout=60) is not None
    assert queued.error() is None and queued.is_ready
    manager.close()


def test_engine_close_shuts_the_compile_pool_down(demo_model_dir):
    import threading

    engine = _engine(demo_model_dir)
    engine.structured_outputs.pool.request(StructuredOutputsParams(regex="a")).future.result(timeout=60)
    engine.structured_outputs.pool.request(StructuredOutputsParams(regex="a" * 5000)).future.result(timeout=60)
    manager = engine.structured_outputs
    workers = [
        *manager.pool._pool._threads,
        *manager.pool._small_pool._threads,
    ]  # this engine's (other tests leave theirs)
    assert workers and all(t in threading.enumerate() for t in workers)
    engine.close()
    for t in workers:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in workers)


def test_padding_ids_past_the_tokenizer_are_never_allowed(demo_model_dir):
    """A checkpoint's lm_head may be wider than its tokenizer: those ids have no text and stay masked."""
    from inflight.engine.structured_output import StructuredOutputManager

    engine = _engine(demo_model_dir)
    tok_vocab = engine.tokenizer.get_vocab_size()
    manager = StructuredOutputManager(lambda: engine.tokenizer, tok_vocab + 70, [2], engine.config)
    manager.add("r", StructuredOutputsParams(json_object=True))
    manager.pool.request(StructuredOutputsParams(json_object=True)).future.result(timeout=60)
    bitmask, rows = manager.grammar_bitmask(["r"])
    bits = ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: tok_vocab + 70]
    assert rows.tolist() == [0] and bits[:tok_vocab].any() and not bits[tok_vocab:].any()
    special = [i for i, t in engine.tokenizer.get_added_tokens_decoder().items() if t.special]
    assert not bits[special].any()  # <unk>, <s>, </s>: no text to match a grammar with


def test_guided_key_folds_into_structured_outputs_and_survives_replace():
    import dataclasses

    p = SamplingParams(guided_regex="a+", max_tokens=4)
    assert p.guided_regex is None and p.structured_outputs.regex == "a+"
    q = dataclasses.replace(p, max_tokens=8)
    assert q.structured_outputs == p.structured_outputs and q.max_tokens == 8


def test_json_object_gives_an_object(demo_model_dir):
    """Any JSON object: with free keys the random model rambles inside its first string until max_tokens
    (checked here as an object's opening), so only finished outputs are parsed. The schema path it shares
    is validated to the end by the 64-request test."""
    engine = _engine(demo_model_dir)
    so = {"json_object": True, "disable_any_whitespace": True}
    reqs = {
        f"o{i}": ("Hello", SamplingParams(temperature=1, seed=i, max_tokens=24, structured_outputs=so))
        for i in range(4)
    }
    r = _run(engine, reqs)
    assert all(v["text"].startswith('{"') for v in r.values())
    assert all(isinstance(json.loads(v["text"]), dict) for v in r.values() if v["finish_reason"] == "stop")
    unconstrained = _run(engine, {"u": ("Hello", SamplingParams(temperature=1, seed=0, max_tokens=24))})
    assert not unconstrained["u"]["text"].startswith('{"')


def test_json_rows_never_allow_raw_control_characters(demo_model_dir):
    """xgrammar 0.2.8 lets a maxLength string take raw control bytes (mlc-ai/xgrammar#800), which strict
    JSON parsers reject: the engine masks them for JSON constraints, and only for those."""
    import xgrammar as xgr

    engine = _engine(demo_model_dir)
    manager = engine.structured_outputs
    bounded = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 9}}, "required": ["s"]}
    cases = [
        ({"json": bounded}, '{"s": "'),
        ({"json": bounded, "disable_any_whitespace": True}, '{"s": "'),
        ({"regex": "[\x01-z]+"}, ""),
    ]
    ids = []
    for i, (so, prefix) in enumerate(cases):
        params = StructuredOutputsParams.from_value(so)
        manager.add(f"r{i}", params)
        manager.pool.request(params).future.result(timeout=60)
        assert manager._requests[f"r{i}"].get_matcher().accept_string(prefix) or not prefix  # inside the string
        ids.append(f"r{i}")
    bitmask, _rows = manager.grammar_bitmask(ids)
    vocab = manager.vocab_size

    def unpack(words: torch.Tensor) -> torch.Tensor:
        return ((words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :vocab].bool()

    bits = unpack(bitmask)
    raw = xgr.allocate_token_bitmask(1, vocab)
    manager._requests["r0"].get_matcher().fill_next_token_bitmask(raw, 0)
    raw_bits = unpack(raw)[0]
    bell, tab = engine.tokenizer.token_to_id("ć"), engine.tokenizer.token_to_id("ĉ")  # byte-level \x07, \t
    assert raw_bits[bell], "the grammar itself allows a raw BEL inside the bounded string"
    assert not bits[0, bell] and not bits[1, bell]  # masked for JSON
    assert raw_bits[tab], "the grammar itself allows a raw tab inside the bounded string"
    assert not bits[0, tab] and not bits[1, tab]  # masked in both modes: spaces and newlines remain whitespace
    assert bits[2, bell]  # a regex that asks for control characters gets them


def test_a_grammar_that_allows_no_token_fails_only_its_request(demo_model_dir):
    # xgrammar compiles these, but no string matches them: the first mask allows no token.
    engine = _engine(demo_model_dir)
    r = _run(
        engine,
        {
            "left": ("Hello", SamplingParams(max_tokens=6, structured_outputs={"grammar": 'root ::= root "a"'})),
            "empty set": ("Hello", SamplingParams(max_tokens=6, structured_outputs={"regex": "[^\\x00-\\U0010FFFF]"})),
            "good": ("Hello", SamplingParams(temperature=0, max_tokens=4)),
        },
    )
    assert r["left"]["error"].startswith("structured_outputs.grammar matches nothing: "), r["left"]["error"]
    assert r["empty set"]["error"].startswith("structured_outputs.regex matches nothing: "), r["empty set"]["error"]
    assert r["good"]["error"] is None and len(r["good"]["tokens"]) == 4
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0
