"""Chat templates render exactly as HF transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
import shutil

import pytest

from inflight.serving.openai.chat_template import ChatTemplate, ChatTemplateError
from inflight.serving.openai.renderer import PromptRenderer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo 日本語 🙂"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "  spaces  and\nnew lines  "},
    ],
]

# Templates in the styles found on the Hub: Llama 3 (bos_token, loop controls, whitespace control), one that
# uses tojson / namespace / raise_exception / the generation tag, and one written without `-` trimming.
LLAMA3 = (
    "{{- bos_token }}{% for message in messages %}{% if loop.index0 == 0 and message['role'] == 'system' %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% continue %}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
FANCY = """{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message.role) }}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if message.role == 'assistant' %}
{% generation %}{{ message.content | tojson }}{% endgeneration %}
    {% else %}
{{ message.role }}: {{ message | tojson }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}assistant ({{ ns.n }} so far):{% endif %}
"""
PLAIN = """{% for message in messages %}
<{{ message['role'] }}>
{{ message['content'] }}
</{{ message['role'] }}>
{% endfor %}
{% if add_generation_prompt %}<assistant>
{% endif %}"""


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("template", [None, LLAMA3, FANCY, PLAIN], ids=["demo", "llama3", "fancy", "plain"])
def test_renders_like_hf(demo_model_dir, hf_tokenizer, template, conversation, add_generation_prompt):
    ours = ChatTemplate.from_checkpoint(demo_model_dir)
    if template is not None:
        ours = ChatTemplate(template, ours.special_tokens)
    expected = hf_tokenizer.apply_chat_template(
        conversation, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.render(conversation, add_generation_prompt) == expected


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_prompt_tokenizes_to_hf_ids(demo_model_dir, hf_tokenizer, conversation):
    """The model adds BOS when it tokenizes; the template's own is dropped so that it is not doubled."""
    renderer = PromptRenderer.load(demo_model_dir)
    prompt = renderer.chat_prompt(conversation, add_generation_prompt=True)
    expected = hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
    assert renderer.tokenizer.encode(prompt).ids == expected
    assert renderer.num_tokens(prompt) == len(expected)


def test_template_errors_are_chat_template_errors(demo_model_dir):
    demo = ChatTemplate.from_checkpoint(demo_model_dir)
    with pytest.raises(ChatTemplateError, match="knows the roles system, user and assistant, not tool"):
        demo.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", {})
    with pytest.raises(ChatTemplateError, match="could not render|rejected"):
        ChatTemplate("{{ messages[0].content + 1 }}", {}).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # the sandbox holds
        ChatTemplate("{{ messages.__class__.__mro__ }}", {}).render([])


def test_checkpoint_without_template_says_so(demo_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(demo_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    renderer = PromptRenderer.load(model)
    with pytest.raises(ChatTemplateError, match="has no chat template.*/v1/completions"):
        renderer.chat_prompt([{"role": "user", "content": "x"}], True)
    (model / "chat_template.jinja").write_text(PLAIN)  # HF's newer layout wins over tokenizer_config.json
    prompt = PromptRenderer.load(model).chat_prompt([{"role": "user", "content": "x"}], True)
    assert prompt == "<user>\nx\n</user>\n<assistant>\n"


def test_checkpoint_elsewhere_says_so(tmp_path):
    renderer = PromptRenderer.load(tmp_path / "on-another-host")
    with pytest.raises(ChatTemplateError, match="not on this machine: start the API with --model"):
        renderer.chat_prompt([{"role": "user", "content": "x"}], True)
