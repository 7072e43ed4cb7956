"""Structured output through the server: the official `openai` client against SmolLM2-135M (and,
marked slow, Gemma 3 270M with its 262,144-token vocabulary) on the reference backend (in-process), JSON schemas whose every answer `jsonschema` validates, greedy and
sampled, json_object answers that parse, grammars, and the bad input that is a 400.

Schemas are small and strings bounded so that each answer is a few dozen tokens at most; the
first five run by default, the rest are marked slow.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from airframe.engine import Engine
from airframe.models import resolve_model
from airframe.options import RunOptions
from airframe.server import create_app

MAX_TOKENS = 48
MODEL = "local"  # the server answers with its own model whatever is asked (no --strict-model)
NAME = {"type": "string", "maxLength": 8}


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [
    _object({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _object({"color": {"enum": ["red", "green", "blue"]}}),
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    _object({"user": _object({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "admin": {"type": "boolean"}})}),
    _object({"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, required=["zip"]),
    # the slow set
    # multipleOf bounds the digits: unbounded, Gemma 3 greedy writes "1.000..." until max_tokens
    _object({"score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}),
    _object({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}),
    {"enum": ["yes", "no", "maybe"]},
    _object({"ok": {"type": "boolean"}, "note": NAME}, required=["ok"]),
    _object({"point": _object({"x": {"type": "integer", "minimum": -10, "maximum": 10},
                               "y": {"type": "integer", "minimum": -10, "maximum": 10}})}),
    {"type": "integer", "minimum": 100, "maximum": 200},
    _object({"items": {"type": "array", "items": _object({"n": {"type": "integer", "minimum": 0, "maximum": 9}}),
                       "minItems": 1, "maxItems": 2}}),
    _object({"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0, "maximum": 50}}),
    _object({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}}),
    _object({"first": NAME, "last": NAME, "middle": NAME}, required=["first", "last"]),
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    _object({"level": {"type": "integer", "enum": [1, 2, 3]}, "label": {"enum": ["low", "mid", "high"]}}),
    _object({"a": _object({"b": _object({"c": {"type": "integer", "minimum": 0, "maximum": 5}})})}),
    _object({"price": {"type": "number", "minimum": 1, "maximum": 100}, "currency": {"enum": ["EUR", "USD"]}}),
    {"type": "string", "enum": ["north", "south", "east", "west"]},
]
DEFAULT_RUN = 5
PROMPT = [{"role": "user", "content": "Answer in JSON."}]


def _marked(schemas):
    return [pytest.param(s, id=f"schema{i}", marks=() if i < DEFAULT_RUN else pytest.mark.slow)
            for i, s in enumerate(schemas)]


@pytest.fixture(scope="module", params=["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def client(request):
    resolve_model(request.param)
    engine = Engine.load(request.param, backend="reference", options=RunOptions(n_ctx=256))
    with TestClient(create_app(engine)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0), http


@pytest.mark.parametrize("schema", _marked(SCHEMAS))
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "sampled"])
def test_json_schema_answers_validate(client, schema, sampling):
    api, _ = client
    answer = api.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, **sampling,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "sampled"])
def test_json_object_answers_parse(client, sampling):
    api, _ = client
    answer = api.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, **sampling,
                                         response_format={"type": "json_object"})
    choice = answer.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # an object the model kept writing: cut by max_tokens, every token still on the grammar's path
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_completion_takes_a_gbnf_grammar(client):
    api, _ = client
    answer = api.completions.create(model=MODEL, prompt="The answer is", max_tokens=8, temperature=0.0,
                                    extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert answer.choices[0].text in ("yes.", "no.")
    assert answer.choices[0].finish_reason == "stop"


def test_completion_takes_a_json_schema(client):
    api, _ = client
    schema = {"type": "integer", "minimum": 10, "maximum": 99}
    answer = api.completions.create(model=MODEL, prompt="A number:", max_tokens=8, temperature=0.0,
                                    extra_body={"json_schema": schema})
    jsonschema.validate(json.loads(answer.choices[0].text), schema)


def test_unsatisfiable_within_max_tokens_ends_with_length(client):
    api, _ = client
    schema = {"type": "string", "minLength": 200}
    answer = api.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=6, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "long", "schema": schema}})
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 6


def test_streamed_answer_keeps_to_the_schema(client):
    api, _ = client
    schema = SCHEMAS[1]
    chunks = api.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strng"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "empty"}}},
    {"extra_body": {"grammar": 'root ::= ("a"'}},
    {"extra_body": {"grammar": "root ::= no-such-rule"}},
])
def test_bad_schema_or_grammar_is_a_400(client, extra):
    api, _ = client
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, **extra)
    assert caught.value.status_code == 400
    assert caught.value.body["message"]
