"""The model's logprobs (the vLLM backend's per-token `{token_id: {logprob, rank, decoded_token}}`, the
sampled token first, then the top-N by rank) in OpenAI's two shapes."""

from __future__ import annotations

from typing import Any


def _split(entry: dict[str, dict]) -> tuple[dict, list[dict]]:
    values = list(entry.values())
    sampled = values[0]
    top = sorted((v for v in values if v.get("rank") is not None), key=lambda v: v["rank"])
    return sampled, top


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(entries: list[dict[str, dict]], top_logprobs: int) -> dict[str, Any]:
    """/v1/chat/completions: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for entry in entries:
        sampled, top = _split(entry)
        content.append(
            {
                "token": sampled["decoded_token"],
                "logprob": sampled["logprob"],
                "bytes": _bytes(sampled["decoded_token"]),
                "top_logprobs": [
                    {"token": t["decoded_token"], "logprob": t["logprob"], "bytes": _bytes(t["decoded_token"])}
                    for t in top[:top_logprobs]
                ],
            }
        )
    return {"content": content}


def completion_logprobs(entries: list[dict[str, dict]], top_logprobs: int, offset: int) -> dict[str, Any]:
    """/v1/completions: {tokens, token_logprobs, top_logprobs, text_offset}; offsets count from `offset`
    (the characters of the completion before these tokens)."""
    tokens, token_logprobs, tops, text_offset = [], [], [], []
    for entry in entries:
        sampled, top = _split(entry)
        tokens.append(sampled["decoded_token"])
        token_logprobs.append(sampled["logprob"])
        tops.append({t["decoded_token"]: t["logprob"] for t in top[:top_logprobs]})
        text_offset.append(offset)
        offset += len(sampled["decoded_token"])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": text_offset}
