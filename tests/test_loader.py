"""Checkpoint loading: every supported family matches HF; bad checkpoints fail loudly and by name."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import hf_logits

from inflight.config import ConfigError
from inflight.executor.attention import AttentionMetadata, TorchBackend
from inflight.models.config import ModelConfig
from inflight.models.loader import load_model

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def make_checkpoint(tmp: Path, arch: str, **extra) -> Path:
    cls = getattr(transformers, arch)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    model = cls(config_cls(**(TINY | extra))).eval()
    with torch.no_grad():  # random init is tiny; larger weights make the comparison meaningful
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() == 1 else 0.2)
    model.save_pretrained(tmp)
    return tmp


def engine_logits(model_dir: Path, ids: list[int], weight_format: str = "auto") -> torch.Tensor:
    model, cfg = load_model(model_dir, torch.float32, "cpu", weight_format)
    model.init_rope(cfg.max_position_embeddings, torch.device("cpu"))
    n, bs = len(ids), 16
    nblk = -(-n // bs)
    k = torch.zeros(nblk, bs, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(k.clone(), k.clone()) for _ in range(cfg.num_hidden_layers)]
    table = torch.arange(nblk, dtype=torch.int32)[None].flip(1)  # reversed: non-contiguous on purpose
    slots = table[0, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
    meta = AttentionMetadata(
        slots,
        torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        table,
        np.array([0, n]),
        np.array([n]),
    )
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, caches, TorchBackend()))


CASES = {
    "llama-llama3-rope-tied": (
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None)),
    "qwen2-bias": ("Qwen2ForCausalLM", dict()),
    "qwen3-qknorm-headdim": ("Qwen3ForCausalLM", dict(head_dim=32)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_hf(tmp_path, case):
    arch, extra = CASES[case]
    path = make_checkpoint(tmp_path, arch, **extra)
    cfg = ModelConfig.from_dir(path)
    if case.startswith("qwen3"):
        assert cfg.qk_norm and cfg.head_dim == 32 and cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
    if case.startswith("qwen2"):
        assert cfg.attention_bias
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    ids = [(7 * i + 3) % TINY["vocab_size"] for i in range(40)]
    torch.testing.assert_close(engine_logits(path, ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = list(range(1, 20))
    torch.testing.assert_close(engine_logits(tmp_path, ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)


def test_rope_theta_from_rope_parameters(tmp_path):
    cfg = dict(TINY, architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert ModelConfig.from_hf_dict(cfg).rope_theta == 5e5


def test_qwen_windows_count_only_with_use_sliding_window():
    base = dict(TINY, architectures=["Qwen2ForCausalLM"], sliding_window=32)
    assert ModelConfig.from_hf_dict(base).sliding_window is None
    assert ModelConfig.from_hf_dict(base | {"use_sliding_window": True}).sliding_window is None  # layers < 28
    assert ModelConfig.from_hf_dict(base | {"use_sliding_window": True, "max_window_layers": 1}).sliding_window == 32


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM, MistralForCausalLM"):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_config_and_weights_are_named(tmp_path, demo_model_dir):
    with pytest.raises(ConfigError, match="config.json: missing"):
        load_model(tmp_path, torch.float32, "cpu")
    shutil.copy(Path(demo_model_dir) / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        load_model(tmp_path, torch.float32, "cpu")


def test_shape_mismatch_and_missing_tensor_are_named(tmp_path, demo_model_dir):
    for name in ("model.safetensors", "tokenizer.json"):
        shutil.copy(Path(demo_model_dir) / name, tmp_path / name)
    cfg = json.loads((Path(demo_model_dir) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 128}))
    with pytest.raises(ConfigError, match=r"model.safetensors: tensor 'model.layers.0.mlp.\w+_proj.weight' has shape"):
        load_model(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 5}))
    with pytest.raises(ConfigError, match=r"checkpoint lacks tensor\(s\) \['model.layers.4"):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_load_and_run(demo_model_dir, dtype):
    model, cfg = load_model(demo_model_dir, dtype, "cpu")
    assert model.model.embed_tokens.weight.dtype == dtype and model.model.norm.weight.dtype == dtype
    assert torch.isfinite(engine_logits(demo_model_dir, [1, 2, 3])).all()


def test_weight_bytes_counts_a_onednn_packed_linear(monkeypatch):
    # Where our GEMM does not run (neither AVX-512 nor AVX2) a linear's weight is an opaque oneDNN tensor: no storage
    # to read
    from inflight.models import packed_linear
    from inflight.models.loader import weight_bytes

    monkeypatch.setattr(packed_linear.cpu, "gemm_supports", lambda dtype, in_features: False)
    packed = packed_linear.PackedLinear(torch.nn.Linear(32, 40, bias=False))
    assert not packed.own_gemm
    assert weight_bytes(packed) == 32 * 40 * 4
