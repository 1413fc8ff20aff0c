"""Random Llama checkpoints of any shape (inflight.random_llama): a tokenizer of exactly the vocabulary
asked for, and a wide-vocabulary model that inflight and HF load and generate alike."""

from __future__ import annotations

import json

import pytest
from helpers import hf_greedy

from inflight import LLM, SamplingParams
from inflight.random_llama import build_tokenizer, write_llama


def test_tokenizer_has_exactly_the_vocabulary_and_every_id_decodes():
    tok = build_tokenizer(32000)
    assert tok.get_vocab_size() == 32000 == len(tok.get_vocab())
    assert tok.to_str() == build_tokenizer(32000).to_str()  # deterministic: the cached checkpoint is reproducible
    assert tok.to_str() != build_tokenizer(32000, seed=1).to_str()
    # The model may sample any id: each decodes to text, and the merged ones to letters (and a space).
    pieces = tok.decode_batch([[i] for i in range(3, 32000)], skip_special_tokens=False)
    assert all(pieces)
    assert all(p.strip(" ").isalpha() and p.isascii() for p in pieces[259:])
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok.encode(text).ids
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=True) == text  # <s>, then a lossless round trip
    assert max(ids) > 258  # merges apply, not only bytes
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(100)


def test_a_small_wide_vocabulary_llama_loads_and_generates_like_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    shape = {
        "vocab_size": 3000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    model_dir = write_llama(tmp_path / "m", shape)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert {k: cfg[k] for k in shape} == shape
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert len(hf_tok) == 3000

    llm = LLM(model_dir, num_kv_blocks=32, dtype="float32")
    assert llm.tokenizer.get_vocab_size() == 3000
    prompt = llm.tokenizer.encode("a small wide model").ids
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(out.token_ids) == 12 and out.text == hf_tok.decode(out.token_ids)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert out.token_ids == hf_greedy(hf_model, prompt, 12)
