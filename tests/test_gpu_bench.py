"""`airframe bench`'s WebGPU numbers (airframe/gpu/bench.py) on a tiny synthetic model: both decode
measurements are there and labelled, and a failure of the chained one keeps the others."""

import pytest

from airframe.gpu import bench
from airframe.synthetic import write_synthetic_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", "tiny", "Q8_0")


def test_bench_reports_per_token_and_chained_decode(tiny):
    r = bench.bench_webgpu(tiny, [1, 70], steps=4, prefill_tokens=64)
    assert [d["context"] for d in r["decode"]] == [1, 70]
    chained = r["chained"]["decode"]
    assert [d["context"] for d in chained] == [1, 70] and all(d["ms_per_token"] > 0 for d in chained)
    # two layers: one attention merge each beyond 64 positions; the argmax adds two dispatches
    assert r["decode"][1]["dispatches"] == r["decode"][0]["dispatches"] + 2
    assert [d["dispatches"] for d in chained] == [d["dispatches"] + 2 for d in r["decode"]]
    text = bench.format_result(r)
    assert "logits read back every token" in text and "greedy chained on the GPU" in text


def test_a_failing_chained_measurement_keeps_the_other_numbers(tiny, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(bench, "chain", broken)
    r = bench.bench_webgpu(tiny, [1], steps=2, prefill_tokens=16)
    assert r["decode"][0]["ms_per_token"] > 0 and "chained" not in r
    assert r["chained_error"] == "RuntimeError: device lost"
    assert "greedy chained on the GPU: FAILED (RuntimeError: device lost)" in bench.format_result(r)
