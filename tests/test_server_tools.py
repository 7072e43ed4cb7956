"""Tool calling through /v1/chat/completions.

Against the scripted FakeEngine (fast): the model's call text becomes `tool_calls` (message and
stream deltas, reassembled by the official `openai` client), wrong calls stay text, tool_choice
and parallel_tool_calls, the conversation sent back, and malformed requests answered 400.

Against SmolLM2-135M on the reference backend, in-process: `tool_choice` required and named force
the answer through the structured-output constraint, so even this model, whose template knows no
tools, gives a call whose arguments parse and name the city asked for; the call and the tool's
answer go back and are rendered. Against Qwen2.5-Coder 0.5B (marked slow; about 8 s a token on
lavapipe): the same with tool_choice auto, the model's own choice.
"""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from airframe.engine import Engine
from airframe.errors import ModelNotFoundError
from airframe.models import resolve_model
from airframe.options import RunOptions
from airframe.server import create_app, translate
from airframe.server.schemas import ChatMessage
from test_server_api import FakeEngine, assert_openai_error, openai_client, post_stream

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _client(reply: str):
    engine = FakeEngine(reply=reply, n_ctx=4096)
    return engine, TestClient(create_app(engine))


def _reassembled(stream) -> tuple[str, dict[int, dict], str | None]:
    """Content, calls by index ({id, name, arguments}) and finish_reason, built from the deltas
    as an OpenAI client application does."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, calls, reason


# ---- the fake engine ----------------------------------------------------------------------------


def test_a_call_in_the_answer_becomes_tool_calls():
    engine, http = _client(HERMES_CALL)
    with http:
        answer = openai_client(http).chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    _, _, tools = engine.prepared[-1]
    assert tools == [WEATHER, TIME]  # the template gets OpenAI's shape


@pytest.mark.parametrize("reply, content", [
    (HERMES_CALL, ""),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', ""),  # bare, as small models drift
    ("I will check.\n" + HERMES_CALL, "I will check."),
])
def test_a_streamed_call_is_reassembled_by_the_openai_client(reply, content):
    _, http = _client(reply)
    with http:
        stream = openai_client(http).chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True)
        text, calls, reason = _reassembled(stream)
    assert text.strip() == content and reason == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_stream_deltas_have_openai_shape():
    _, http = _client(HERMES_CALL)
    with http:
        events = post_stream(http, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "stream": True})
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0] == [{"index": 0, "id": calls[0][0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]
    assert calls[1] == [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("reply", [
    '<tool_call>\n{"name": "book_flight", "arguments": {"to": "Paris"}}\n</tool_call>',  # not a declared function
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # broken JSON
    "It is sunny in Paris.",
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_is_not_a_call_comes_back_as_text(reply, stream):
    _, http = _client(reply)
    with http:
        api = openai_client(http)
        if stream:
            text, calls, reason = _reassembled(api.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                                                           stream=True))
        else:
            choice = api.chat.completions.create(model="m", messages=ASK, tools=[WEATHER]).choices[0]
            text, calls, reason = choice.message.content, choice.message.tool_calls or {}, choice.finish_reason
    assert (text, calls, reason) == (reply, {}, "stop")


def test_tool_choice_none_offers_no_tools_and_parses_no_calls():
    engine, http = _client(HERMES_CALL)
    with http:
        answer = openai_client(http).chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.content == HERMES_CALL and answer.choices[0].finish_reason == "stop"
    assert engine.prepared[-1][2] is None


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = HERMES_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    _, http = _client(two)
    with http:
        api = openai_client(http)
        both = api.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME]).choices[0].message
        one = api.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME],
                                          parallel_tool_calls=False).choices[0].message
    assert [c.function.name for c in both.tool_calls] == ["get_weather", "get_time"]
    assert [c.function.name for c in one.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_a_forced_choice_constrains_the_answer_to_a_call(choice, names):
    engine, http = _client('{"name": "get_time", "arguments": {"zone": "UTC"}}')
    with http:
        answer = openai_client(http).chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME],
                                                             tool_choice=choice)
    assert answer.choices[0].message.tool_calls[0].function.name == "get_time"
    grammar = engine.calls[-1][1].grammar
    schema = json.loads(grammar.text)["grammars"][0]["json_schema"]
    consts = {o["properties"]["name"]["const"] for o in schema.get("anyOf", [schema])}
    assert grammar.kind == "json_schema" and consts == names


def test_auto_leaves_the_answer_free():
    engine, http = _client(HERMES_CALL)
    with http:
        http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "auto"})
    assert engine.calls[-1][1].grammar is None


def test_the_call_and_the_tool_answer_sent_back_reach_the_template():
    engine, http = _client("It is sunny, 21 C.")
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"},
    ]
    with http:
        answer = openai_client(http).chat.completions.create(model="m", messages=conversation, tools=[WEATHER])
    assert answer.choices[0].message.content == "It is sunny, 21 C." and answer.choices[0].finish_reason == "stop"
    messages, _, _ = engine.prepared[-1]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert messages[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_7", "name": "get_weather"}


BAD = [
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["city"]}}]}, "tools.0.function.parameters"),
    ({"tools": ["get_weather"]}, "tools.0"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]},
     "messages.1.tool_calls"),
    ({"tools": [WEATHER], "messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '["Paris"]'}}]}]},
     "messages.1.tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[" * 100_000}}]}]},
     "messages.1.tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages.1.tool_calls.0.function"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"description": "\ud800"}}}}}]}, "tools.0"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": "\\ud800"}'}}]}]},
     "messages.1.tool_calls"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_malformed_tool_requests_are_400_with_the_field_named(extra, param):
    _, http = _client(HERMES_CALL)
    with http:
        # json.dumps writes lone surrogates as \ud800 escapes, as a client in another language may send them
        response = http.post("/v1/chat/completions", content=json.dumps({"messages": ASK, **extra}),
                             headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400, param)
    assert error["type"] == "invalid_request_error"


# ---- real models ------------------------------------------------------------------------------------

PARIS_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MAX_TOKENS = 32


def _as_the_template_takes(conversation: list[dict]) -> list[dict]:
    """The messages as the server hands them to the template (arguments decoded, names filled in)."""
    return translate.chat_messages([ChatMessage(**m) for m in conversation])


def _answer_sent_back(call) -> list[dict]:
    return PARIS_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})},
    ]


@pytest.fixture(scope="module")
def smollm2():
    resolve_model("smollm2-135m")
    engine = Engine.load("smollm2-135m", backend="reference", options=RunOptions(n_ctx=768))
    with TestClient(create_app(engine)) as http:
        yield engine, openai_client(http)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_smollm2_forced_call_names_the_city_and_takes_the_answer_back(smollm2, choice):
    engine, api = smollm2
    answer = api.chat.completions.create(model="m", messages=PARIS_ASK, tools=[WEATHER], tool_choice=choice,
                                         temperature=0, max_tokens=MAX_TOKENS)
    assert answer.choices[0].finish_reason == "tool_calls"
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    conversation = _answer_sent_back(call)
    rendered = _as_the_template_takes(conversation)
    prompt = engine.render_chat(rendered, tools=[WEATHER])
    assert '"celsius": 21' in prompt and prompt.index('"celsius": 21') > prompt.index('"arguments": {"city": ')
    after = api.chat.completions.create(model="m", messages=conversation, tools=[WEATHER], temperature=0, max_tokens=4)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert after.usage.prompt_tokens == len(engine.tokenize_prompt(rendered, tools=[WEATHER]))


def test_smollm2_forced_call_streams_as_deltas(smollm2):
    _, api = smollm2
    stream = api.chat.completions.create(model="m", messages=PARIS_ASK, tools=[WEATHER], tool_choice="required",
                                         temperature=0, max_tokens=MAX_TOKENS, stream=True)
    content, calls, reason = _reassembled(stream)
    assert reason == "tool_calls" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and "paris" in json.loads(calls[0]["arguments"])["city"].lower()


@pytest.fixture(scope="module")
def qwen():
    try:
        resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError:
        pytest.skip("needs the Qwen2.5-Coder 0.5B model: airframe pull qwen2.5-coder-0.5b")
    engine = Engine.load("qwen2.5-coder-0.5b", options=RunOptions(n_ctx=1024))
    with TestClient(create_app(engine)) as http:
        yield engine, openai_client(http)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_qwen_calls_the_weather_tool_by_itself(qwen, stream):
    engine, api = qwen
    request = dict(model="m", messages=PARIS_ASK, tools=[WEATHER], temperature=0, max_tokens=MAX_TOKENS)
    if stream:
        _, calls, reason = _reassembled(api.chat.completions.create(**request, stream=True))
        name, arguments = calls[0]["name"], calls[0]["arguments"]
    else:
        answer = api.chat.completions.create(**request)
        reason, (call,) = answer.choices[0].finish_reason, answer.choices[0].message.tool_calls
        name, arguments = call.function.name, call.function.arguments
        rendered = _as_the_template_takes(_answer_sent_back(call))
        prompt = engine.render_chat(rendered, tools=[WEATHER])
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": ' in prompt
        assert '<tool_response>\n{"city": "Paris", "sky": "sunny", "celsius": 21}\n</tool_response>' in prompt
        after = api.chat.completions.create(model="m", messages=_answer_sent_back(call), tools=[WEATHER],
                                            temperature=0, max_tokens=2)
        assert after.usage.prompt_tokens == len(engine.tokenize_prompt(rendered, tools=[WEATHER]))
    assert reason == "tool_calls" and name == "get_weather"
    assert "paris" in json.loads(arguments)["city"].lower()
