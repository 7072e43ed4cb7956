"""`airframe bench`'s WebGPU numbers (airframe/gpu/bench.py) on a tiny synthetic model: every number
is there and labelled, the per-op breakdown covers every op class, and a failing measurement keeps
the others."""

import contextlib
import io
import json

import pytest

from airframe.errors import ParameterError
from airframe.gpu import bench
from airframe.synthetic import write_synthetic_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", "tiny", "Q8_0")


@pytest.fixture(scope="module")
def run(tiny):
    """One run's result and what it wrote on stderr, announced as slow (slow_s 0) to see that line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = bench.bench_webgpu(tiny, [1, 70], steps=4, prefill_tokens=64, slow_s=0.0)
    return result, err.getvalue()


@pytest.fixture(scope="module")
def result(run):
    return run[0]


def test_bench_reports_prefill_decode_and_the_floor(result):
    p = result["prefill"]
    assert p["tokens_per_s"] > 0 and p["tokens_per_s_at_depth"] > 0 and p["ttft_s"] > 0
    assert (p["tokens"], p["depth"], p["ttft_tokens"]) == (64, 70, 70)  # sized to what was asked
    assert [d["context"] for d in result["decode"]] == [1, 70]
    assert all(d["chained_ms"] > 0 and d["sampled_ms"] > 0 and d["sampled_full_ms"] > 0 and d["constrained_ms"] > 0
               and d["floor_ms"] > 0 for d in result["decode"])
    for d in result["decode"]:  # the constrained tokens chained on the GPU, each answer's first on the host
        assert d["constrained_tokens"]["drawn"] >= 4 - d["constrained_tokens"]["restarts"]
        assert d["constrained_tokens"]["host"] >= 1
    # as many beyond 64 positions: the attention's splits are combined inside its own dispatch
    assert result["decode"][1]["dispatches"] == result["decode"][0]["dispatches"]
    low, high = result["bandwidth_spread_GBps"]
    assert low <= result["bandwidth_GBps"] <= high
    text = bench.format_result(result)
    assert "chained greedy" in text and "chained on the GPU / full logits / constrained" in text
    assert "constrained tokens drawn on the GPU" in text and "time to first token" in text
    host = result["sampled_host_ms"]  # a sampled token's host work, beside the greedy token's recording
    assert set(host) == {"table", "record", "sample"} and all(ms > 0 for ms in host.values())
    assert "a sampled token's host work: table" in text


def test_the_gpu_breakdown_covers_every_op_class(result):
    """A decode token's pass, and a chunk's at depth 0 and at the deepest context asked for."""
    decode, chunk, deep = result["gpu"][0], result["gpu"][-2], result["gpu"][-1]
    assert (decode["n_tokens"], chunk["n_tokens"], deep["n_tokens"]) == (1, 64, 64)
    assert (chunk["position"], deep["position"]) == (0, 70)
    for g in (decode, chunk, deep):
        assert {"qkv", "attention", "attn_output", "ffn_gate_up", "ffn_down", "lm_head"} <= set(g["ops_ms"])
        assert all(ms >= 0 for ms in g["ops_ms"].values()) and g["total_ms"] > 0
    assert "rope" in chunk["ops_ms"] and "rope" not in decode["ops_ms"]  # a decode token's attention rotates


def test_the_constrained_row_times_its_steps_over_answers_the_grammar_ends_early(tiny, monkeypatch):
    """An enum's answers are a few tokens each: the row runs as many as it takes to time `steps`."""
    from airframe.constraint import Constraint, json_schema_grammar
    from airframe.gpu.backend import WebGPUBackend
    from airframe.model import open_model
    from airframe.options import RunOptions
    from airframe.tokenizer import load_tokenizer

    be = WebGPUBackend.load(open_model(tiny), RunOptions(n_ctx=32))
    grammar, tokenizer = json_schema_grammar({"enum": ["yes please", "no thanks"]}), load_tokenizer(be.gf)
    made, answers = [], []  # each answer's Constraint and tokens
    stream_tokens = be.sample_stream

    def counted(sampler, history, tokens):
        answers.append([])
        for token in stream_tokens(sampler, history, tokens):
            answers[-1].append(token)
            yield token

    def constrain():
        made.append(Constraint(grammar, tokenizer))
        return made[-1]

    monkeypatch.setattr(be, "sample_stream", counted)
    assert bench.sampled_decode_ms(be, 8, 12, constrain=constrain) > 0
    assert len(made) >= 3 and all(c.done for c in made[1:-1])  # the warm-up's and the last answer may stop early
    assert sum(len(tokens) - 1 for tokens in answers[1:]) == 12  # timed: every token but an answer's first


def test_failing_measurements_keep_the_other_numbers(tiny, monkeypatch, capsys):
    """The chained row fails (a lost device) and the constrained one cannot start (no llguidance):
    every other number is still measured."""
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    def no_llguidance(schema):
        raise ParameterError("structured output needs the llguidance package")

    monkeypatch.setattr(bench, "chained_decode_ms", broken)
    monkeypatch.setattr(bench, "json_schema_grammar", no_llguidance)
    r = bench.bench_webgpu(tiny, [1], steps=2, prefill_tokens=16, progress=False, slow_s=0.0)
    assert r["decode"][0]["sampled_ms"] > 0 and r["decode"][0]["sampled_full_ms"] > 0
    assert "chained_ms" not in r["decode"][0] and "constrained_ms" not in r["decode"][0]
    assert r["decode"][0]["chained_ms_error"] == "RuntimeError: device lost"
    assert r["decode"][0]["constrained_ms_error"].startswith("ParameterError: structured output needs")
    assert "FAILED (RuntimeError: device lost)" in bench.format_result(r)
    assert r["prefill"]["ttft_tokens"] is None  # a context of 1 asks for no prompt longer than the chunk
    assert r["estimated_s"] > 0 and capsys.readouterr().err == ""  # no progress: nothing on stderr


def test_every_phase_shows_progress_and_a_slow_run_says_how_long(run):
    result, err = run
    assert f"airframe: bench: this run will take about {result['estimated_s']:.0f} s on " in err
    for phase in ("streaming read", "prefill of 64 tokens", "GPU time per op class", "decode"):
        assert f"bench: {phase}" in err


@pytest.mark.parametrize("flags,message", [
    (["--prefill", "0"], "--prefill = 0, expected an integer >= 1"),
    (["--steps", "0"], "--steps = 0, expected an integer >= 1"),
    (["--ctx-list", "1,x"], "--ctx-list = '1,x', expected comma-separated positive integers"),
    (["--backend", "cuda", "--prefill", "64"], "expected no --prefill: the CUDA bench times decode launches only"),
    (["--concurrency", "4,0"], "--concurrency = '4,0', expected comma-separated positive integers"),
    (["--backend", "cuda", "--concurrency", "4"], "expected --backend webgpu"),
])
def test_bench_flags_are_checked_before_loading(tiny, flags, message, capsys):
    from airframe.cli import main

    assert main(["bench", str(tiny), *flags]) == 1
    assert message in capsys.readouterr().err


def test_concurrency_reports_each_level(tiny, capsys):
    """`airframe bench --concurrency`: per level the greedy and the sampled step time, aggregate
    tokens/s and the ratio to one stream, each request's time to first token when the level's
    requests arrive together, and the chained batch-1 figure beside them."""
    from airframe.cli import main

    assert main(["bench", str(tiny), "--concurrency", "1,3", "--steps", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [row["streams"] for row in r["levels"]] == [1, 3] and r["chained_batch1_ms"] > 0
    for row in r["levels"]:
        assert row["step_ms"] > 0 and row["sampled_step_ms"] > 0 and row["tokens_per_s"] == pytest.approx(1000 * row["streams"] / row["step_ms"])
        assert ("gpu_ms" in row) == bench.get_context().has_timestamps and row.get("gpu_ms", 1) > 0
        first = row["first_token_ms"]
        assert len(first) == row["streams"] and 0 < first[0] and first == sorted(first)
    assert r["levels"][0]["speedup"] == pytest.approx(1.0)
    text = bench.format_concurrency(r)
    assert "aggregate tokens/s" in text and "greedy chained on the GPU" in text and "sampled ms/step" in text
    assert "first token ms (first / last)" in text


def test_a_context_beyond_memory_is_refused_before_loading(tiny):
    with pytest.raises(ParameterError, match="of memory are available; expected a context of at most"):
        bench.bench_webgpu(tiny, [1, 2_000_000_000], steps=4, prefill_tokens=64, progress=False)
