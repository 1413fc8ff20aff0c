"""A step that fails because of one request fails that request alone; the others go on, token for token."""

from __future__ import annotations

import pytest

from inflight import LLM, SamplingParams

PROMPTS = ["The model runs fast", "Hello world", "A city of light", "Once upon a time", "Numbers: 1 2 3"]
PARAMS = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(demo_model_dir, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64, max_model_len=128)


def run(llm, prompts) -> dict[str, object]:
    """Every request's output tokens, or its error text."""
    engine = llm.engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, PARAMS)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    errors: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.error is not None:
                errors[out.request_id] = (out.error_kind, out.error)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return {rid: errors.get(rid, tokens[rid]) for rid in ids}


def poison(monkeypatch, obj, name: str, bad: str, after_calls: int = 0) -> None:
    """`obj.name` raises whenever request `bad` is in its batch (after `after_calls` calls)."""
    real, calls = getattr(obj, name), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        seqs = args[0].seqs if name == "execute" else args[1]
        if calls[0] > after_calls and any(s.request_id == bad for s in seqs):
            raise RuntimeError(f"{name} cannot take {bad}")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)


@pytest.mark.parametrize(("where", "after"), [("execute", 0), ("execute", 3), ("sampler", 0), ("sampler", 5)])
def test_only_the_request_that_breaks_a_step_fails(llm, monkeypatch, where, after):
    clean = run(llm, PROMPTS)
    poison(monkeypatch, llm.engine.runner if where == "execute" else llm.engine, where, "r2", after)
    hurt = run(llm, PROMPTS)
    kind, message = hurt.pop("r2")
    assert kind == "internal" and "cannot take r2" in message
    assert hurt == {rid: toks for rid, toks in clean.items() if rid != "r2"}
    monkeypatch.undo()
    assert run(llm, PROMPTS) == clean  # and the engine serves on


def test_a_failure_of_every_request_is_raised_not_blamed_on_each(llm, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(llm.engine.runner, "execute", broken)
    llm.engine.add_request("a", "one", PARAMS)
    llm.engine.add_request("b", "two", PARAMS)
    with pytest.raises(RuntimeError, match="the device is gone"):
        llm.engine.step()
    monkeypatch.undo()
    for rid in ("a", "b"):
        llm.engine.abort_request(rid)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
