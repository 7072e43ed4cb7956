"""A model whose weights hold NaN gives NonFiniteError naming the step, never a numpy traceback:
through `airframe run`, `airframe perplexity` and the server (a 500 with OpenAI's error body, and a
stream that ends with an error event), and on WebGPU for a sampled request. The engine's own checks
are in test_engine.py."""

import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from airframe.cli import main
from airframe.engine import Engine, GenerationParams
from airframe.errors import NonFiniteError
from airframe.options import RunOptions
from airframe.sampling import SamplingParams
from airframe.server import create_app
from test_server_api import assert_openai_error, post_stream

ENGLISH = Path(__file__).parent / "data" / "english.txt"


@pytest.fixture(scope="module")
def nan_client(nan_model_path):
    engine = Engine.load(nan_model_path, backend="reference", options=RunOptions(n_ctx=128))
    with TestClient(create_app(engine)) as client:
        yield client


def test_a_sampled_request_on_webgpu_names_the_step(nan_model_path):
    engine = Engine.load(nan_model_path, backend="webgpu", options=RunOptions(n_ctx=32))
    n_prompt = len(engine.tokenize_prompt("Hi"))
    with pytest.raises(NonFiniteError, match=rf"position {n_prompt - 1} \(for generated token 1\) hold 512 NaN"):
        engine.generate("Hi", GenerationParams(max_tokens=3, sampling=SamplingParams(seed=1)))


def test_the_server_answers_a_server_error_in_openai_shape(nan_client):
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 3}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})):
        error = assert_openai_error(nan_client.post(path, json=body), 500)
        assert (error["type"], error["code"]) == ("server_error", "non_finite_logits")
        assert "for generated token 1" in error["message"] and "NaN" in error["message"]


def test_a_stream_ends_with_an_error_event(nan_client):
    events = post_stream(nan_client, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "non_finite_logits" and "NaN" in events[-2]["error"]["message"]
    assert nan_client.get("/health").status_code == 200  # the server keeps serving


def test_max_tokens_beyond_the_context_is_refused_before_the_model_runs(nan_client):
    # a 400 about max_tokens, not the NaN model's 500: nothing ran
    error = assert_openai_error(nan_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 10**12}), 400)
    assert error["message"].startswith("max_tokens = 1000000000000, expected at most 128")


def test_perplexity_names_the_window_and_position(nan_model_path, capsys):
    code = main(["perplexity", str(nan_model_path), "--file", str(ENGLISH), "--ctx", "16",
                 "--backend", "reference", "--chunks", "2", "-q"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("airframe: error: the logits at position 8 of window 1 hold ")


def test_run_reports_it_on_a_line_of_its_own(nan_model_path):
    command = [sys.executable, "-m", "airframe", "run", str(nan_model_path), "Hi", "--backend", "reference",
               "-n", "3", "--ctx", "32"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stdout == "Hi\n"  # the echoed prompt's line is ended before the error
    assert "airframe: error: the logits at position" in done.stderr
