"""Requests generated from the server's own OpenAPI schema, valid and invalid (schemathesis):
whatever arrives, the answer is never a 5xx, and every error is in OpenAI's shape.

Runs against the fake engine; the example count is bounded so the whole file takes about a minute.
A second pair of tests goes beyond the schema with hypothesis: any JSON value in any field.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from airframe.server import create_app
from test_server_api import FakeEngine

EXAMPLES_PER_OPERATION = 60

app = create_app(FakeEngine(n_ctx=512))
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=EXAMPLES_PER_OPERATION,
    deterministic=True,
)


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_server_error(case):
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.path} answered {response.status_code}: {response.text}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_the_schema_covers_every_endpoint():
    paths = set(app.openapi()["paths"])
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize",
            "/health", "/metrics"} <= paths


# Beyond the schema: a valid body with one field swapped for any JSON value, or any JSON at all.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
VALID = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "Once", "max_tokens": 3},
    "/tokenize": {"prompt": "Once"},
    "/detokenize": {"tokens": [72, 105]},
}
FIELDS = sorted({"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                 "min_p", "repeat_penalty", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
                 "stream", "stream_options", "n", "logprobs", "top_logprobs", "response_format", "tools",
                 "tool_choice", "echo", "suffix", "best_of", "tokens", "content", "add_generation_prompt"})


def _post(client, path, body):
    # NaN and Infinity as Python's json writes them: the server's parser reads them too.
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(FakeEngine(n_ctx=512))) as c:
        yield c


@given(path=st.sampled_from(sorted(VALID)), field=st.sampled_from(FIELDS), value=json_values)
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
def test_any_value_in_any_field_gets_no_server_error(client, path, field, value):
    response = _post(client, path, {**VALID[path], field: value})
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


@given(path=st.sampled_from(sorted(VALID)), body=json_values)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_any_json_body_gets_no_server_error(client, path, body):
    response = _post(client, path, body)
    assert response.status_code < 500, response.text
