"""GGUF loading on tiny files written here (gguf.GGUFWriter, as llama.cpp's converter writes them: Q/K rows
permuted for its RoPE layout, 1-D norms in F32): every supported tensor type against HF transformers on the
same (de)quantized weights, and the errors that name what is not supported."""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import hf_logits
from test_loader import TINY, engine_logits

from inflight.config import ConfigError
from inflight.models.config import ModelConfig
from inflight.models.loader import load_model, load_tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in glob or hf == "lm_head.weight":
        return glob.get(hf, "output.weight")
    _, _, layer, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_NAMES[module]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# K-quant super-blocks hold 256 weights: rows must be that long.
TINY_K = TINY | dict(hidden_size=256, intermediate_size=256)
# Where each block format keeps its fp16 scale(s) (byte offsets) and how large they may be for weights of ~0.3.
_SCALES = {
    Q.Q4_K: ((0, 3e-4), (2, 5e-3)),
    Q.Q5_K: ((0, 1.5e-4), (2, 5e-3)),
    Q.Q6_K: ((208, 7e-5),),
    Q.Q2_K: ((80, 3e-3), (82, 3e-3)),
}


def random_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with finite fp16 scales: valid blocks of a format gguf cannot quantize to (K-quants)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset, scale in _SCALES[qtype]:
        d = rng.uniform(0.5, 1.0, data.shape[:2]).astype(np.float16) * np.float16(scale)
        data[:, :, offset : offset + 2] = d[..., None].view(np.uint8)
    return data.reshape(rows, -1)


def tiny_hf_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(TINY | overrides))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() == 1 else 0.2)
    return model


def write_gguf(path: Path, model, qtype=Q.F32, arch: str = "llama", tokenizer_model: str = "gpt2") -> Path:
    """Write `model` as llama.cpp would, its 2-D weights in `qtype`; returns the path. Also leaves each 2-D
    weight of `model` replaced by its dequantized self, so HF runs on exactly what the file holds."""
    cfg = model.config
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:  # llama.cpp writes the embedding once
            continue
        data = tensor.float().numpy()
        if data.ndim == 2:
            if qtype in _SCALES:
                quantized = random_blocks(qtype, *data.shape, rng)
            else:
                quantized = gguf.quants.quantize(data, qtype)
            with torch.no_grad():  # row-wise blocks: the same values whatever the row order
                tensor.copy_(torch.from_numpy(gguf.quants.dequantize(quantized, qtype).reshape(data.shape)))
            if name.endswith("q_proj.weight"):
                quantized = _permute(quantized, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                quantized = _permute(quantized, cfg.num_key_value_heads)
            w.add_tensor(_gguf_name(name), quantized, raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_every_tensor_type_matches_hf_on_the_same_weights(tmp_path, qtype):
    hf = tiny_hf_model()
    path = write_gguf(tmp_path / "tiny.gguf", hf, qtype)
    ids = [1, 7, 42, 99, 3, 250, 17, 64, 5, 8, 120, 33, 2, 77, 150, 9, 11, 260, 31, 4]
    torch.testing.assert_close(engine_logits(path, ids), hf_logits(hf, ids), atol=2e-4, rtol=1e-4)
    cfg = ModelConfig.load(tmp_path)  # the directory holding one .gguf
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, TINY["vocab_size"])
    assert not cfg.tie_word_embeddings  # output.weight is in the file


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("weight_format", ["dequantized", "auto"])
def test_five_bit_and_k_quants_match_hf_on_the_same_weights(tmp_path, qtype, weight_format):
    hf = tiny_hf_model(**TINY_K)
    path = write_gguf(tmp_path / "tiny.gguf", hf, qtype)
    ids = [1, 7, 42, 99, 3, 250, 17, 64, 5, 8, 120, 33, 2, 77, 150, 9, 11, 260, 31, 4]
    torch.testing.assert_close(
        engine_logits(path, ids, weight_format=weight_format), hf_logits(hf, ids), atol=2e-4, rtol=1e-4
    )


def test_unsupported_tensor_type_is_named(tmp_path):
    path = write_gguf(tmp_path / "q2.gguf", tiny_hf_model(**TINY_K), Q.Q2_K)
    with pytest.raises(ConfigError, match=r"token_embd.weight \(Q2_K\).*supported: F32, F16, BF16, Q8_0, .*Q6_K"):
        load_model(path, torch.float32, "cpu")


def test_weight_format_is_checked(tmp_path):
    path = write_gguf(tmp_path / "q4.gguf", tiny_hf_model(), Q.Q4_0)
    with pytest.raises(ConfigError, match="weight_format='int4' is invalid"):
        load_model(path, torch.float32, "cpu", weight_format="int4")


def test_unsupported_architecture_and_tokenizer_are_named(tmp_path):
    path = write_gguf(tmp_path / "gemma.gguf", tiny_hf_model(), arch="gemma")
    with pytest.raises(ConfigError, match="architecture 'gemma' is not supported"):
        load_model(path, torch.float32, "cpu")
    path = write_gguf(tmp_path / "spm.gguf", tiny_hf_model(), tokenizer_model="llama")
    with pytest.raises(ConfigError, match="tokenizer.ggml.model='llama' is not supported"):
        load_tokenizer(path)


def test_a_directory_with_two_gguf_files_is_refused(tmp_path):
    write_gguf(tmp_path / "a.gguf", tiny_hf_model())
    write_gguf(tmp_path / "b.gguf", tiny_hf_model())
    with pytest.raises(ConfigError, match="2 .gguf files"):
        ModelConfig.load(tmp_path)
