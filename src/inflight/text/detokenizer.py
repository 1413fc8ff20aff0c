"""Incremental detokenization: text deltas that never split a UTF-8 character, get the spaces of
byte-level BPE and SentencePiece tokenizers right, and never leak a stop string.

vLLM's window scheme: decode a short window of ids (a few already-emitted tokens of context, then the
new ones) and emit what it adds to the text of the context alone. Decoders are not concatenative (a
SentencePiece decoder drops the leading space of the first token of each decode call, a byte-level
one needs a character's bytes together, ByteFallback turns a whole run of <0xNN> tokens into U+FFFDs
if the run does not start on a character), so the context is what makes the new text come out
right: it always starts on a character boundary, and for the first output tokens it is the tail of
the prompt.
"""

from __future__ import annotations

import tokenizers

_REPLACEMENT = "\ufffd"  # what the decoders produce for an incomplete UTF-8 byte sequence
# Already-emitted tokens kept in the window as context (at least; more if characters are long).
_CONTEXT = 3
# Once the window holds this many tokens it restarts closer to its end: short decodes.
_MAX_WINDOW = 6
# How far back into the prompt to look for a context that starts on a character boundary.
_MAX_PROMPT_CONTEXT = 24


class IncrementalDetokenizer:
    """One request's output text, streamed. The deltas concatenate to the text the output tokens add
    after the prompt: `tokenizer.decode(output_ids)` for byte-level BPE; for SentencePiece-style
    decoders it keeps the first token's leading space when there is a prompt (as vLLM does), which
    `decode(output_ids)` alone would drop."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop = [s for s in stop if s]
        # vLLM's scheme: while stop strings are checked, the last (longest stop - 1) characters are held
        # back, since they may begin one; each step searches only the held text plus the new text. Memory
        # and time are linear in the stop strings' length.
        self._max_hold = max((len(s) - 1 for s in self.stop), default=0)
        # Skipped special tokens are dropped before they reach the window, so the context is always real
        # text: a window that started with a skipped token would lose the next token's leading space.
        self._skipped = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._window, self._prefix_text = self._prompt_context(prompt_token_ids)
        self._read = len(self._window)  # window[:read] is context, its text _prefix_text (None: to decode)
        # Window positions known to be character boundaries (all text before them decoded): the places
        # where the window may restart. 0 always is one.
        self._marks = [0, self._read]
        self._pending = ""  # decoded text not emitted yet: it may begin a stop string
        # How many leading characters of _pending came before stop strings were checked (min_tokens): a
        # stop string may begin in them but must end after them, as in vLLM.
        self._unchecked = 0
        self.stop_string: str | None = None  # the stop string that ended the text, once one did

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> tuple[str, bool]:
        """Append tokens; return (text delta safe to emit now, stop_string_hit). With `check_stop`
        False (within min_tokens) no stop string may end in the new text, but the text is still held
        back, since a stop string that ends later may begin in it."""
        if self.stopped:
            return "", True
        self._push(new_token_ids)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        return self._consume(self._decode(self._window), check_stop=check_stop)

    def flush(self, check_stop: bool = True) -> tuple[str, bool]:
        """The request finished for another reason (length, eos, abort): release any held-back text.
        Returns (text, stop_string_hit): the released text may still complete a stop string (only with
        `check_stop`, i.e. past min_tokens)."""
        if self.stopped:
            return "", True
        if self._read < len(self._window):
            if self._prefix_text is None:
                self._prefix_text = self._decode(self._window[: self._read])
            return self._consume(self._decode(self._window), final=True, check_stop=check_stop)
        return self._release(final=True, check_stop=check_stop)

    # -- a step is _push, decode, _consume: split so a batch can share one decode_batch call ------------

    def _push(self, new_token_ids: list[int]) -> None:
        if self._skipped:
            self._window.extend(t for t in new_token_ids if t not in self._skipped)
        else:
            self._window.extend(new_token_ids)

    def _consume(self, full: str, final: bool = False, check_stop: bool = True) -> tuple[str, bool]:
        """Take the decoded window's text; emit what it adds to the context's."""
        prefix = self._prefix_text
        # Hold back while the window ends inside a character (decoders give U+FFFD for the partial
        # bytes) or while its text is not yet past the context's (a token that completes nothing).
        if final or (not full.endswith(_REPLACEMENT) and len(full) >= len(prefix)):
            self._pending += full[len(prefix) :]
            self._read = len(self._window)
            self._prefix_text = full
            self._marks.append(self._read)
            if self._read > _MAX_WINDOW:
                self._restart()
        return self._release(final, check_stop)

    def _restart(self) -> None:
        """Drop all but the last >= _CONTEXT tokens, cut at a character boundary; the new context's
        text is decoded with the next step's window."""
        start = max(m for m in self._marks if m <= self._read - _CONTEXT)
        if start > 0:
            self._window = self._window[start:]
            self._read -= start
            self._marks = [m - start for m in self._marks if m >= start]
            self._prefix_text = None

    def _prompt_context(self, prompt_token_ids: list[int]) -> tuple[list[int], str | None]:
        """The shortest prompt tail of >= _CONTEXT tokens whose text has no U+FFFD (so it starts on a
        character), with its text; else the last _CONTEXT tokens, text to be decoded."""
        ids = self._keep(prompt_token_ids[-2 * _MAX_PROMPT_CONTEXT :])[-_MAX_PROMPT_CONTEXT:]
        for n in range(min(_CONTEXT, len(ids)), len(ids) + 1):
            text = self._decode(ids[-n:]) if n else ""
            if _REPLACEMENT not in text:
                return ids[len(ids) - n :], text
        return ids[-_CONTEXT:], None

    def _release(self, final: bool, check_stop: bool = True) -> tuple[str, bool]:
        pending = self._pending
        if not pending:
            return "", False
        if self.stop:
            if check_stop:
                # Emitted text never ends inside a stop string's possible start, so a stop string can
                # only begin in the pending text; it must end past the unchecked part.
                hit, end, first = -1, -1, None
                for stop in self.stop:
                    i = pending.find(stop, max(0, self._unchecked - len(stop) + 1))
                    if i >= 0 and (hit < 0 or i < hit):
                        hit, end, first = i, i + len(stop), stop
                if hit >= 0:
                    self.stop_string = first
                    self._pending = ""
                    return pending[: end if self.include_stop_str_in_output else hit], True
            held = 0 if final else min(self._max_hold, len(pending))
            # Of the held text, what was unchecked stays so (a step may add no text: a partial character).
            self._unchecked = max(0, self._unchecked - (len(pending) - held)) if check_stop else held
            if held:
                self._pending = pending[-held:]
                return pending[:-held], False
        self._pending = ""
        return pending, False

    def _keep(self, ids: list[int]) -> list[int]:
        return [t for t in ids if t not in self._skipped]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _special_ids(tokenizer: tokenizers.Tokenizer) -> frozenset[int]:
    return frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)


def detokenize_batch(
    detoks: list[IncrementalDetokenizer], new_tokens: list[list[int]], check_stop: list[bool] | None = None
) -> list[tuple[str, bool]]:
    """`update` on every sequence, with one `decode_batch` call for all sequences sharing a tokenizer."""
    results: list[tuple[str, bool]] = [("", True)] * len(detoks)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, d in enumerate(detoks):
        if not d.stopped:
            groups.setdefault((id(d.tokenizer), d.skip_special_tokens), []).append(i)
    for (_, skip), members in groups.items():
        windows = []
        for i in members:
            d = detoks[i]
            d._push(new_tokens[i])
            if d._prefix_text is None:
                windows.append(d._window[: d._read])
            windows.append(d._window)
        texts = iter(detoks[members[0]].tokenizer.decode_batch(windows, skip_special_tokens=skip))
        for i in members:
            d = detoks[i]
            if d._prefix_text is None:
                d._prefix_text = next(texts)
            results[i] = d._consume(next(texts), check_stop=True if check_stop is None else check_stop[i])
    return results
