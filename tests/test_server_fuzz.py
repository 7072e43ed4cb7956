"""Requests generated from the server's own OpenAPI schema, valid and invalid (schemathesis):
whatever arrives, the answer is never a 5xx, and every error is in OpenAI's shape.

Runs against the fake engine; the example count is bounded so the whole file takes about a minute.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
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
