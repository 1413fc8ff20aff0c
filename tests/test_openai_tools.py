"""Tool calling's request side without a server: the parsers read what their format writes, a stream's split
equals the whole output's, the constraints compile and accept the calls they stand for, and tools and tool
history reach a template that ignores them in the Hermes format (as HF's apply_chat_template where it reads them)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.serving.openai.protocol import ChatCompletionRequest, RequestError
from inflight.serving.openai.tool_parsers import ToolCallStream, get_tool_parser
from inflight.serving.openai.tools import ToolOutputStream, ToolUse, template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}  # fmt: skip
NOTE = {"type": "function", "function": {"name": "note"}}  # no parameters: any object
ASK = [{"role": "user", "content": "Weather in Paris?"}]

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "note", "arguments": {}}\n</tool_call>'
)
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; {"name": "note", "parameters": {}}'


def request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=ASK, tools=[WEATHER, NOTE], **kwargs)


@pytest.mark.parametrize(
    ("parser", "text", "content"), [("hermes", HERMES, "Let me check.\n"), ("llama3_json", LLAMA3, None)]
)
def test_parsers_read_their_format(parser, text, content):
    got, calls = get_tool_parser(parser).extract(text)
    assert got == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                                    ("note", {})]  # fmt: skip
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_text_without_a_parseable_call_is_content(parser):
    p = get_tool_parser(parser)
    for text in ("just text", p.trigger + '{"name": "get_weather", "argu'):  # cut short by max_tokens
        assert p.extract(text) == (text, [])


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from([HERMES, "plain <tool answer> no call", "<tool_call>\nbroken</tool_call>", "a <tool_c"]),
       cuts=st.lists(st.integers(0, 200), max_size=12))  # fmt: skip
def test_a_streams_split_equals_the_whole_outputs(text, cuts):
    parser = get_tool_parser("hermes")
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    stream, content = ToolCallStream(parser), ""
    for a, b in zip(bounds, bounds[1:]):
        content += stream.feed(text[a:b])
    rest, calls = stream.finish()
    whole_content, whole_calls = parser.extract(text)
    assert content + rest == (whole_content or "") if whole_calls else text
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_a_partial_trigger_is_held_back_until_it_is_known():
    stream = ToolCallStream(get_tool_parser("hermes"))
    assert stream.feed("Hi <tool") == "Hi "
    assert stream.feed("box>") == "<toolbox>"  # not the trigger after all


def compile_constraint(spec: dict):
    from inflight.engine.structured_output.compile_pool import CompilePool
    from inflight.sampling_params import StructuredOutputsParams

    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo([chr(c).encode() for c in range(32, 127)] + [b"\n"])  # one character a token
    compiler = xgr.GrammarCompiler(info)
    return CompilePool.compile_grammar(compiler, StructuredOutputsParams.from_value(spec)), info


def accepts(compiled, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()  # the whole output, and it may end there


@pytest.mark.parametrize(
    ("tool_choice", "good", "bad"),
    [
        (
            "required",
            '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
            '[{"name": "get_weather"}]',
        ),
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris", "days": 3}', '{"city": 3}'),
    ],
)
def test_required_and_named_constrain_the_output_to_the_schemas(tool_choice, good, bad):
    use = ToolUse.of(request(tool_choice=tool_choice), None)
    compiled, _ = compile_constraint(use.structured_outputs(request(tool_choice=tool_choice)))
    assert accepts(compiled, good) and not accepts(compiled, bad)
    _, calls = use.read(good)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]


def test_hermes_keeps_the_whole_calls_before_one_cut_short():
    content, calls = get_tool_parser("hermes").extract(HERMES[: HERMES.rindex("{")] + '{"name": "no')
    assert content == "Let me check.\n" and [c.name for c in calls] == ["get_weather"]


def test_required_cut_short_returns_the_calls_made_whole():
    use = ToolUse.of(request(tool_choice="required"), None)
    text = '[{"name": "note", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Par'
    assert [(c.name, c.arguments) for c in use.read(text)[1]] == [("note", "{}")]
    assert use.read('[{"name": "no') == ('[{"name": "no', [])


def test_auto_is_free_text_until_a_call_opens_then_the_schema_holds():
    parser = get_tool_parser("hermes")
    body = request()
    use = ToolUse.of(body, parser)
    compiled, _ = compile_constraint(use.structured_outputs(body))
    import xgrammar as xgr

    def ok(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert ok("Sure, any text at all.")
    assert ok('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>')
    assert not ok('<tool_call>\n{"name": "get_wether"')  # an unknown function
    assert not ok('<tool_call>\n{"name": "get_weather", "arguments": {"city": 3')  # arguments off the schema


def test_auto_without_a_parser_and_bad_tool_choices_are_400s():
    with pytest.raises(RequestError, match="--tool-call-parser") as info:
        ToolUse.of(request(), None)
    assert info.value.param == "tool_choice"
    with pytest.raises(RequestError, match="not in tools") as info:
        request(tool_choice={"type": "function", "function": {"name": "nope"}}).check()
    assert info.value.param == "tool_choice"
    with pytest.raises(RequestError, match="response_format cannot be combined"):
        request(tool_choice="required", response_format={"type": "json_object"}).check()
    assert ToolUse.of(request(tool_choice="none"), None).structured_outputs(request()) is None


def test_named_stream_sends_the_arguments_as_they_come():
    use = ToolUse.of(request(tool_choice={"type": "function", "function": {"name": "note"}}), None)
    stream = ToolOutputStream(use)
    first = stream.feed('{"a"', False)[1]
    assert first[0]["function"] == {"name": "note", "arguments": '{"a"'} and first[0]["id"].startswith("call_")
    assert stream.feed(":1}", True)[1] == [{"index": 0, "function": {"arguments": ":1}"}}]
    assert stream.calls[0].arguments == '{"a":1}' and stream.calls[0].id == first[0]["id"]


def test_tools_and_tool_history_reach_a_template_that_ignores_them(demo_model_dir):
    from inflight.serving.openai.renderer import PromptRenderer

    renderer = PromptRenderer.load(demo_model_dir)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"high_c": 21}'},
    ]
    body = ChatCompletionRequest(model="m", messages=history, tools=[WEATHER])
    reads = "tools" in renderer.template.source
    messages, extra = template_messages([m.for_template() for m in body.messages], body, reads)
    prompt = renderer.chat_prompt(messages, True, **extra)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"high_c": 21}\n</tool_response>' in prompt
    assert '"name": "get_weather"' in prompt.split("<tool_call>")[0]  # the tools, before the conversation


def test_a_template_that_reads_tools_gets_them_as_hf_passes_them():
    from inflight.serving.openai.chat_template import ChatTemplate

    template = ChatTemplate(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}{{ m.content }};{% endfor %}",
        {},
    )
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = ChatCompletionRequest(
        model="m", messages=ASK + [{"role": "assistant", "tool_calls": [call]}], tools=[WEATHER]
    )
    messages, extra = template_messages([m.for_template() for m in body.messages], body, True)
    assert template.render(messages, False, **extra) == "[get_weather]user:Weather in Paris?;assistant:Paris;"
