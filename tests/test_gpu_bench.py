"""`airframe bench`'s WebGPU numbers (airframe/gpu/bench.py) on a tiny synthetic model: every number
is there and labelled, the per-op breakdown covers every op class, and a failing measurement keeps
the others."""

import pytest

from airframe.gpu import bench
from airframe.synthetic import write_synthetic_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", "tiny", "Q8_0")


@pytest.fixture(scope="module")
def result(tiny):
    return bench.bench_webgpu(tiny, [1, 70], steps=4, prefill_tokens=64, depth=100, ttft_tokens=150)


def test_bench_reports_prefill_decode_and_the_floor(result):
    p = result["prefill"]
    assert p["tokens_per_s"] > 0 and p["tokens_per_s_at_depth"] > 0 and p["ttft_s"] > 0
    assert [d["context"] for d in result["decode"]] == [1, 70]
    assert all(d["chained_ms"] > 0 and d["sampled_ms"] > 0 and d["sampled_full_ms"] > 0 and d["floor_ms"] > 0
               for d in result["decode"])
    # two layers: one attention merge each beyond 64 positions
    assert result["decode"][1]["dispatches"] == result["decode"][0]["dispatches"] + 2
    low, high = result["bandwidth_spread_GBps"]
    assert low <= result["bandwidth_GBps"] <= high
    text = bench.format_result(result)
    assert "chained greedy" in text and "GPU candidates / full logits" in text and "time to first token" in text


def test_the_gpu_breakdown_covers_every_op_class(result):
    decode, chunk = result["gpu"][0], result["gpu"][-1]
    assert (decode["n_tokens"], chunk["n_tokens"]) == (1, 64)
    for g in (decode, chunk):
        assert {"qkv", "attention", "attn_output", "ffn_gate_up", "ffn_down", "lm_head"} <= set(g["ops_ms"])
        assert all(ms >= 0 for ms in g["ops_ms"].values()) and g["total_ms"] > 0
    assert "rope" in chunk["ops_ms"] and "rope" not in decode["ops_ms"]  # a decode token's attention rotates


def test_a_failing_chained_measurement_keeps_the_other_numbers(tiny, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(bench, "chained_decode_ms", broken)
    r = bench.bench_webgpu(tiny, [1], steps=2, prefill_tokens=16, depth=16, ttft_tokens=20)
    assert r["decode"][0]["sampled_ms"] > 0 and "chained_ms" not in r["decode"][0]
    assert r["decode"][0]["chained_ms_error"] == "RuntimeError: device lost"
    assert "FAILED (RuntimeError: device lost)" in bench.format_result(r)
