"""The offline API: argument validation, stopping rules, seeded sampling, aborts and block hygiene."""

import json
import shutil
from pathlib import Path

import pytest

from inflight import LLM, InvalidRequestError, SamplingParams
from inflight.config import ConfigError

PROMPTS = ["The model runs fast", "Hello world", "A city of light", "héllo wörld 日本語 🙂"]


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(demo_model_dir, max_num_seqs=40, max_num_batched_tokens=256, num_kv_blocks=256, max_model_len=128)


@pytest.fixture(autouse=True)
def no_leaked_blocks(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(temperature=-0.5), r"temperature=-0.5 is invalid: must be >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 is invalid: must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5 is invalid"),
        (dict(max_tokens=0), r"max_tokens=0 is invalid: must be >= 1"),
        (dict(min_p=2.0), r"min_p=2.0 is invalid: must be in \[0, 1\]"),
        (dict(top_k=-3), r"top_k=-3 is invalid"),
        (dict(min_tokens=9, max_tokens=4), r"min_tokens=9 is invalid: must be in \[0, max_tokens=4\]"),
        (dict(logprobs=-1), r"logprobs=-1 is invalid: must be >= 0"),
        (dict(n=2), r"n=2 is invalid: must be 1"),
        (dict(best_of=3), r"best_of=3 is invalid"),
        (dict(seed=2**64), r"seed=18446744073709551616 is invalid: must be in \[0, 2\*\*63\)"),
        (dict(max_tokens="5"), r"max_tokens='5' is invalid: must be of type int"),
        (dict(logit_bias={"7": 100.5}), r"logit_bias\[7\]=100.5 is invalid: must be a number in \[-100, 100\]"),
        (dict(logit_bias={"x": 1}), r"logit_bias='x' is invalid: must be keyed by non-negative token ids"),
        (dict(logit_bias=[1, 2]), r"logit_bias=\[1, 2\] is invalid: must be an object"),
    ],
)
def test_bad_sampling_params_name_field_value_and_range(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_from_dict_coerces_strings_and_rejects_unknown_keys():
    p = SamplingParams.from_dict({"max_tokens": "64", "temperature": "0.5", "ignore_eos": "true", "stop": "x"})
    assert (p.max_tokens, p.temperature, p.ignore_eos, p.stop) == (64, 0.5, True, ["x"])
    with pytest.raises(InvalidRequestError, match=r"unknown key 'temprature'; known keys: .*temperature"):
        SamplingParams.from_dict({"temprature": 1})
    with pytest.raises(InvalidRequestError, match=r"max_tokens='lots' is invalid: must be a int"):
        SamplingParams.from_dict({"max_tokens": "lots"})
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        SamplingParams.from_json("{max_tokens: 3")


def test_bad_prompts_are_rejected_and_engine_keeps_serving(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, \d+\)"):
        llm.generate([[5, 10**6]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match=r"prompt has 200 tokens; it must be shorter than max_model_len=128"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match=r"max_tokens=127 is too large: .* max_tokens <= \d+"):
        llm.generate("hello there", SamplingParams(max_tokens=127))
    with pytest.raises(InvalidRequestError, match="2 entries for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    out = llm.generate("still serving", SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.token_ids) == 3


def test_bad_engine_args_are_named(demo_model_dir):
    with pytest.raises(ConfigError, match=r"scheduling_policy='fifo' is invalid: must be continuous or static"):
        LLM(demo_model_dir, scheduling_policy="fifo")
    with pytest.raises(ConfigError, match=r"unknown engine argument\(s\) \['max_seqs'\]"):
        LLM(demo_model_dir, max_seqs=3)
    with pytest.raises(ConfigError, match=r"max_length.*needs max_model_len=2048 tokens per sequence"):
        LLM(demo_model_dir, kv_reservation="max_length", num_kv_blocks=8)


def test_request_that_can_never_fit_the_kv_cache_is_rejected_up_front(demo_model_dir):
    small = LLM(demo_model_dir, num_kv_blocks=2, block_size=16)
    with pytest.raises(InvalidRequestError, match="exceeds the KV cache capacity of 32 tokens"):
        small.generate("hello", SamplingParams(max_tokens=40))


def test_max_tokens_and_min_tokens(llm):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(greedy.token_ids) == 8 and greedy.finish_reason == "length"
    stop_tok = greedy.token_ids[2]
    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_tok]))[0]
    assert stopped.token_ids == greedy.token_ids[:3] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop_tok and greedy.stop_reason is None  # vLLM's stop_reason
    held = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, min_tokens=5, stop_token_ids=[stop_tok])
    )[0]
    assert len(held.token_ids) >= 5 and stop_tok not in held.token_ids[:4]


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(llm):
    greedy = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12))[0]
    text = greedy.text
    stop = text[len(text) // 3 : len(text) // 3 + 5]  # five characters, likely across a token boundary
    assert stop.strip(), text
    engine = llm  # the engine with the output processor: text per step
    engine.add_request("stop-test", PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            final = out
    streamed = "".join(deltas)
    assert streamed == text[: text.index(stop)]
    assert stop not in streamed and final.finish_reason == "stop" and final.stop_reason == stop


def test_stop_string_straddling_the_min_tokens_boundary_stops(llm):
    # vLLM: stop strings are looked for once the output has more than min_tokens tokens, and one must end
    # in the text of such a token, but it may begin in the text of the first min_tokens.
    greedy = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12))[0]
    text, ids = greedy.text, greedy.token_ids
    ends = [len(llm.tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)]
    for m in range(2, 11):  # the stop string: last character of token m-1, all of token m, one more
        start, stop = ends[m - 1] - 1, text[ends[m - 1] - 1 : ends[m] + 1]
        if start >= 0 and ends[m - 1] < ends[m] < ends[m + 1] and text.find(stop) == start:
            break
    else:
        pytest.fail(f"no stop string across three tokens in {text!r}")
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, min_tokens=m, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == text[:start]
    # One that ends in token m (the last of min_tokens) is not a stop string.
    inside = text[start : ends[m - 1] + 1]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, min_tokens=m, stop=[inside]))[0]
    assert out.text.startswith(text[: ends[m - 1] + 1])


def test_ignore_eos_keeps_generating(llm, demo_model_dir, tmp_path):
    # A copy of the demo checkpoint whose EOS is the token greedy decoding emits third.
    first = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=6))[0]
    for f in Path(demo_model_dir).iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"eos_token_id": first.token_ids[2]}))
    eos_llm = LLM(tmp_path, num_kv_blocks=64)
    stops = eos_llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=6))[0]
    assert stops.token_ids == first.token_ids[:3] and stops.finish_reason == "stop"
    goes_on = eos_llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert goes_on.token_ids == first.token_ids and goes_on.finish_reason == "length"


def test_seeded_sampling_is_batch_invariant(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    alone = llm.generate(PROMPTS[0], params)[0].token_ids
    crowd_params = [SamplingParams(temperature=0.8, seed=i, max_tokens=6 + i % 9) for i in range(32)]
    crowd_prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i % 3) for i in range(32)]
    outs = llm.generate(
        crowd_prompts[:16] + [PROMPTS[0]] + crowd_prompts[16:], crowd_params[:16] + [params] + crowd_params[16:]
    )
    assert outs[16].token_ids == alone
    other_seed = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=12))
    assert other_seed[0].token_ids != alone


def test_unseeded_requests_differ_and_temperature_zero_is_greedy(llm):
    outs = llm.generate([PROMPTS[0]] * 4, SamplingParams(temperature=1.5, max_tokens=10))
    assert len({tuple(o.token_ids) for o in outs}) > 1
    greedy = llm.generate([PROMPTS[0]] * 2, SamplingParams(temperature=0, max_tokens=10))
    assert greedy[0].token_ids == greedy[1].token_ids


def test_logit_bias_forces_or_forbids_a_token_and_leaves_other_rows_alone(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(PROMPTS[0], greedy)[0].token_ids
    forced_id = next(t for t in range(100, 200) if t not in plain)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    outs = llm.generate(
        [PROMPTS[0]] * 4,
        [
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={str(forced_id): 100}),
            SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logit_bias={forced_id: 100}),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100}),
            greedy,
        ],
    )
    assert outs[0].token_ids == [forced_id] * 6  # +100: the token every time, greedy or sampled
    assert outs[1].token_ids == [forced_id] * 6
    assert plain[0] not in outs[2].token_ids  # -100: never
    assert outs[3].token_ids == plain  # its neighbours' biases do not touch a row
    assert llm.generate(PROMPTS[0], sampled)[0].token_ids != outs[1].token_ids


def test_logit_bias_outside_the_vocabulary_or_over_the_bound_is_refused(llm, demo_model_dir):
    with pytest.raises(InvalidRequestError, match=r"logit_bias has token id\(s\) \[1000000\] outside the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={1_000_000: 1}))
    small = LLM(demo_model_dir, num_kv_blocks=16, max_logit_bias=2)
    with pytest.raises(InvalidRequestError, match="logit_bias has 3 entries: the limit is max_logit_bias=2"):
        small.generate(PROMPTS[0], SamplingParams(logit_bias={1: 1, 2: 1, 3: 1}))


def test_logprobs_are_returned_when_asked(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy picks the most likely token
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    for i in range(6):
        engine.add_request(f"ab{i}", PROMPTS[i % 4] * 3, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used = engine.block_manager.num_used_blocks
    assert used > 0
    engine.abort_request("ab0")
    engine.abort_request("ab5")
    assert engine.block_manager.num_used_blocks < used
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.finish_reason
            if out.request_id in ("ab1", "ab2", "ab3", "ab4") and not out.finished:
                engine.abort_request(out.request_id)
    assert finals["ab0"] == finals["ab5"] == "abort"
    assert set(finals) == {f"ab{i}" for i in range(6)}


def test_utf8_streaming_never_emits_broken_characters(llm):
    engine = llm  # the engine with the output processor: text per step
    for seed in range(8):
        engine.add_request(f"u{seed}", "日本語 🙂 café", SamplingParams(temperature=2.0, seed=seed, max_tokens=24))
    deltas: dict[str, list[str]] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out.new_text)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, parts in deltas.items():
        full = engine.tokenizer.decode(tokens[rid], skip_special_tokens=True)
        assert "".join(parts) == full
        assert sum(p.count("\ufffd") for p in parts[:-1]) <= full.count("\ufffd")


def test_generate_interrupted_aborts_what_it_added(demo_model_dir):
    from inflight import LLM

    llm = LLM(demo_model_dir, max_num_seqs=4, num_kv_blocks=64, max_model_len=256)
    real_step = llm.engine.step
    calls = {"n": 0}

    def interrupted_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    llm.engine.step = interrupted_step
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hello world", "The model"], params)
    llm.engine.step = real_step
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_blocks == 0
    (out,) = llm.generate(["Why"], SamplingParams(temperature=0, max_tokens=5))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_add_request_failing_after_registration_unregisters(demo_model_dir):
    from inflight import LLM

    llm = LLM(demo_model_dir, max_num_seqs=4, num_kv_blocks=64, max_model_len=256)
    engine = llm.engine
    real_add = engine.scheduler.add

    def failing_add(seq):
        raise RuntimeError("scheduler refused")

    engine.scheduler.add = failing_add
    with pytest.raises(RuntimeError, match="scheduler refused"):
        engine.add_request("r1", "Hello world", SamplingParams(max_tokens=4))
    engine.scheduler.add = real_add
    assert not engine.has_unfinished_requests()
    engine.add_request("r1", "Hello world", SamplingParams(temperature=0, max_tokens=4))  # the id is free again
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].request_id == "r1"
    assert engine.num_prompt_tokens == len(outs[-1].prompt_token_ids)
