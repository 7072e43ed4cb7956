"""`airframe serve` for real: a subprocess with SmolLM2-135M on the WebGPU backend (lavapipe in
CI), spoken to with the official `openai` client and plain httpx.

Generations are greedy and short (a few tokens), because every token runs the whole model on a CPU
Vulkan driver. What is checked is the server: shapes, usage, stops, logprobs, that concurrent
requests do not disturb each other, and that a client who leaves stops its generation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

from airframe.models import resolve_model
from test_server_api import sse_data

MODEL = "smollm2-135m"
BACKEND = "webgpu"
CTX = 512
STARTUP_SECONDS = 600
GREEDY = {"temperature": 0.0}
MESSAGES = [{"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "The sky is",
           "Water boils at", "My favourite food is", "def add(a, b):", "Hello, my name is"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_ready(base: str, proc: subprocess.Popen, log) -> list[int]:
    """Poll /health until it answers 200; returns the statuses seen on the way."""
    seen, deadline = [], time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"`airframe serve` exited with {proc.returncode}:\n{log.read()[-4000:]}")
        try:
            status = httpx.get(f"{base}/health", timeout=5).status_code
        except httpx.TransportError:
            status = None
        if status is not None:
            seen.append(status)
        if status == 200:
            return seen
        time.sleep(0.2)
    pytest.fail(f"the server was not ready after {STARTUP_SECONDS} s")


@contextlib.contextmanager
def serve(*args: str):
    """`airframe serve MODEL ARGS` on the WebGPU backend and a free port, ready; yields its base URL."""
    resolve_model(MODEL)  # the model must be there: `airframe pull smollm2-135m`
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "airframe", "serve", MODEL, "--port", str(port), "--backend", BACKEND,
               "--log-level", "warning", *args]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            statuses = _wait_until_ready(base, proc, log)
            assert set(statuses) <= {200, 503}, statuses
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server():
    with serve("--ctx", str(CTX), "--alias", "smol") as base:
        yield base


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def chat_answer(api):
    return api.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=10, **GREEDY)


@pytest.fixture(scope="module")
def alone(api):
    """Each of PROMPTS completed on its own, one after the other."""
    return [_complete(api, prompt) for prompt in PROMPTS]


def _complete(api, prompt: str) -> tuple[str, int, int]:
    answer = api.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY)
    return answer.choices[0].text, answer.usage.prompt_tokens, answer.usage.completion_tokens


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def test_models_lists_the_model_and_its_context(api):
    cards = {m.id: m for m in api.models.list()}
    assert set(cards) == {MODEL, "smol"}
    assert cards[MODEL].context_length == CTX


def test_chat_completion(server, chat_answer):
    choice = chat_answer.choices[0]
    assert chat_answer.model == "smol" and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    rendered = httpx.post(f"{server}/tokenize", json={"messages": MESSAGES}, timeout=60).json()
    assert chat_answer.usage.prompt_tokens == rendered["count"]
    assert 1 <= chat_answer.usage.completion_tokens <= 10


def test_streamed_chat_with_usage_matches_the_plain_answer(api, chat_answer):
    stream = api.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=10, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_answer.choices[0].message.content
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        chat_answer.usage.prompt_tokens, chat_answer.usage.completion_tokens, chat_answer.usage.total_tokens)
    # the same prompt again: all of it but its last token comes from the prompt cache
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat_answer.choices[0].finish_reason


def test_stop_sequence_cuts_the_text_before_it(api):
    prompt = "1, 2, 3, 4,"
    free = api.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY).choices[0].text
    assert len(free) >= 4, f"the model said too little to pick a stop sequence from: {free!r}"
    stop = free[2:4]
    stopped = api.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stop=[stop], **GREEDY).choices[0]
    assert stopped.text == free[: free.index(stop)]
    assert stopped.finish_reason == "stop"


def test_completion_with_logprobs(api):
    answer = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, logprobs=3, **GREEDY)
    choice = answer.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert 1 <= len(lp.tokens) <= answer.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0.0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy takes the most likely token


def test_eight_concurrent_greedy_requests_match_each_request_alone(api, alone):
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _complete(api, p), PROMPTS))
    assert together == alone
    assert len({text for text, _, _ in alone}) > 1  # different prompts, different answers


def test_client_disconnect_cancels_the_generation(server, api, alone):
    end_ids = httpx.post(f"{server}/tokenize", json={"prompt": "<|endoftext|><|im_end|>"}, timeout=60).json()["tokens"]
    cancelled_before = _metric(server, "airframe_requests_cancelled_total")
    tokens_before = _metric(server, "airframe_completion_tokens_total")
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 400, "stream": True,
            "logit_bias": {str(i): -100 for i in end_ids}, **GREEDY}  # counting, with no way to stop
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=600) as response:
        received = [json.loads(data) for data, _ in zip(sse_data(response.iter_lines()), range(3))]
    assert all(event["choices"][0]["text"] for event in received), received
    deadline = time.monotonic() + 120
    while (_metric(server, "airframe_requests_cancelled_total") == cancelled_before
           or _metric(server, "airframe_requests_running") != 0):
        assert time.monotonic() < deadline, "the generation went on after the client left"
        time.sleep(0.2)
    assert _metric(server, "airframe_completion_tokens_total") - tokens_before < 40
    assert _complete(api, PROMPTS[0]) == alone[0]  # the next request is served, with clean K/V
