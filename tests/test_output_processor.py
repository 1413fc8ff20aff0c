"""The output processor on its own: an output of several tokens (a verifying step, or steps that queued up) is cut
at the token that completed a stop string, its logprobs and counts with it; the engine is told to abort only a
request it still runs. Its rules through the engines: test_api, test_limits, test_core, test_spec_decode."""

from __future__ import annotations

import pytest

from inflight.models.loader import load_tokenizer
from inflight.outputs import RequestOutput, TokenLogprob
from inflight.sampling_params import SamplingParams
from inflight.text.output_processor import RequestState, process_outputs

PROMPT = "Tell me a story"
TEXT = " once upon a time there was a fox and a dog"


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return load_tokenizer(demo_model_dir)


def _output(request_id, tokens, logprobs, cumulative, num_output_tokens, **kw) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=[],
        new_token_ids=tokens,
        new_text="",
        finished=kw.pop("finished", False),
        new_logprobs=[TokenLogprob(t, lp, {}) for t, lp in zip(tokens, logprobs)] if logprobs else None,
        cumulative_logprob=cumulative,
        num_output_tokens=num_output_tokens,
        **kw,
    )


def _ends(tokenizer, prompt_ids, ids) -> list[int]:
    """Where each output token's text ends in the output text."""
    base = len(tokenizer.decode(prompt_ids))
    return [len(tokenizer.decode(prompt_ids + ids[: i + 1])) - base for i in range(len(ids))]


def test_an_output_is_cut_at_the_token_that_completes_a_stop_string(tokenizer):
    prompt, ids = tokenizer.encode(PROMPT).ids, tokenizer.encode(TEXT).ids
    ends = _ends(tokenizer, prompt, ids)
    assert len(ids) >= 8 and TEXT[: ends[-1]] == TEXT
    stop = TEXT[ends[3] - 2 : ends[4]]  # ends in token 4 (the second output's third token)
    assert TEXT.find(stop) == ends[3] - 2
    lps = [-0.5, -0.25, -1.125, -0.0625, -2.0, -0.75, -0.375, -1.5]
    state = RequestState(tokenizer, prompt, SamplingParams(stop=[stop], logprobs=0))
    first = _output("r", ids[:2], lps[:2], lps[0] + lps[1], 2)
    cumulative = lps[0] + lps[1]
    for lp in lps[2:8]:
        cumulative += lp
    second = _output("r", ids[2:8], lps[2:8], cumulative, 8)  # six tokens: three after the stop string's end
    a = process_outputs([state], [first])
    assert a.reqs_to_abort == [] and not a.request_outputs[0].finished
    b = process_outputs([state], [second])
    assert b.reqs_to_abort == ["r"]
    out = b.request_outputs[0]
    assert a.request_outputs[0].new_text + out.new_text == TEXT[: ends[3] - 2]
    assert out.new_token_ids == ids[2:5] and [lp.logprob for lp in out.new_logprobs] == lps[2:5]
    assert out.cumulative_logprob == lps[0] + lps[1] + lps[2] + lps[3] + lps[4]
    assert (out.finished, out.finish_reason, out.stop_reason, out.num_output_tokens) == (True, "stop", stop, 5)


def test_a_request_the_engine_finished_is_not_aborted_and_its_error_after_the_stop_is_dropped(tokenizer):
    # The engine finished both (max_tokens; a grammar error) at a token after the stop string: the text ends
    # with "stop" all the same, nothing is left to abort.
    prompt, ids = tokenizer.encode(PROMPT).ids, tokenizer.encode(TEXT).ids
    ends = _ends(tokenizer, prompt, ids)
    stop = TEXT[ends[1] : ends[2]].strip() or TEXT[ends[1] : ends[2]]
    assert TEXT.find(stop) >= ends[1], (stop, TEXT)  # its first occurrence ends in token 2
    params = SamplingParams(stop=[stop], include_stop_str_in_output=True)
    states = [RequestState(tokenizer, prompt, params) for _ in range(2)]
    error = {"error": "grammar", "error_kind": "internal"}
    outs = [
        _output("length", ids[:6], None, 0.0, 6, finished=True, finish_reason="length"),
        _output("error", ids[:6], None, 0.0, 6, finished=True, finish_reason="abort", **error),
    ]
    processed = process_outputs(states, outs)
    assert processed.reqs_to_abort == []
    for out in processed.request_outputs:
        assert out.new_text == TEXT[: TEXT.index(stop) + len(stop)] and out.new_token_ids == ids[:3]
        assert (out.finish_reason, out.stop_reason, out.error, out.num_output_tokens) == ("stop", stop, None, 3)


def test_the_finishing_token_may_complete_a_stop_string_and_held_text_is_flushed(tokenizer):
    # The engine finished the request (max_tokens) at the token that completes " fox": with that stop string
    # it finished by "stop"; with a longer one the text held back for it is flushed, and it stays "length".
    prompt, ids = tokenizer.encode(PROMPT).ids, tokenizer.encode(TEXT).ids
    ends = _ends(tokenizer, prompt, ids)
    n = next(i for i, e in enumerate(ends) if e >= TEXT.index(" fox")) + 1
    stop_hit, stop_missed = TEXT[: ends[n - 1]][-3:], TEXT[: ends[n - 1]][-3:] + "!!"
    assert TEXT.find(stop_hit) == ends[n - 1] - 3
    for stop in (stop_hit, stop_missed):
        state = RequestState(tokenizer, prompt, SamplingParams(stop=[stop]))
        mid = process_outputs([state], [_output("r", ids[: n - 1], None, 0.0, n - 1)]).request_outputs[0]
        final = _output("r", ids[n - 1 : n], None, 0.0, n, finished=True, finish_reason="length")
        last = process_outputs([state], [final])
        out = last.request_outputs[0]
        if stop is stop_hit:
            assert mid.new_text + out.new_text == TEXT[: ends[n - 1] - 3] and out.stop_reason == stop_hit
            assert out.finish_reason == "stop"
        else:
            assert mid.new_text + out.new_text == TEXT[: ends[n - 1]] and out.finish_reason == "length"
        assert last.reqs_to_abort == []


def test_a_request_without_detokenize_passes_its_tokens_through_with_no_text(tokenizer):
    # detokenize=False (a client that makes the text itself): no text, every token and the finish as the engine
    # gave them, beside a request with text in the same call. Stop strings need the text: refused.
    prompt, ids = tokenizer.encode(PROMPT).ids, tokenizer.encode(TEXT).ids
    plain = RequestState(tokenizer, prompt, SamplingParams(detokenize=False))
    texted = RequestState(tokenizer, prompt, SamplingParams())
    assert plain.detokenizer is None
    outs = [_output("a", ids[:3], None, 0.0, 3), _output("b", ids[:3], None, 0.0, 3)]
    a, b = process_outputs([plain, texted], outs).request_outputs
    assert (a.new_text, a.new_token_ids) == ("", ids[:3]) and b.new_token_ids == ids[:3] and b.new_text
    final = _output("a", ids[3:5], None, 0.0, 5, finished=True, finish_reason="length")
    last = process_outputs([plain], [final])
    out = last.request_outputs[0]
    assert (out.new_text, out.new_token_ids, out.finish_reason, last.reqs_to_abort) == ("", ids[3:5], "length", [])
    with pytest.raises(ValueError, match="stop=.*detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
