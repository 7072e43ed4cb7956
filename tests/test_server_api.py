"""The server's HTTP surface against a scripted fake engine: shapes, SSE framing, parameters,
errors, auth, model names, queue and metrics. Fast; the real model is in test_server_e2e.py.

FakeEngine and `serving` are shared with the other test_server_* modules.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from airframe.engine import Finish, Piece, TokenLogprob
from airframe.errors import ContextOverflowError
from airframe.server import ServerOptions, create_app
from airframe.server.queue import END, Job, QueueFullError, RequestQueue

BOS = 256
REPLY = "Hello there! This is the fake engine talking."


class FakeTokenizer:
    """Byte-level: token id = byte value, and one BOS id."""

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""


class FakeEngine:
    """The Engine interface with scripted output: the reply, one byte-token at a time.

    A prompt containing "echo" makes the reply the prompt's last 12 characters instead, so
    different requests give different answers.
    """

    def __init__(self, reply: str = REPLY, n_ctx: int = 256, delay: float = 0.0):
        self.reply, self.n_ctx, self.delay = reply, n_ctx, delay
        self.model_id = "fake-model"
        self.config = SimpleNamespace(vocab_size=300)
        self.tokenizer = FakeTokenizer()
        self.template = SimpleNamespace(tool_format="hermes", knows_tools=False)
        self.prepared: list[tuple] = []  # (prompt, parse_special_in_content, tools) per prepare()
        self.calls: list[tuple] = []  # (prompt ids, params) per stream_ids()
        self.resets = 0

    def render_chat(self, messages, add_generation_prompt=True, tools=None):
        text = f"<tools>{json.dumps(tools)}\n" if tools else ""
        text += "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def tokenize_prompt(self, prompt, parse_special_in_content=False, add_generation_prompt=True, tools=None):
        text = self.render_chat(prompt, add_generation_prompt, tools) if isinstance(prompt, list) else prompt
        return [BOS, *text.encode("utf-8")]

    def prepare(self, prompt, params, parse_special_in_content=False, tools=None):
        self.prepared.append((prompt, parse_special_in_content, tools))
        ids = self.tokenize_prompt(prompt, tools=tools)
        if len(ids) + 1 > self.n_ctx:
            raise ContextOverflowError(f"the prompt has {len(ids)} tokens and the context holds {self.n_ctx}")
        return ids

    def stream_ids(self, ids, params, cancel=None):
        self.calls.append((ids, params))
        text = bytes(ids[1:]).decode("utf-8")
        reply = text.rstrip("<assistant>\n")[-12:] if "echo" in text else self.reply
        return self._generate(len(ids), reply, params, cancel)

    def _generate(self, n_prompt, reply, params, cancel):
        self.resets += 1
        found = [reply.find(s) for s in params.stop if s and s in reply]
        visible = reply[: min(found)] if found else reply
        reason, n = "stop", 0
        for ch in visible:
            if params.max_tokens is not None and n >= params.max_tokens:
                reason = "length"
                break
            if cancel is not None and cancel():
                reason = "cancelled"
                break
            time.sleep(self.delay)
            n += 1
            yield Piece(ch, [ord(ch)], self._logprobs(ch, params))
        yield Finish(reason, n_prompt, n, 0.002, 0.001 * n)

    @staticmethod
    def _logprobs(ch, params):
        if params.logprobs is None:
            return None
        top = [(ch, ord(ch), -0.25), ("x", ord("x"), -2.0)][: params.logprobs]
        return [TokenLogprob(ch, ord(ch), -0.25, list(ch.encode()), top)]


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine)) as c:
        yield c


def openai_client(http_client, api_key="none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_client.base_url}/v1", api_key=api_key, http_client=http_client, max_retries=0)


@contextlib.contextmanager
def serving(app):
    """Run `app` under uvicorn on a free loopback port in a thread; yields the base URL."""
    import uvicorn

    # proto=IPPROTO_TCP so asyncio sets TCP_NODELAY on accepted connections (else each answer
    # waits ~40 ms for a delayed ACK), as it does when uvicorn binds the port itself.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def sse_events(lines) -> list:
    """The payloads of an SSE body, checking OpenAI's framing: `data: ...` lines, blank separators
    (and `: comment` keep-alives, which clients skip)."""
    events, expect_blank = [], False
    for line in lines:
        if expect_blank:
            assert line == "", f"expected a blank line after each event, found {line!r}"
            expect_blank = False
            continue
        if line.startswith(": "):
            expect_blank = True
            continue
        assert line.startswith("data: "), f"expected 'data: ...', found {line!r}"
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
        expect_blank = True
    return events


def sse_data(lines):
    """The data of each event, read as any conforming SSE client reads a stream: comment lines
    (`: waiting`) and other fields skipped, `data:` with or without its space, lines of one event
    joined, an event ended by a blank line. Lazy, so that a test can stop reading at any event."""
    data = []
    for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            if field == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def post_stream(client, path, body) -> list:
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.iter_lines())


def assert_openai_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# ---- health, models ----


def test_health_and_models(client, engine):
    assert client.get("/health").json() == {"status": "ok", "model": "fake-model", "message": None}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["context_length"]) for m in models["data"]] == [("fake-model", engine.n_ctx)]


def test_health_is_503_while_loading_then_200():
    release = threading.Event()

    def load():
        release.wait(10)
        return FakeEngine()

    with TestClient(create_app(load)) as c:
        loading = c.get("/health")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        busy = c.post("/v1/completions", json={"prompt": "hi"})
        assert_openai_error(busy, 503)
        assert busy.headers["retry-after"] == "1"
        release.set()
        app_state = c.app.state.airframe
        assert app_state.loaded.wait(5)
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200


def test_a_failed_load_is_reported_by_health():
    def load():
        raise FileNotFoundError("no such model: nowhere.gguf")

    with TestClient(create_app(load)) as c:
        assert c.app.state.airframe.loaded.wait(5)
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert "nowhere.gguf" in health.json()["message"]
        assert "nowhere.gguf" in assert_openai_error(c.get("/v1/models"), 503)["message"]


# ---- chat completions ----


def test_chat_completion_through_the_openai_client(client, engine):
    api = openai_client(client)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    answer = api.chat.completions.create(model="anything", messages=messages, max_tokens=200)
    assert answer.object == "chat.completion" and answer.model == "fake-model"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == REPLY
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens == len(engine.tokenize_prompt(messages))
    assert answer.usage.completion_tokens == len(REPLY)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + len(REPLY)


def test_chat_length_limit_and_max_completion_tokens(client, engine):
    api = openai_client(client)
    short = api.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content == REPLY[:5] and short.usage.completion_tokens == 5
    both = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "max_completion_tokens": 3}).json()
    assert both["choices"][0]["message"]["content"] == REPLY[:3]


def test_chat_stream_framing_role_first_and_usage_last(client):
    events = post_stream(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert text == REPLY
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "stop" and finish["delta"] == {}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len(REPLY)


def test_chat_stream_without_usage_has_no_usage_field(client):
    events = post_stream(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True})
    assert all("usage" not in c for c in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_chat_stream_through_the_openai_client(client):
    api = openai_client(client)
    stream = api.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], stream=True,
                                         stream_options={"include_usage": True}, max_tokens=10)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY[:10]
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_logprobs_shape(client):
    api = openai_client(client)
    answer = api.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert [t.token for t in content] == list(REPLY[:4])
    assert all(t.logprob == -0.25 and t.bytes == list(t.token.encode()) for t in content)
    assert [len(t.top_logprobs) for t in content] == [2] * 4
    assert content[0].top_logprobs[1].token == "x" and content[0].top_logprobs[1].bytes == [ord("x")]


def test_chat_stream_logprobs_ride_on_the_chunks(client):
    events = post_stream(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 3, "logprobs": True})
    tokens = [t["token"] for c in events[1:-2] for t in c["choices"][0]["logprobs"]["content"]]
    assert tokens == list(REPLY[:3])


def test_content_parts_and_developer_role_reach_the_template(client, engine):
    client.post("/v1/chat/completions", json={"messages": [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]})
    prompt, _, _ = engine.prepared[-1]
    assert prompt == [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Hello"}]


def test_sampling_fields_reach_the_engine(client, engine):
    client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.3, "top_p": 0.5, "top_k": 7, "min_p": 0.1,
        "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 42,
        "logit_bias": {"65": -100}, "stop": "there", "max_tokens": 9, "user": "someone", "unknown_field": [1, 2]})
    _, params = engine.calls[-1]
    s = params.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repeat_penalty) == (0.3, 0.5, 7, 0.1, 1.2)
    assert (s.presence_penalty, s.frequency_penalty, s.seed, s.logit_bias) == (0.5, -0.5, 42, {65: -100.0})
    assert params.stop == ["there"] and params.max_tokens == 9 and params.logprobs is None


def test_left_out_fields_take_the_engine_defaults(client, engine):
    from airframe.sampling import SamplingParams

    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    _, params = engine.calls[-1]
    assert params.sampling == SamplingParams() and params.max_tokens is None and params.stop == []


def test_stop_sequence_ends_the_answer(client):
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "stop": ["!", "zz"]}).json()
    assert body["choices"][0]["message"]["content"] == "Hello there"
    assert body["choices"][0]["finish_reason"] == "stop"


# ---- text completions ----


def test_completion_with_legacy_logprobs(client):
    api = openai_client(client)
    answer = api.completions.create(model="m", prompt="Once", max_tokens=6, logprobs=2)
    choice = answer.choices[0]
    assert answer.object == "text_completion" and choice.text == REPLY[:6] and choice.finish_reason == "length"
    assert choice.logprobs.tokens == list(REPLY[:6])
    assert choice.logprobs.token_logprobs == [-0.25] * 6
    assert choice.logprobs.text_offset == list(range(6))
    assert choice.logprobs.top_logprobs[0] == {REPLY[0]: -0.25, "x": -2.0}
    assert answer.usage.prompt_tokens == 1 + len("Once")


def test_completion_prompt_as_a_list_of_one_string(client):
    body = client.post("/v1/completions", json={"prompt": ["Once"], "max_tokens": 3}).json()
    assert body["choices"][0]["text"] == REPLY[:3]


def test_completion_stream_offsets_continue_across_chunks(client):
    events = post_stream(client, "/v1/completions", {"prompt": "Once", "max_tokens": 4, "stream": True, "logprobs": 0,
                                                      "stream_options": {"include_usage": True}})
    pieces = [c for c in events[:-1] if c["choices"] and c["choices"][0]["text"]]
    assert "".join(c["choices"][0]["text"] for c in pieces) == REPLY[:4]
    assert [c["choices"][0]["logprobs"]["text_offset"][0] for c in pieces] == [0, 1, 2, 3]
    assert events[-2]["usage"]["total_tokens"] == 5 + 4 and events[-2]["choices"] == []
    assert all(c["object"] == "text_completion" for c in events[:-1])


# ---- errors ----


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "Hi"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "Hi"}], "top_p": 1.5}, "top_p"),
    ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "Hi"}], "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "Hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"300": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"3": 101}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "Hi"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "Hi"}], "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "Hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "Hi"}], "grammar": "root ::= (\"a\""}, "grammar"),
    ({"messages": [{"role": "user", "content": "Hi"}], "grammar": "root ::= undefined-rule"}, "grammar"),
    ({"messages": [{"role": "user", "content": "Hi"}], "grammar": "root ::= \"a\"", "json_schema": {}}, "grammar"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "function", "content": "42"}]}, "messages.0.role"),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
])
def test_bad_chat_requests_get_openai_shaped_400(client, body, param):
    error = assert_openai_error(client.post("/v1/chat/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, "json_schema"),
    ({"prompt": "x", "grammar": ""}, "grammar"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": 5}, "prompt"),
])
def test_bad_completion_requests_get_400(client, body, param):
    assert_openai_error(client.post("/v1/completions", json=body), 400, param)


def test_malformed_json_and_wrong_top_level_get_400(client):
    bad_json = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert assert_openai_error(bad_json, 400)["code"] == "invalid_json"
    assert_openai_error(client.post("/v1/chat/completions", json=[1, 2]), 400)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["a\\udfff"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/tokenize", '{"content": "\\ud83d"}', "content"),
])
def test_lone_surrogates_are_refused(client, path, body, param):
    response = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert "surrogate" in assert_openai_error(response, 400, param)["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_sent_as_json_is_refused(client, content_type):
    headers = {"content-type": content_type} if content_type else {}
    body = json.dumps({"prompt": "hi"}).encode()
    error = assert_openai_error(client.post("/v1/completions", content=body, headers=headers), 400)
    assert error["code"] == "invalid_content_type" and "application/json" in error["message"]


def test_prompt_longer_than_the_context_names_both_sizes(client, engine):
    prompt = "x" * 300
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": prompt}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    assert "301" in error["message"] and str(engine.n_ctx) in error["message"]
    stream = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "stream": True})
    assert assert_openai_error(stream, 400, "messages")["code"] == "context_length_exceeded"


def test_unknown_path_and_method_are_openai_shaped(client):
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get("/v1/chat/completions"), 405)


def test_api_key(engine):
    with TestClient(create_app(engine, ServerOptions(api_key="sesame"))) as c:
        assert c.get("/health").status_code == 200
        body = {"prompt": "hi", "max_tokens": 2}
        assert assert_openai_error(c.post("/v1/completions", json=body), 401)["type"] == "authentication_error"
        wrong = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert_openai_error(wrong, 401)
        assert_openai_error(c.get("/metrics"), 401)
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai_client(c, api_key="nope").models.list()
        assert [m.id for m in openai_client(c, api_key="sesame").models.list()] == ["fake-model"]


def test_strict_model_accepts_only_the_id_and_aliases(engine):
    options = ServerOptions(aliases=("smol", "tiny"), strict_model=True)
    with TestClient(create_app(engine, options)) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["fake-model", "smol", "tiny"]
        ok = c.post("/v1/completions", json={"model": "smol", "prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["model"] == "smol"
        error = assert_openai_error(c.post("/v1/completions", json={"model": "gpt-4o", "prompt": "hi"}), 404, "model")
        assert error["code"] == "model_not_found" and "gpt-4o" in error["message"] and "smol" in error["message"]


def test_any_model_name_is_served_without_strict_model(client):
    body = client.post("/v1/completions", json={"model": "gpt-4o", "prompt": "hi", "max_tokens": 1}).json()
    assert body["model"] == "fake-model"


# ---- tokenize, detokenize ----


def test_tokenize_and_detokenize_round_trip(client, engine):
    tokens = client.post("/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["tokens"] == engine.tokenize_prompt("héllo") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == engine.n_ctx
    assert client.post("/tokenize", json={"content": "héllo"}).json()["tokens"] == tokens["tokens"]
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == engine.tokenize_prompt([{"role": "user", "content": "Hi"}])
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"content": "héllo"}
    assert_openai_error(client.post("/detokenize", json={"tokens": [5, 999]}), 400, "tokens")
    assert_openai_error(client.post("/tokenize", json={}), 400)


# ---- queue and metrics ----


def test_queue_full_answers_503_with_retry_after():
    engine = FakeEngine(delay=0.05)
    with TestClient(create_app(engine, ServerOptions(max_queue=0))) as c:
        first = threading.Thread(target=c.post, args=("/v1/completions",), kwargs={"json": {"prompt": "a", "max_tokens": 20}})
        first.start()
        state = c.app.state.airframe
        deadline = time.monotonic() + 5
        while state.queue.running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = c.post("/v1/completions", json={"prompt": "b"})
        assert assert_openai_error(refused, 503)["type"] == "server_overloaded"
        assert refused.headers["retry-after"] == "1"
        first.join()


class _GatedEngine(FakeEngine):
    """The fake engine whose generations wait for `gate`."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def stream_ids(self, ids, params, cancel=None):
        self.gate.wait(60)
        return super().stream_ids(ids, params, cancel)


def test_200_concurrent_requests_with_max_queue_64_leave_exactly_64_waiting():
    import asyncio

    engine = _GatedEngine()
    app = create_app(engine, ServerOptions(max_queue=64))
    state = app.state.airframe

    async def flood(url):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
            async def one():
                response = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
                if response.status_code == 503:
                    refused.append(response.headers["retry-after"])
                return response.status_code

            tasks = [asyncio.create_task(one()) for _ in range(200)]
            while len(refused) < 200 - 65:  # one runs, 64 wait: every other one is refused at once
                await asyncio.sleep(0.05)  # a poll that yields: waiting on finished tasks would spin
            assert (state.queue.running, state.queue.depth) == (1, 64)
            engine.gate.set()
            statuses = await asyncio.gather(*tasks)
            assert state.queue.depth == 0
            return statuses

    refused: list[str] = []
    with serving(app) as url:
        statuses = asyncio.run(asyncio.wait_for(flood(url), 120))
    assert statuses.count(200) == 65 and statuses.count(503) == 135 and set(refused) == {"1"}


class _RecordingEngine:
    def __init__(self):
        self.order, self.gate = [], threading.Event()

    def stream_ids(self, prompt, params, cancel=None):
        self.gate.wait(5)
        self.order.append(prompt)
        yield Finish("stop", 1, 0, 0.0, 0.0)


def _drain(job: Job) -> list:
    out = []
    while True:
        item = job.events.get_nowait() if not job.events.empty() else None
        if item is END:
            return out
        if item is not None:
            out.append(item)


def test_queue_is_fifo_bounded_and_cancelling_a_waiting_job_frees_its_place():
    import asyncio

    loop = asyncio.new_event_loop()
    engine = _RecordingEngine()
    skipped = []
    queue = RequestQueue(engine, max_waiting=2, on_skip=skipped.append)
    jobs = [Job(f"p{i}", None, loop) for i in range(4)]
    queue.submit(jobs[0])
    while queue.running == 0:
        time.sleep(0.005)
    queue.submit(jobs[1])
    queue.submit(jobs[2])
    with pytest.raises(QueueFullError, match="--max-queue is 2"):
        queue.submit(jobs[3])
    jobs[1].cancel()
    assert queue.depth == 1 and skipped == [jobs[1]]
    queue.submit(jobs[3])
    engine.gate.set()
    while engine.order != ["p0", "p2", "p3"]:
        assert len(engine.order) <= 3, engine.order
        time.sleep(0.005)
    queue.close()
    loop.run_until_complete(asyncio.sleep(0.01))
    assert [type(e).__name__ for e in _drain(jobs[0])] == ["Finish"]
    loop.close()


def test_metrics_count_requests_tokens_and_times(client):
    client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 7})
    client.post("/v1/completions", json={"prompt": "x", "temperature": 9})
    text = client.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = text.text.splitlines()
    assert 'airframe_requests_total{endpoint="/v1/completions",status="200"} 1' in lines
    assert 'airframe_requests_total{endpoint="/v1/completions",status="400"} 1' in lines
    assert "airframe_prompt_tokens_total 5" in lines
    assert "airframe_prompt_tokens_cached_total 0" in lines and "airframe_prompt_tokens_computed_total 5" in lines
    assert "airframe_completion_tokens_total 7" in lines
    assert "airframe_prefill_seconds_count 1" in lines and "airframe_decode_seconds_count 1" in lines
    assert 'airframe_prefill_seconds_bucket{le="0.005"} 1' in lines
    assert "airframe_queue_wait_seconds_count 1" in lines and "airframe_time_to_first_token_seconds_count 1" in lines
    # the fake engine's Finish: 7 tokens, 0.007 s of decode, so 0.007 / 6 s after the first
    assert 'airframe_time_per_output_token_seconds_bucket{le="0.001"} 0' in lines
    assert 'airframe_time_per_output_token_seconds_bucket{le="0.0025"} 1' in lines
    assert "airframe_queue_depth 0" in lines and "airframe_requests_cancelled_total 0" in lines
    for line in lines:
        assert line.startswith("#") or len(line.split(" ")) == 2, line


def test_time_to_first_token_counts_the_wait_in_the_queue():
    """Two requests at once on one slot: the second waits for the first's 5 tokens (0.05 s each)
    before it starts, and its time to first token includes that wait."""
    engine = FakeEngine(delay=0.05)
    with TestClient(create_app(engine, ServerOptions(max_queue=4))) as c:
        state = c.app.state.airframe
        threads = [threading.Thread(target=c.post, args=("/v1/completions",),
                                    kwargs={"json": {"prompt": p, "max_tokens": 5}}) for p in "ab"]
        threads[0].start()
        deadline = time.monotonic() + 5
        while state.queue.running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        threads[1].start()
        for t in threads:
            t.join()
        m = state.metrics
        assert m.queue_wait_seconds.count == 2 and m.time_to_first_token.count == 2
        waits = m.queue_wait_seconds._sum
        assert 0.15 < waits < 2  # the second request's wait, about 5 x 0.05 s less what it took to send
        assert m.time_to_first_token._sum >= waits + 2 * 0.05  # each one's first token after its wait


def test_client_disconnect_cancels_the_generation_within_a_token():
    engine = FakeEngine(reply="z" * 2000, n_ctx=4096, delay=0.01)
    app = create_app(engine)
    with serving(app) as url:
        body = {"prompt": "go", "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            events = sse_data(response.iter_lines())
            for _ in range(3):
                assert json.loads(next(events))["choices"][0]["text"] == "z"
        metrics = app.state.airframe.metrics
        deadline = time.monotonic() + 10
        while metrics.cancelled.value() == 0:
            assert time.monotonic() < deadline, "the disconnect did not cancel the generation"
            time.sleep(0.02)
        assert metrics.completion_tokens.value() < 200
        after = httpx.post(f"{url}/v1/completions", json={"prompt": "again", "max_tokens": 3}, timeout=30).json()
        assert after["choices"][0]["text"] == "zzz"


def test_client_disconnect_while_waiting_in_the_queue_frees_its_place():
    engine = FakeEngine(reply="z" * 300, n_ctx=4096, delay=0.01)
    app = create_app(engine)
    state = app.state.airframe
    with serving(app) as url:
        first = threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                 kwargs={"json": {"prompt": "a", "max_tokens": 150}, "timeout": 30})
        first.start()
        while state.queue.running == 0:
            time.sleep(0.01)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"prompt": "b", "max_tokens": 5}, timeout=0.3)
        deadline = time.monotonic() + 5
        while state.metrics.cancelled.value() == 0:
            assert time.monotonic() < deadline, "the waiting request was not dropped"
            time.sleep(0.02)
        assert state.queue.depth == 0
        first.join()
        assert len(engine.calls) == 1  # the abandoned request never reached the engine


def test_models_retrieve_answers_for_the_id_and_aliases_only(engine):
    with TestClient(create_app(engine, ServerOptions(aliases=("smol",)))) as c:
        api = openai_client(c)
        assert api.models.retrieve("smol").context_length == engine.n_ctx
        assert_openai_error(c.get("/v1/models/gpt-4o"), 404, "model")


def test_without_an_api_key_the_host_header_must_name_this_machine(engine):
    body = {"prompt": "hi", "max_tokens": 1}
    with TestClient(create_app(engine, ServerOptions(bind_host="127.0.0.1", allowed_hosts=("box.lan",)))) as c:
        for host in ("localhost:8080", "127.0.0.1:8080", "[::1]:8080", "LOCALHOST", "box.lan:80", "localhost."):
            assert c.post("/v1/completions", json=body, headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8080", "localhost.evil.example", "127.0.0.1.evil.example"):
            refused = c.post("/v1/completions", json=body, headers={"Host": host})
            error = assert_openai_error(refused, 403)
            assert error["code"] == "host_not_allowed" and "--allowed-host" in error["message"]
        assert c.get("/health", headers={"Host": "evil.example"}).status_code == 403
    open_ones = [ServerOptions(bind_host="127.0.0.1", api_key="k"), ServerOptions(bind_host="0.0.0.0"),
                 ServerOptions(bind_host="127.0.0.1", allowed_hosts=("*",)), ServerOptions()]
    for options in open_ones:
        with TestClient(create_app(engine, options)) as c:
            answer = c.post("/v1/completions", json=body, headers={"Host": "evil.example", "Authorization": "Bearer k"})
            assert answer.status_code == 200, options


def _preflight(client, origin):
    return client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})


def test_cors_allows_local_front_ends_and_named_origins(engine):
    with TestClient(create_app(engine, ServerOptions(cors_origins=("https://chat.example",)))) as c:
        for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "https://chat.example"):
            response = _preflight(c, origin)
            assert response.status_code == 200 and response.headers["access-control-allow-origin"] == origin
        assert "access-control-allow-origin" not in _preflight(c, "http://localhost.evil.example").headers
        answer = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"Origin": "http://localhost:3000"})
        assert answer.headers["access-control-allow-origin"] == "http://localhost:3000"


class _FailingEngine(FakeEngine):
    """Breaks after two pieces, as a device failure would."""

    def _generate(self, n_prompt, reply, params, cancel):
        yield Piece("a", [97], None)
        yield Piece("b", [98], None)
        raise RuntimeError("device lost")


def test_a_failure_mid_stream_ends_the_stream_with_an_error_event():
    with TestClient(create_app(_FailingEngine())) as c:
        events = post_stream(c, "/v1/completions", {"prompt": "hi", "stream": True})
        assert [e["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
        assert "device lost" in events[2]["error"]["message"] and events[3] == "[DONE]"
        plain = c.post("/v1/completions", json={"prompt": "hi"})
        assert "device lost" in assert_openai_error(plain, 500)["message"]
        assert c.post("/v1/completions", json={"prompt": "hi", "stream": True}).status_code == 200  # still serving


def test_a_token_id_the_reference_backend_refuses_is_a_400(tmp_path):
    """SmolLM2's tokenizer over a 512-token synthetic model: the prompt's ids are outside its
    vocabulary, which the reference backend reports as a ParameterError, so 400 and not 500."""
    from airframe.engine import Engine
    from airframe.model import open_model
    from airframe.options import RunOptions
    from airframe.reference import ReferenceBackend
    from airframe.synthetic import write_synthetic_gguf
    from test_engine import Model

    smollm2 = Model("smollm2-135m")
    tiny = open_model(write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", "tiny", "F32"))
    backend = ReferenceBackend.load(tiny, RunOptions(n_ctx=64))
    engine = Engine(backend, smollm2.tokenizer, smollm2.template, "mismatched")
    with TestClient(create_app(engine)) as c:
        error = assert_openai_error(c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 2}), 400)
        assert "outside the vocabulary 0..511" in error["message"] and error["code"] == "invalid_value"


def test_a_stream_waiting_in_the_queue_gets_keep_alive_comments(monkeypatch):
    from airframe.server import routes

    monkeypatch.setattr(routes, "KEEPALIVE_SECONDS", 0.05)
    engine = FakeEngine(delay=0.02)
    with TestClient(create_app(engine)) as c:
        first = threading.Thread(target=c.post, args=("/v1/completions",), kwargs={"json": {"prompt": "a", "max_tokens": 25}})
        first.start()
        while c.app.state.airframe.queue.running == 0:
            time.sleep(0.01)
        with c.stream("POST", "/v1/completions", json={"prompt": "b", "max_tokens": 3, "stream": True}) as response:
            lines = list(response.iter_lines())
        first.join()
    assert lines[0] == ": waiting"  # sent while the first request still ran
    assert "".join(e["choices"][0]["text"] for e in sse_events(lines)[:-1] if e["choices"]) == REPLY[:3]


def test_the_openai_client_skips_keep_alive_comments(monkeypatch):
    from airframe.server import routes

    monkeypatch.setattr(routes, "KEEPALIVE_SECONDS", 0.005)  # several comments between tokens
    with TestClient(create_app(FakeEngine(delay=0.03))) as c:
        stream = openai_client(c).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == REPLY[:5]


# ---- the prompt cache, with a real engine -----------------------------------------------------------
CONVERSATION = ["Hi!", "What is a river?", "Name one.", "How long is it?", "And the widest?",
                "Thanks.", "One more question.", "Bye!"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from airframe.synthetic import write_synthetic_gguf

    return write_synthetic_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "llama", "tiny", "Q8_0")


def _tiny_engine(path, prompt_cache: bool, slots: int | None = None):
    from airframe.engine import Engine
    from airframe.options import RunOptions

    return Engine.load(path, backend="webgpu", options=RunOptions(n_ctx=1024, prefill_chunk=16,
                                                                   prompt_cache=prompt_cache, slots=slots))


def _eight_turns(api: openai.OpenAI, stream: bool) -> tuple[list[str], list]:
    """The scripted conversation, greedy, each answer sent back in the next turn: answers and usages."""
    messages, answers, usages = [], [], []
    for turn in CONVERSATION:
        messages.append({"role": "user", "content": turn})
        asked = dict(model="tiny", messages=messages, max_tokens=8, temperature=0.0)
        if stream:
            chunks = list(api.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usages.append(chunks[-1].usage)
        else:
            answer = api.chat.completions.create(**asked)
            text = answer.choices[0].message.content
            usages.append(answer.usage)
        answers.append(text)
        messages.append({"role": "assistant", "content": text})
    return answers, usages


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_conversation_through_the_server_gives_the_same_bytes_with_the_prompt_cache(tiny_model, stream):
    answers = {}
    for cache in (True, False):
        app = create_app(_tiny_engine(tiny_model, cache))
        with TestClient(app) as c:
            answers[cache], usages = _eight_turns(openai_client(c), stream)
            metrics = app.state.airframe.metrics
        cached = [u.prompt_tokens_details.cached_tokens for u in usages]
        if cache:
            assert cached[0] == 0 and all(n > 0 for n in cached[1:])
            assert all(u.prompt_tokens - n < 40 for u, n in zip(usages[1:], cached[1:]))  # only the new turn ran
        else:
            assert cached == [0] * len(CONVERSATION)
        assert metrics.prompt_tokens_cached.value() == sum(cached)
        assert metrics.prompt_tokens_computed.value() == sum(u.prompt_tokens for u in usages) - sum(cached)
    assert [a.encode() for a in answers[True]] == [a.encode() for a in answers[False]]


def test_a_request_opts_out_of_the_prompt_cache(tiny_model):
    with TestClient(create_app(_tiny_engine(tiny_model, True))) as c:
        body = {"prompt": "The same prompt twice", "max_tokens": 2, "temperature": 0}
        c.post("/v1/completions", json=body)
        again = c.post("/v1/completions", json=body).json()["usage"]
        assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1
        opted_out = c.post("/v1/completions", json={**body, "cache_prompt": False}).json()["usage"]
        assert opted_out["prompt_tokens_details"] == {"cached_tokens": 0}
        bad = c.post("/v1/completions", json={**body, "cache_prompt": "sometimes"})
        assert bad.status_code == 400 and "cache_prompt" in bad.text


def test_two_interleaved_conversations_over_two_slots_give_the_same_bytes(tiny_model):
    """Turns of two chats alternate: with two slots each second turn keeps its own chat's prefix."""
    answers, cached = {}, []
    for cache in (True, False):
        with TestClient(create_app(_tiny_engine(tiny_model, cache, slots=2 if cache else None))) as c:
            api = openai_client(c)
            chats = {name: [{"role": "system", "content": f"You are assistant {name}."}] for name in "ab"}
            answers[cache] = []
            for turn in CONVERSATION[:4]:
                for name, messages in chats.items():
                    messages.append({"role": "user", "content": f"{turn} ({name})"})
                    answer = api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.0)
                    messages.append({"role": "assistant", "content": answer.choices[0].message.content})
                    answers[cache].append(answer.choices[0].message.content)
                    if cache:
                        cached.append((answer.usage.prompt_tokens, answer.usage.prompt_tokens_details.cached_tokens))
    assert [a.encode() for a in answers[True]] == [a.encode() for a in answers[False]]
    for i in range(2, len(cached)):  # every later turn keeps all of its own chat's turn before
        assert cached[i][1] >= cached[i - 2][0], (i, cached)


def test_a_device_failure_is_a_server_error():
    from airframe.errors import GPUError
    from airframe.server.errors import from_airframe

    error = from_airframe(GPUError("cuMemcpyHtoD failed: CUDA_ERROR_INVALID_CONTEXT"))
    assert (error.status, error.type, error.code) == (500, "server_error", "gpu_error")
