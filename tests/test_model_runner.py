"""The runner's per-step checks on what the scheduler hands it."""

from __future__ import annotations

import pytest

from inflight import SamplingParams
from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine


def test_a_block_table_too_short_for_its_tokens_is_refused(demo_model_dir):
    # Padding fills short table rows with block 0, which may hold another request's cached prefix: a table
    # that does not cover its tokens must stop the step rather than write K/V into someone else's block.
    engine = LLMEngine(demo_model_dir, EngineConfig(num_kv_blocks=32, block_size=8, max_num_seqs=2))
    engine.add_request("a", "Hello there, a prompt of more than one block of tokens", SamplingParams(max_tokens=2))
    engine.add_request("b", "Hi", SamplingParams(max_tokens=2))
    sched = engine.scheduler.schedule()
    long_seq = max(sched.seqs, key=lambda s: len(s.block_table))
    assert len(long_seq.block_table) > 1
    long_seq.block_table = long_seq.block_table[:-1]
    with pytest.raises(AssertionError, match="block table does not cover"):
        engine.runner.prepare(sched)


def test_small_steps_run_on_one_thread_when_openmp_threads_sleep(demo_model_dir, monkeypatch):
    """The per-op path (no cpu_forward): PASSIVE OpenMP threads pay a wake-up per op, so a step with few
    tokens runs its forward on the calling thread, a big one on every thread; the process-wide count is
    put back after each forward."""
    import torch

    from inflight import LLM
    from inflight.executor.cpu_forward import CpuForward

    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("one core: nothing to choose")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(CpuForward, "supported", staticmethod(lambda model, ops: False))
    llm = LLM(demo_model_dir, num_kv_blocks=64, max_num_batched_tokens=256)
    runner = llm.engine.runner
    assert runner.cpu_forward is None and 1 < runner.single_thread_tokens < 256
    seen = []
    forward = runner.forward

    def spy(input_ids, *args):
        seen.append((len(input_ids), torch.get_num_threads()))
        return forward(input_ids, *args)

    monkeypatch.setattr(runner, "forward", spy)
    long_prompt = list(range(5, 5 + runner.single_thread_tokens + 20))
    llm.generate([long_prompt], SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen[0] == (len(long_prompt), before)  # the prompt: every thread
    assert seen[1:] == [(1, 1), (1, 1)]  # one token a step: one thread
    assert torch.get_num_threads() == before  # and the count is back for everyone else
    other = [t + 300 for t in long_prompt]  # not the same prompt: no prefix-cache hit to shrink it
    llm.generate([other], SamplingParams(max_tokens=1, ignore_eos=True))
    assert seen[-1] == (len(other), before)


def test_the_layer_stack_in_one_call_starts_every_step_on_every_thread(demo_model_dir, monkeypatch):
    """cpu_forward wakes the threads once a step: no step size starts on one thread, however small (the
    chooser tries one thread only every 64th step of a size)."""
    import torch

    from inflight import LLM
    from inflight.executor.cpu_forward import CpuForward

    if torch.get_num_threads() < 2:
        pytest.skip("one core: nothing to choose")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    llm = LLM(demo_model_dir, num_kv_blocks=64, max_num_batched_tokens=256)
    runner = llm.engine.runner
    if not CpuForward.supported(runner.model, runner.ops):
        pytest.skip("our GEMM does not run this dtype on this CPU: the per-op path runs")
    assert runner.cpu_forward is not None and runner.single_thread_tokens == 0
    seen = []
    forward = runner.cpu_forward.__call__

    def spy(input_ids, *args):
        seen.append(torch.get_num_threads())
        return forward(input_ids, *args)

    monkeypatch.setattr(runner, "cpu_forward", spy)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=70, ignore_eos=True))
    # seen[0] is the prompt; then one-token steps, of which the 64th tries one thread (what the chooser keeps
    # afterwards depends on the times it measured)
    assert len(seen) == 70 and seen[:64] == [torch.get_num_threads()] * 64 and seen[64] == 1


def test_thread_chooser_starts_from_the_rule_and_keeps_what_measured_faster():
    from inflight.executor.model_runner import ThreadChooser

    chooser = ThreadChooser(max_threads=2, single_below=10, explore_every=4)
    picks = []
    for _ in range(8):  # 6 tokens a step: the rule says one thread; every 4th step tries two
        threads = chooser.choose(6)
        picks.append(threads)
        chooser.record(6, threads, 0.010 if threads == 2 else 0.020)  # here two threads are faster
    assert picks[:4] == [1, 1, 1, 2]  # the rule, then one exploration
    assert picks[4:] == [2, 2, 2, 1]  # two measured faster: kept; one is now the one explored
    assert chooser.choose(300) == 2 and chooser.best(300) == 2  # another bucket: its own rule
    assert chooser.best(7) == 2  # 6 and 7 tokens share a bucket


def test_thread_chooser_ignores_one_slow_step_but_follows_a_lasting_slowdown():
    from inflight.executor.model_runner import ThreadChooser

    chooser = ThreadChooser(max_threads=2, single_below=0, explore_every=4)
    for _ in range(16):  # two threads measured at 10 ms a step, one at 20 ms (explored every 4th)
        threads = chooser.choose(8)
        chooser.record(8, threads, 0.010 if threads == 2 else 0.020)
    assert chooser.best(8) == 2
    chooser.record(8, 2, 0.100)  # one hiccup (the VM, a page fault): no reason to leave two threads
    assert chooser.best(8) == 2
    for _ in range(8):  # another process now holds a core: two threads wait on each other at every op
        chooser.record(8, 2, 0.040)
    assert chooser.best(8) == 1


@pytest.mark.parametrize("layer_stack", ["cpu_forward", "per_op"])
def test_outputs_do_not_depend_on_the_thread_count(demo_model_dir, monkeypatch, layer_stack):
    """A step may run on one thread or on all (the chooser, or another host's core count): the logits must
    be the same bits (bf16, prompts and decode steps), or greedy outputs would depend on timing."""
    import torch
    from helpers import PROMPTS, capture_logits

    from inflight import LLM
    from inflight.executor.cpu_forward import CpuForward

    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("one core: nothing to choose")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    if layer_stack == "per_op":
        monkeypatch.setattr(CpuForward, "supported", staticmethod(lambda model, ops: False))
    llm = LLM(
        demo_model_dir, dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64, enable_prefix_caching=False
    )
    runner = llm.engine.runner
    if layer_stack == "cpu_forward" and runner.cpu_forward is None:
        pytest.skip("our GEMM does not run this dtype on this CPU: the per-op path runs")
    runner.threads = None  # the count is set here, for every step
    captured = capture_logits(llm.engine)
    runs = {}
    try:
        for threads in (1, before):
            torch.set_num_threads(threads)
            runner.max_threads = threads
            captured.clear()
            llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
            runs[threads] = [logits for _, _, logits in captured]  # step order: the same schedule both times
    finally:
        torch.set_num_threads(before)
    one, many = runs.values()
    assert len(one) == len(many) > 8
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))
