"""Tool calls found in model text: every format's parser on outputs the way models write them
(and the way small models drift from them), malformed ones that must stay text, the streaming
split agreeing with the whole-text parse, the prompt for templates without tools, and the schema
that forces a call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from airframe.tool_calls import (HERMES, LLAMA3, MISTRAL, CallStream, ToolCall, call_format, call_schema,
                                 knows_tools, parse, plain_messages)

NAMES = {"get_weather", "get_time"}
PARIS = ToolCall("get_weather", {"city": "Paris"})
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}

# (format, model text, content expected, calls expected)
CALLS = [
    # Qwen2.5 / Hermes, as the Qwen template's instructions ask
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
    (HERMES, 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look that up.", [PARIS]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     None, [PARIS, ToolCall("get_time", {"zone": "CET"})]),
    # generation ended at <|im_end|> before the closing tag
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
    # arguments written as a JSON string, as some fine-tunes do
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', None, [PARIS]),
    # the drift the issue records: Qwen2.5-Coder 0.5B's bare object, 1.5B's fenced block
    (HERMES, '{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
    (HERMES, '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', None, [PARIS]),
    (HERMES, '{"name":"get_weather","arguments":{"city":"Paris"}}', None, [PARIS]),  # compact, as a forced call is
    (HERMES, 'Sure:\n```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```\nDone.',
     "Sure:\nDone.", [PARIS]),
    (HERMES, '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]',
     None, [PARIS, ToolCall("get_time", {"zone": "UTC"})]),
    (HERMES, '{"name": "get_time"}', None, [ToolCall("get_time", {})]),
    # Llama 3.2 (JSON alone, "parameters") and 3.1 (after <|python_tag|>, ended by <|eom_id|>)
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>', None, [PARIS]),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}',
     None, [PARIS, ToolCall("get_time", {"zone": "UTC"})]),
    # Mistral v3 (a JSON list) and v11 (name[ARGS]arguments)
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123xyz"}]', None, [PARIS]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [PARIS]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
     None, [PARIS, ToolCall("get_time", {"zone": "UTC"})]),
    # a model writing another family's format is still understood where it is plain JSON
    (MISTRAL, '{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
    (LLAMA3, '```json\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```', None, [PARIS]),
]

# Text that is not a call (to a declared function, with JSON arguments): it stays the content.
NOT_CALLS = [
    (HERMES, "The weather in Paris is sunny, 21 °C."),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'),  # cut JSON
    (HERMES, '<tool_call>\n{"name": "book_flight", "arguments": {"to": "Paris"}}\n</tool_call>'),  # unknown function
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>'),  # arguments not an object
    (HERMES, '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),  # no name
    (HERMES, '<tool_call>\n{"name": ["get_weather"], "arguments": {}}\n</tool_call>'),  # name not a string
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": "{city: Paris}"}</tool_call>'),  # arguments string not JSON
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {}} {"name": "get_time"}\n</tool_call>'),  # two in one tag
    (HERMES, '{"name": "get_weather", "arguments": {"city": "Paris"}} is how you would call it.'),  # JSON then prose
    (HERMES, '{"city": "Paris", "temperature": 21}'),  # JSON, but no call
    (HERMES, '[1, 2, 3]'),
    (HERMES, "Use {name} in an f-string: f'{name}'."),
    (HERMES, '```python\nprint({"name": "get_weather"})\n```'),
    (HERMES, '```json\n{"name": "get_weather", "arguments": {"city": \n```'),
    (HERMES, '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "nope", "arguments": {}}]'),
    (LLAMA3, '<|python_tag|>brave_search.call(query="weather in Paris")'),  # a built-in tool, not JSON
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}'),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}'),
    (MISTRAL, '[TOOL_CALLS]get_wether[ARGS]{"city": "Paris"}'),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} trailing'),
]


@pytest.mark.parametrize("fmt, text, content, calls", CALLS)
def test_calls_are_found_in_every_format(fmt, text, content, calls):
    parsed = parse(text, fmt, NAMES)
    assert parsed.calls == calls
    assert parsed.content == content


@pytest.mark.parametrize("fmt, text", NOT_CALLS)
def test_what_is_not_a_call_stays_content(fmt, text):
    parsed = parse(text, fmt, NAMES)
    assert parsed.calls == [] and parsed.content == text


def test_a_call_to_a_function_not_declared_in_this_request_is_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse(text, HERMES, {"get_time"}).calls == []
    assert parse(text, HERMES, set()).content == text


def _streamed(fmt: str, text: str, size: int) -> tuple[str, list[ToolCall]]:
    stream = CallStream(fmt, NAMES)
    released = "".join(stream.push(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = stream.finish()
    return released + rest, calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("fmt, text, content, calls", CALLS)
def test_streaming_finds_the_same_calls_in_pieces_of_any_size(fmt, text, content, calls, size):
    streamed, found = _streamed(fmt, text, size)
    assert found == calls
    assert streamed.split() == (content or "").split()  # the same words; whitespace at the joins may differ


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("fmt, text", NOT_CALLS)
def test_streaming_text_that_is_not_a_call_gives_it_all_back(fmt, text, size):
    assert _streamed(fmt, text, size) == (text, [])


def test_streaming_releases_plain_text_at_once_and_holds_a_call():
    stream = CallStream(HERMES, NAMES)
    assert stream.push("The weather ") == "The weather "
    assert stream.push("is nice. <tool") == "is nice. "  # "<tool" may open a call: held
    assert stream.push("_call>\n{\"name\": ") == ""
    assert stream.push('"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') == ""
    assert stream.finish() == ("", [PARIS])
    plain = CallStream(HERMES, NAMES)
    assert plain.push("a <tool") == "a "
    assert plain.push("box>") == "<toolbox>"  # not a marker after all: released


def test_formats_are_read_from_the_template_text():
    assert call_format("{{ '<tool_call>' }}{% for tool in tools %}{% endfor %}") == HERMES
    assert call_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == MISTRAL
    assert call_format("<|start_header_id|>{% if tools %}ipython{% endif %}") == LLAMA3
    assert call_format("{{ '<|python_tag|>' }}") == LLAMA3
    assert call_format("<|im_start|>{{ message['content'] }}") == HERMES
    assert knows_tools("{% if tools %}x{% endif %}") and not knows_tools("{{ message['content'] }}")


def test_plain_messages_describe_the_tools_and_turn_calls_and_answers_into_text():
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "a"},
        {"role": "tool", "content": "14:05", "tool_call_id": "b"},
    ]
    out = plain_messages(conversation, [WEATHER_TOOL, TIME_TOOL])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and json.dumps(WEATHER_TOOL) in out[0]["content"]
    assert parse(out[2]["content"], HERMES, NAMES).calls == [PARIS, ToolCall("get_time", {"zone": "CET"})]
    assert out[3]["content"] == "<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out[1:])
    assert plain_messages(conversation[1:2], [WEATHER_TOOL])[0]["role"] == "system"


def test_the_forcing_schema_accepts_exactly_calls_to_the_tools():
    one = call_schema([WEATHER_TOOL, TIME_TOOL], "get_weather")
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, one)
    for wrong in ({"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {}},
                  {"name": "get_weather"}, {"name": "get_weather", "arguments": {"city": "Paris"}, "x": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, one)
    either = call_schema([WEATHER_TOOL, TIME_TOOL])
    jsonschema.validate({"name": "get_time", "arguments": {"zone": "UTC"}}, either)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "arguments": {"zone": "PST"}}, either)
    bare = call_schema([{"type": "function", "function": {"name": "ping"}}])
    jsonschema.validate({"name": "ping", "arguments": {}}, bare)


def test_json_nested_past_pythons_stack_is_text_not_an_error():
    for text in ("[" * 100_000, "<tool_call>" + "[" * 100_000, '{"name": "get_weather", "arguments": "' + "[" * 100_000 + '"}'):
        assert parse(text, HERMES, NAMES).calls == []
