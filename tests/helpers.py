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
