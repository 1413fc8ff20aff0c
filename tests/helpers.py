"""Shared test helpers: HF reference runs on the same checkpoint."""

from __future__ import annotations

import torch

PROMPTS = [
    "The model runs fast",
    "Hello world",
    "A city of light and music, a river under the mountain",
    "the",
    "Engines build queues while kernels keep the cache warm and the batch full",
    "héllo wörld 日本語 🙂",
    "Small red garden",
    "When the night falls the ocean sings",
    "Tokens flow into blocks",
    "Why",
    "Quiet forest, bright morning, cold river, new story",
    "The server sends the answer",
    "Memory is short; the scheduler must preempt",
    "café naïve über señor",
    "It learns",
    "We wait because the queue grows and the prompt is long and the answer is longer still",
]


# Attention computes one query row three ways (executor/attention/torch_backend.py): a decode row in the
# C++ paged op, a fresh prompt's rows in SDPA over its local K/V, a chunk after cached context in SDPA
# over K/V gathered from the cache. Each sums in its own order, and rounding the result to bf16 shows
# it: ~3e-4 of the output elements differ between the decode op and either SDPA path, ~2e-5 between
# the two SDPA paths (the demo model's 8/4 heads of 32, random bf16 Q/K/V, 96-token contexts). A run
# that computes a position by another path than the baseline did (a later chunk of a split prompt; a
# decoded token recomputed after preemption; the suffix after a prefix-cache hit) then differs. Every
# row through one per-row kernel makes all of these bit-identical (checked by routing every row through
# the decode op); that is what the fused CPU attention op is for.
ATTENTION_PATHS = (
    "attention rounds a row differently in the decode op, in SDPA on a fresh prompt and in SDPA after "
    "cached context (torch_backend.py); passes once every row takes one per-row kernel"
)


@torch.inference_mode()
def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain argmax over HF forward passes: no EOS handling, like `ignore_eos=True`."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


class _LogitsRecorder:
    """Stands in for the runner's model: forwards unchanged, and keeps the logits of every position."""

    def __init__(self, model) -> None:
        self.model = model
        self.last: tuple[list[int], list[int], torch.Tensor] | None = None

    def __call__(self, input_ids, positions, meta, kv_caches, ops):
        hidden = self.model(input_ids, positions, meta, kv_caches, ops)
        self.last = (positions.tolist(), meta.query_start_loc_np.tolist(), self.model.compute_logits(hidden).clone())
        return hidden

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def capture_logits(engine) -> list[tuple[str, list[int], torch.Tensor]]:
    """Wrap `engine.runner` so every step records (request_id, positions, logits [n, V]) per scheduled
    sequence; returns the list it appends to. Production code carries no test hook for this."""
    captured: list[tuple[str, list[int], torch.Tensor]] = []
    runner = engine.runner
    recorder = runner.model = _LogitsRecorder(runner.model)
    execute = runner.execute

    def recording_execute(sched):
        out = execute(sched)
        positions, qsl, logits = recorder.last
        for i, seq in enumerate(sched.seqs):
            captured.append((seq.request_id, positions[qsl[i] : qsl[i + 1]], logits[qsl[i] : qsl[i + 1]]))
        return out

    runner.execute = recording_execute
    return captured
