"""Tiny random checkpoints of the model families, made by HF transformers itself (the reference), with a
tokenizer of exactly their vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 300
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip

# architecture -> (transformers config class name, its family's fields)
MOE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16, norm_topk_prob=True),
    ),
    "MixtralForCausalLM": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "OlmoeForCausalLM": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, eos_token_id=2, pad_token_id=1)),
    "Qwen2MoeForCausalLM": (
        "Qwen2MoeConfig",
        dict(
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
        ),  # fmt: skip
    ),
}


def write_family(out_dir: Path, architecture: str, config_class: str, fields: dict[str, Any], seed: int = 0):
    """Save a random HF model of `architecture` (every weight drawn with std 0.2, so greedy tokens vary) and a
    tokenizer of its vocabulary; returns (directory, the HF model in fp32, eval mode)."""
    import transformers

    from inflight.demo_model import CHAT_TEMPLATE
    from inflight.random_llama import build_tokenizer

    cfg = getattr(transformers, config_class)(**(BASE | fields))
    cfg.architectures = [architecture]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out_dir)
    build_tokenizer(cfg.vocab_size, seed).save(str(Path(out_dir) / "tokenizer.json"))
    # The plain fast tokenizer (a family's own class, e.g. Qwen2Tokenizer, would add its special tokens)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}  # fmt: skip
    (Path(out_dir) / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return Path(out_dir), model


_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip


def write_moe_gguf(path: Path, hf_model, arch: str, qtype=None) -> Path:
    """`hf_model` (an HF MoE model) as llama.cpp's converter writes it for `arch` (qwen3moe, qwen2moe, or llama
    for Mixtral): experts stacked per projection, Q/K rows permuted for `llama` only, 2-D and 3-D weights in
    `qtype` (default F32). HF's weights are replaced by what the file holds (dequantized)."""
    import gguf
    import numpy as np

    q = qtype or gguf.GGMLQuantizationType.F32
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)

    def stored(name: str, tensor: torch.Tensor) -> np.ndarray:
        data = tensor.float().numpy()
        if data.ndim == 1 or q == gguf.GGMLQuantizationType.F32:
            return data
        packed = gguf.quants.quantize(data, q)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(gguf.quants.dequantize(packed, q).reshape(data.shape)))
        return packed

    def permute(x: np.ndarray, heads: int) -> np.ndarray:  # convert_hf_to_gguf's LlamaModel.permute
        return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    def put(gguf_name: str, data: np.ndarray) -> None:
        w.add_tensor(gguf_name, data, raw_dtype=None if data.dtype == np.float32 else q)

    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip
    for name, tensor in hf_model.state_dict().items():
        if name in globals_:
            put(globals_[name], stored(name, tensor))
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.endswith("experts.gate_up_proj"):
            inter = tensor.shape[1] // 2
            for half, gguf_name in ((slice(0, inter), "ffn_gate_exps"), (slice(inter, None), "ffn_up_exps")):
                part = tensor[:, half].contiguous()
                put(f"blk.{layer}.{gguf_name}.weight", stored(name, part))
                with torch.no_grad():
                    tensor[:, half].copy_(part)
            continue
        if rest.endswith("experts.down_proj"):
            put(f"blk.{layer}.ffn_down_exps.weight", stored(name, tensor))
            continue
        module, _, kind = rest.rpartition(".")
        data = stored(name, tensor)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if module == "self_attn.q_proj" else cfg.num_key_value_heads
            data = permute(data, heads)
        w.add_tensor(
            f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}", data, raw_dtype=None if data.dtype == np.float32 else q
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_bf16_batch_invariant(model_dir, prompts: list[list[int]], max_tokens: int = 12, **engine_args) -> None:
    """bf16: every request's logits at every position, bit for bit, alone (one sequence a step) and in chunked
    mixed batches; and so its greedy tokens."""
    from helpers import capture_logits
    from inflight import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(**args):
        llm = LLM(str(model_dir), dtype="bfloat16", num_kv_blocks=64, block_size=8, **(engine_args | args))
        captured = capture_logits(llm.engine)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        index = {o.request_id: i for i, o in enumerate(outs)}
        rows = {(index[rid], p): row for rid, pos, lg in captured for p, row in zip(pos, lg)}
        return [o.token_ids for o in outs], rows

    alone_tokens, alone = run(max_num_seqs=1)
    mixed_tokens, mixed = run(max_num_seqs=len(prompts), max_num_batched_tokens=13)
    assert mixed_tokens == alone_tokens
    assert set(mixed) == set(alone)
    differ = [k for k in alone if not torch.equal(alone[k], mixed[k])]
    assert not differ, f"{len(differ)} of {len(alone)} positions differ"
