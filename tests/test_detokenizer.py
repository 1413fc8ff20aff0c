"""Incremental detokenizer on tokenizers built here: byte-level BPE (GPT-2 / Llama-3 / Qwen style),
Metaspace BPE (Mistral style) and BPE with byte fallback and a SentencePiece decoder (Llama-2 style)."""

from __future__ import annotations

import functools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from inflight.text.detokenizer import IncrementalDetokenizer, detokenize_batch

REPLACEMENT = "\ufffd"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "STOP", "end"]
WORDS += ["héllo", "wörld", "café", "naïve", "日本語", "東京", "🙂", "🚀", "Ωmega", "π"]
SPECIAL = ["<s>", "</s>"]


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


@functools.cache
def byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


@functools.cache
def metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIAL], show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


@functools.cache
def byte_fallback() -> Tokenizer:
    """Llama-2 layout: "▁" for spaces, <0xNN> tokens for characters outside the vocabulary."""
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # Trained without most non-ASCII words, so their characters are left to the byte tokens.
    lines = [" ".join(w for w in line.split() if w.isascii() or w == "café") for line in corpus()]
    trainer = trainers.BpeTrainer(vocab_size=250, special_tokens=SPECIAL, show_progress=False)
    base.train_from_iterator(lines, trainer=trainer)
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.add_special_tokens(SPECIAL)
    tok.normalizer = base.normalizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


TOKENIZERS = {"byte_level": byte_level, "metaspace": metaspace, "byte_fallback": byte_fallback}


def test_the_tokenizers_exercise_the_hard_cases():
    bl = byte_level()
    assert any(REPLACEMENT in bl.decode([i]) for i in range(bl.get_vocab_size()))  # bytes of a character
    fb = byte_fallback()
    assert any(t.startswith("<0x") for t in fb.encode("東京 🙂").tokens)  # multi-byte chars split into bytes
    ms = metaspace().encode("the lazy")
    assert ms.tokens[-1] == "▁lazy" and metaspace().decode(ms.ids[-1:]) == "lazy"  # a decode drops its space


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> tuple[list[str], bool]:
    """Feed ids in chunks of the given sizes (cycled); the deltas, with the flush last unless stopped."""
    deltas, at, i = [], 0, 0
    while at < len(ids):
        n = max(1, chunks[i % len(chunks)]) if chunks else 1
        delta, hit = detok.update(ids[at : at + n])
        deltas.append(delta)
        at, i = at + n, i + 1
        if hit:
            return deltas, True
    deltas.append(detok.flush()[0])
    return deltas, False


def random_ids(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Any ids, except that <0xNN> byte tokens come as whole characters, but for one cut at the end.

    ByteFallback decodes a run of byte tokens together and turns the whole run into U+FFFDs when it is
    not valid UTF-8, so on such garbage a character emitted while it was complete later decodes as
    U+FFFDs; a stream cannot take back text, and like vLLM this one emits characters once complete.
    """
    vocab = tok.get_vocab_size()
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    if byte_ids[0] is None:
        return st.lists(st.integers(0, vocab - 1), max_size=40)
    other = st.integers(0, vocab - 1).filter(lambda i: i not in byte_ids)
    text_token = other.filter(lambda i: tok.id_to_token(i) not in SPECIAL)  # ends a run of byte tokens
    char = st.sampled_from("日本語東京🙂🚀éΩπ€\x00\n").map(lambda c: [byte_ids[b] for b in c.encode()])
    pieces = st.lists(st.one_of(other.map(lambda i: [i]), char), max_size=25)
    cut = st.tuples(text_token, char).map(lambda oc: [oc[0], *oc[1][:-1]])  # its own run of byte tokens
    tail = st.one_of(st.just([]), cut)
    return st.tuples(pieces, tail).map(lambda pt: [i for p in pt[0] for i in p] + pt[1])


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(TOKENIZERS)), data=st.data())
def test_deltas_concatenate_to_the_full_decode(kind, data):
    tok = TOKENIZERS[kind]()
    ids = data.draw(random_ids(tok))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=5))
    deltas, hit = stream(IncrementalDetokenizer(tok, [], []), ids, chunks)
    expected = tok.decode(ids, skip_special_tokens=True)
    assert not hit
    assert "".join(deltas) == expected
    if REPLACEMENT not in expected:
        assert not any(REPLACEMENT in d for d in deltas)


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(sorted(TOKENIZERS)), data=st.data())
def test_prompt_context_gives_the_first_token_its_space(kind, data):
    tok = TOKENIZERS[kind]()
    words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
    prompt = tok.encode(data.draw(words)).ids
    output = data.draw(random_ids(tok))
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt, []), output, [1])
    full, before = tok.decode(prompt + output), tok.decode(prompt)
    assert full.startswith(before)
    assert "".join(deltas) == full[len(before) :]
    if kind == "byte_level":  # spaces are part of the tokens: the output decodes the same on its own
        assert "".join(deltas) == tok.decode(output)


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_streaming_a_sentence_after_a_prompt_cut_anywhere(kind):
    tok = TOKENIZERS[kind]()
    text = "the quick brown fox jumps over 日本語 🙂 café"
    ids = text_ids(tok, text)
    for k in range(len(ids)):
        before = tok.decode(ids[:k])
        if not text.startswith(before):  # the prompt ends inside a character
            continue
        deltas, _ = stream(IncrementalDetokenizer(tok, ids[:k], []), ids[k:], [1])
        assert "".join(deltas) == text[len(before) :]
        assert not any(REPLACEMENT in d for d in deltas)


def test_partial_character_is_held_until_complete_and_flushed_at_the_end():
    tok = byte_fallback()
    ids = tok.encode("a 🙂").ids
    assert len([t for t in tok.encode("a 🙂").tokens if t.startswith("<0x")]) == 4
    detok = IncrementalDetokenizer(tok, [], [])
    deltas = [detok.update([i])[0] for i in ids]
    assert deltas[-4:] == ["", "", "", "🙂"]
    cut = IncrementalDetokenizer(tok, [], [])
    assert "".join(cut.update([i])[0] for i in ids[:-1]) == "a "  # the 3 bytes of 🙂 are held
    flushed, _ = cut.flush()  # the request ended mid-character: release what decode gives
    assert REPLACEMENT in flushed and tok.decode(ids[:-1]) == "a " + flushed


def text_ids(tok: Tokenizer, text: str) -> list[int]:
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    return ids


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(TOKENIZERS)), data=st.data())
def test_stop_strings_are_cut_and_never_leaked(kind, data):
    tok = TOKENIZERS[kind]()
    text = " ".join(data.draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=12)))
    ids = text_ids(tok, text)
    n_stops = data.draw(st.integers(1, 3))
    stops = []
    for _ in range(n_stops):  # substrings of the text (so they hit) or words that may not appear
        i = data.draw(st.integers(0, len(text) - 1))
        j = data.draw(st.integers(i + 1, min(len(text), i + 12)))
        stops.append(data.draw(st.sampled_from([text[i:j], "STOP", "fox j", "🙂 c", "zz"])))
    # Generation stops at the first token after which a stop string is in the text, cut at the earliest
    # one there (a longer stop that would have started earlier but never completed does not count).
    expected, stopped = text, False
    for k in range(1, len(ids) + 1):
        prefix = tok.decode(ids[:k])
        hits = [i for i in (prefix.find(s) for s in stops) if i >= 0]
        if hits:
            expected, stopped = prefix[: min(hits)], True
            break

    detok = IncrementalDetokenizer(tok, [], stops)
    sent, hit = "", False
    for i in ids:
        delta, hit = detok.update([i])
        sent += delta
        assert expected.startswith(sent)  # never anything past the first stop string, at any step
        if hit:
            break
    if not hit:
        sent += detok.flush()[0]
    assert hit == stopped
    assert sent == expected


def test_stop_string_spanning_tokens_holds_back_longest_stop_minus_one():
    tok = byte_level()
    ids = text_ids(tok, "the lazy dog STOP end")
    detok = IncrementalDetokenizer(tok, [], ["dog STOP"])
    sent = ""
    for i in ids:
        delta, hit = detok.update([i])
        sent += delta
        if hit:
            break
    assert hit and sent == "the lazy " and detok.update([ids[-1]]) == ("", True)

    held = IncrementalDetokenizer(tok, [], ["dog STOP"])
    out = "".join(held.update([i])[0] for i in text_ids(tok, "the lazy dog ST"))
    assert out == "the lazy"  # the last len("dog STOP") - 1 characters may still begin the stop string
    assert held.flush() == (" dog ST", False)  # finished for another reason: it was not one


def test_include_stop_str_in_output_keeps_the_stop_string():
    tok = byte_level()
    detok = IncrementalDetokenizer(tok, [], ["dog"], include_stop_str_in_output=True)
    sent, hit = "", False
    for i in text_ids(tok, "the lazy dog jumps"):
        delta, hit = detok.update([i])
        sent += delta
        if hit:
            break
    assert hit and sent == "the lazy dog"


def test_stop_strings_are_not_matched_while_check_stop_is_off():
    tok = byte_level()
    ids = text_ids(tok, "the dog and the cat")
    detok = IncrementalDetokenizer(tok, [], ["the"])
    sent = ""
    for k, i in enumerate(ids):
        delta, hit = detok.update([i], check_stop=k >= 2)  # as before min_tokens=3
        sent += delta
        if hit:
            break
    assert hit and sent == "the dog and "  # the first "the" came before min_tokens


def test_a_stop_string_straddling_the_min_tokens_boundary_is_matched():
    # vLLM: the stop string must end in text of a token after min_tokens, but may begin before it.
    tok = byte_level()
    ids = text_ids(tok, "the lazy dog jumps")
    detok = IncrementalDetokenizer(tok, [], ["lazy dog"])
    sent, hit = "", False
    for k, i in enumerate(ids):
        delta, hit = detok.update([i], check_stop=k >= 2)  # as with min_tokens=2: " dog" is the third token
        sent += delta
        if hit:
            break
    assert tok.decode(ids[:2]) == "the lazy"
    assert hit and sent == "the "


def test_a_stop_string_inside_the_first_min_tokens_is_not_matched_at_flush():
    tok = byte_level()
    detok = IncrementalDetokenizer(tok, [], ["lazy dog"])
    sent = "".join(detok.update([i], check_stop=False)[0] for i in text_ids(tok, "the lazy dog"))
    rest, hit = detok.flush(check_stop=False)  # finished (length) before min_tokens was reached
    assert not hit and sent + rest == "the lazy dog"


def test_text_from_before_min_tokens_stays_unchecked_across_steps_that_add_no_text():
    tok = byte_fallback()
    ids = tok.encode("lazy dog 🙂🙂").ids
    n = len(tok.encode("lazy dog").ids)
    assert tok.decode(ids[: n + 2]).endswith(REPLACEMENT)  # the emoji's bytes: steps that complete nothing
    detok = IncrementalDetokenizer(tok, [], ["dog", "a longer stop string"])  # held text holds a "dog"
    deltas = [detok.update([i], check_stop=k >= n)[0] for k, i in enumerate(ids)]
    assert not detok.stopped and "".join(deltas) + detok.flush()[0] == tok.decode(ids)


def test_a_stop_string_completed_at_flush_is_reported():
    tok = byte_fallback()
    ids = tok.encode("a 🙂").ids
    detok = IncrementalDetokenizer(tok, [], ["\ufffd"])
    text = "".join(detok.update([i])[0] for i in ids[:-1])  # the 3 bytes of 🙂 are held as incomplete
    flushed, hit = detok.flush()  # ends mid-character: decode gives U+FFFD, which is the stop string
    assert hit and text + flushed == "a "


def test_long_stop_strings_cost_linear_memory():
    import tracemalloc

    tok = byte_level()
    stop = "x" * 200_000  # the old prefix set held every prefix: ~20 GB
    tracemalloc.start()
    detok = IncrementalDetokenizer(tok, [], [stop] * 4)
    for i in text_ids(tok, "the lazy dog"):
        detok.update([i])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 << 20
    assert detok.flush() == ("the lazy dog", False)


def test_flush_after_everything_was_emitted_is_empty():
    tok = metaspace()
    detok = IncrementalDetokenizer(tok, [], ["zz"])
    text = "".join(detok.update([i])[0] for i in text_ids(tok, "café dog"))
    assert text + detok.flush()[0] == "café dog"
    assert detok.flush() == ("", False)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_batched_helper_equals_per_sequence_updates(seed):
    rng = random.Random(seed)
    kinds = sorted(TOKENIZERS)
    specs = []
    for _ in range(12):
        tok = TOKENIZERS[rng.choice(kinds)]()
        prompt = text_ids(tok, " ".join(rng.choices(WORDS, k=rng.randint(0, 5)))) if rng.random() < 0.7 else []
        stop = rng.choice([[], ["STOP"], ["o", "zz"], ["日本"]])
        output = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randint(0, 30))]
        specs.append((tok, prompt, stop, output, rng.random() < 0.8))
    single = [IncrementalDetokenizer(t, p, s, skip_special_tokens=k) for t, p, s, _, k in specs]
    batched = [IncrementalDetokenizer(t, p, s, skip_special_tokens=k) for t, p, s, _, k in specs]
    for step in range(32):
        new = [out[step : step + 1] if step % 5 else out[step : step + 3] for _, _, _, out, _ in specs]
        expected = [d.update(ids) for d, ids in zip(single, new)]
        assert detokenize_batch(batched, new) == expected
    assert [d.flush() for d in batched] == [d.flush() for d in single]
