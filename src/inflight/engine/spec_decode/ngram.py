"""N-gram (prompt lookup) proposer: the last n tokens of a sequence, found earlier in its prompt + output,
propose the k tokens that followed them there (vLLM's `ngram` method).

Each sequence's tokens are kept as int32 bytes, appended as they come, so a lookup is one `bytes.rfind`
per n (a C-speed search for the most recent occurrence) and a step costs microseconds per sequence.
"""

from __future__ import annotations

import numpy as np

_ITEM = 4  # bytes per token id (int32)


class NgramIndex:
    """One sequence's token ids as int32 bytes (append-only; a shrunk list is rebuilt)."""

    __slots__ = ("buf", "num_tokens")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.num_tokens = 0

    def sync(self, prompt: list[int], output: list[int]) -> None:
        n = len(prompt) + len(output)
        if n < self.num_tokens:
            self.buf.clear()
            self.num_tokens = 0
        if n == self.num_tokens:
            return
        start = self.num_tokens
        p = len(prompt)
        if start < p:
            self.buf += np.asarray(prompt[start:], dtype=np.int32).tobytes()
        new = output[max(start - p, 0) :]
        if len(new) == 1:
            self.buf += int(new[0]).to_bytes(_ITEM, "little", signed=True)
        elif new:
            self.buf += np.asarray(new, dtype=np.int32).tobytes()
        self.num_tokens = n


def _rfind_aligned(buf: bytes | bytearray, pattern: bytes, stop: int) -> int:
    """Start of the last token-aligned occurrence of `pattern` ending at or before byte `stop`, or -1."""
    while True:
        at = buf.rfind(pattern, 0, stop)
        if at < 0 or at % _ITEM == 0:  # a byte-level match across token boundaries is not a token match
            return at
        stop = at + len(pattern) - 1


def propose(buf: bytes | bytearray, num_tokens: int, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens following the most recent earlier occurrence of the last n tokens, for the largest n in
    [min_n, max_n] that occurs; [] when none does."""
    if k < 1 or num_tokens < min_n + 1:
        return []
    view = memoryview(buf)
    end = num_tokens * _ITEM
    stop = end - _ITEM  # the match must end before the last token (so at least one token follows it)
    # Upward from min_n: an n-gram that does not occur has no longer one that does, so the usual case (no
    # match) costs one search.
    best_n, best_at = 0, -1
    for n in range(min_n, min(max_n, num_tokens - 1) + 1):
        at = _rfind_aligned(buf, bytes(view[end - n * _ITEM : end]), stop)
        if at < 0:
            break
        best_n, best_at = n, at
    if best_at < 0:
        return []
    first = best_at + best_n * _ITEM
    return np.frombuffer(view[first : min(first + k * _ITEM, end)], dtype=np.int32).tolist()


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._index: dict[object, NgramIndex] = {}

    def propose(self, key: object, prompt: list[int], output: list[int], max_tokens: int) -> list[int]:
        """At most min(k, max_tokens) draft tokens for the sequence `key` (prompt + output so far)."""
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = NgramIndex()
        index.sync(prompt, output)
        return propose(index.buf, index.num_tokens, self.min_n, self.max_n, min(self.k, max_tokens))

    def finish(self, key: object, output: list[int]) -> None:
        self._index.pop(key, None)
