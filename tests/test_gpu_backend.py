"""The WebGPU backend against the numpy reference: real models teacher-forced, tiny synthetic models
for every quant type, decode after prefill against one-shot prefill, chunked against unchunked prefill."""

import numpy as np
import pytest

from airframe.errors import ContextOverflowError, ParameterError
from airframe.gpu import pipelines as pl
from airframe.gpu.backend import WebGPUBackend, split_length
from airframe.model import open_model
from airframe.options import RunOptions
from airframe.reference import ReferenceBackend
from airframe.synthetic import write_synthetic_gguf
from airframe.tokenizer import load_tokenizer

TEACHER_TOKENS = 128
TEXT = "tests/data/english.txt"


def english_tokens(model, n):
    from pathlib import Path
    text = (Path(__file__).parent / "data" / "english.txt").read_text()
    ids = load_tokenizer(model.gguf).encode(text)
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("model,max_diff", [("smollm2-135m", 0.02), ("gemma3-270m", 0.05)])
def test_real_model_teacher_forced(model, max_diff):
    """128 tokens of English in one chunk: top-1 agreement >= 99%, logits within max_diff."""
    opened = open_model(model)
    tokens = english_tokens(opened, TEACHER_TOKENS)
    gpu = WebGPUBackend.load(opened, RunOptions(n_ctx=TEACHER_TOKENS))
    got = gpu.forward(tokens, all_logits=True)
    want = ReferenceBackend.load(opened, RunOptions(n_ctx=TEACHER_TOKENS)).forward(tokens, all_logits=True)
    assert got.shape == want.shape == (TEACHER_TOKENS, gpu.config.vocab_size)
    agreement = (got.argmax(1) == want.argmax(1)).mean()
    assert agreement >= 0.99, f"top-1 agreement {agreement:.3f}"
    assert np.abs(got - want).max() < max_diff


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return open_model(write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", "tiny", "Q8_0"))


def test_decode_after_prefill_equals_one_shot(tiny_llama):
    tokens = list(np.random.default_rng(0).integers(0, 512, 14))
    gpu = WebGPUBackend.load(tiny_llama, RunOptions(n_ctx=64))
    one_shot = gpu.forward(tokens, all_logits=True)
    gpu.reset()
    gpu.forward(tokens[:9])
    stepped = [gpu.forward([t]) for t in tokens[9:]]
    assert gpu.n_past == len(tokens)
    np.testing.assert_allclose(np.stack(stepped), one_shot[9:], atol=1e-4)


def test_chunked_prefill_equals_unchunked(tiny_llama):
    """1,100 tokens in 512-token chunks (3 chunks) against one chunk and against the reference."""
    tokens = list(np.random.default_rng(1).integers(0, 512, 1100))
    chunked = WebGPUBackend.load(tiny_llama, RunOptions(n_ctx=1100, prefill_chunk=512))
    whole = WebGPUBackend.load(tiny_llama, RunOptions(n_ctx=1100, prefill_chunk=1100))
    a = chunked.forward(tokens, all_logits=True)
    b = whole.forward(tokens, all_logits=True)
    want = ReferenceBackend.load(tiny_llama, RunOptions(n_ctx=1100)).forward(tokens, all_logits=True)
    np.testing.assert_allclose(a, b, atol=1e-4)
    np.testing.assert_allclose(a, want, atol=1e-3)
    assert chunked.n_past == 1100


def test_a_full_chunk_starts_from_the_lead_recorded_ahead(tiny_llama, monkeypatch):
    """A full chunk records the next full chunk's first command buffer (embedding, first layer) for
    its slot; the next prompt submits it instead of recording one, with the same logits; another
    slot records its own."""
    tokens = list(np.random.default_rng(2).integers(0, 512, 21))
    gpu = WebGPUBackend.load(tiny_llama, RunOptions(n_ctx=32, prefill_chunk=8, slots=2))
    first = gpu.forward(tokens)
    assert gpu._next_lead is not None and gpu._next_lead[0] == 0
    recorded = []
    record = pl.record
    monkeypatch.setattr(pl, "record", lambda encoder, work, *a: (recorded.append(len(work)), record(encoder, work, *a)))
    gpu.reset()
    np.testing.assert_array_equal(gpu.forward(tokens), first)
    lead = len(gpu.globals_ops.embed_ops) + len(gpu.layer_ops[0].dispatches(8, 1))
    rest = len(gpu.layer_dispatches(8)) - lead
    # chunks 1 and 2: their rest, then the next lead; chunk 3 (5 tokens) records its own two parts
    assert recorded[:4] == [rest, lead, rest, lead] and len(recorded) == 6
    gpu.select_slot(1)
    gpu.reset()
    np.testing.assert_array_equal(gpu.forward(tokens), first)
    assert gpu._next_lead[0] == 1


QTYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_synthetic_model_every_quant_type(tmp_path, family, qtype):
    shape = "tiny256" if qtype.startswith(("Q4_K", "Q5_K", "Q6_K")) else "tiny"
    path = write_synthetic_gguf(tmp_path / "m.gguf", family, shape, qtype)
    tokens = list(np.random.default_rng(2).integers(0, 512, 7))
    model = open_model(path)
    gpu = WebGPUBackend.load(model, RunOptions(n_ctx=32))
    got = np.concatenate([gpu.forward(tokens[:5], all_logits=True), gpu.forward(tokens[5:], all_logits=True)])
    want = ReferenceBackend.load(model, RunOptions(n_ctx=32)).forward(tokens, all_logits=True)
    np.testing.assert_allclose(got, want, atol=2e-3 * max(1.0, np.abs(want).max()))


def test_sliding_window_beyond_the_window(tmp_path):
    """A Gemma 3 model with an 8-position window, run 40 positions: local layers must forget."""
    path = write_synthetic_gguf(tmp_path / "g.gguf", "gemma3", {"preset": "tiny", "sliding_window": 8, "n_layers": 6},
                                "F32")
    tokens = list(np.random.default_rng(3).integers(0, 512, 40))
    model = open_model(path)
    gpu = WebGPUBackend.load(model, RunOptions(n_ctx=48, prefill_chunk=16))
    got = gpu.forward(tokens, all_logits=True)
    want = ReferenceBackend.load(model, RunOptions(n_ctx=48)).forward(tokens, all_logits=True)
    np.testing.assert_allclose(got, want, atol=1e-3 * max(1.0, np.abs(want).max()))


def test_context_overflow_names_both_sizes(tiny_llama):
    gpu = WebGPUBackend.load(tiny_llama, RunOptions(n_ctx=8))
    gpu.forward([1, 2, 3, 4, 5])
    with pytest.raises(ContextOverflowError, match=r"5 cached \+ 4 new.*context of 8"):
        gpu.forward([1, 2, 3, 4])
    with pytest.raises(ParameterError, match="outside the vocabulary 0..511"):
        gpu.forward([512])


def test_decode_dispatch_count(tiny_llama):
    """Llama decode: 5 dispatches per layer per token whatever the attention's splits (QKV, attention,
    output, gate/up, down), counted from what is recorded."""
    gpu = WebGPUBackend.load(tiny_llama, RunOptions(n_ctx=16))
    per_layer = len(gpu.layer_ops[0].dispatches(1, 1))
    assert per_layer == 5
    assert len(gpu.layer_ops[0].dispatches(1, 4)) == 5
    assert gpu.dispatch_count(1) == gpu.config.n_layers * per_layer + len(gpu.token_embd.chunks) + 1 + len(gpu.output.chunks)


def test_split_length_keeps_short_splits_to_one_wave():
    """64-position splits while a decode token's splits fit one wave of workgroups (264), 128 past
    it; then as before: 512 workgroups' worth, at most 256 splits (Llama 3.2 1B: 8 K/V heads)."""
    assert [split_length(kv, 8) for kv in (1, 64, 65, 2112, 2113, 4096, 4097, 8192, 8193)] == \
        [64, 64, 64, 64, 128, 128, 128, 128, 192]
    assert split_length(16384, 1) == 64 and split_length(16385, 1) == 128  # Gemma 3: 256 splits at most


def test_debug_raw_logs_every_op_and_keeps_results(tiny_llama, monkeypatch, caplog):
    """SHIMMY_DEBUG_RAW=1 submits op by op and logs statistics; the logits stay the same."""
    tokens = [5, 9, 200]
    plain = WebGPUBackend.load(tiny_llama, RunOptions(n_ctx=8)).forward(tokens)
    monkeypatch.setenv("SHIMMY_DEBUG_RAW", "1")
    monkeypatch.setenv("AIRFRAME_TRACE_PREFILL_CHUNKS", "1")
    debug = WebGPUBackend.load(tiny_llama, RunOptions.from_env(n_ctx=8))
    with caplog.at_level("WARNING", logger="airframe.gpu"):
        got = debug.forward(tokens)
    np.testing.assert_allclose(got, plain, atol=1e-5)
    text = caplog.text
    assert "blk.1.ffn_down" in text and "absmax" in text and "nan 0" in text
    assert "prefill chunk 0..3 (3 tokens)" in text


@pytest.mark.parametrize("family,qtype", [("llama", "Q4_0"), ("gemma3", "Q4_0"), ("llama", "Q4_K_M"),
                                          ("llama", "Q5_K_M"), ("llama", "Q8_0"), ("llama", "BF16"), ("qwen2", "Q5_0")])
@pytest.mark.parametrize("reduce", ["subgroup", "shared"])
def test_tiled_matmuls_as_on_discrete_gpus(tmp_path, family, qtype, reduce):
    """gemv.wgsl for decode and gemm.wgsl for chunks, the GPU path, end to end (lavapipe otherwise
    runs gemm_rows.wgsl): a 67-token prefill (a 64-token tile and a partial one), then decode.
    Every matrix but gate/up has few row tiles, so it is split along K (split_sum.wgsl).
    gemm.wgsl's f16 products (3e-3 of a matmul's largest output) set the bound: 1e-2 of the largest
    logit, the decode tokens included, as they attend to the prefilled K/V."""
    # K-quant rows need 256 columns
    mix = qtype.endswith("_K_M")
    shape = {"preset": "tiny256", "n_ff": 1024} if mix else {"preset": "tiny", "n_ff": 256}
    path = write_synthetic_gguf(tmp_path / "m.gguf", family, shape, qtype)
    tokens = list(np.random.default_rng(4).integers(0, 512, 70))
    model = open_model(path)
    gpu = WebGPUBackend.load(model, RunOptions(n_ctx=80, matmul="tiled", reduce=reduce))
    assert gpu.pipes.matmul == "tiled"
    first, last = gpu.slot_ops[0][0], gpu.slot_ops[0][-1]
    sums = {op.label for op in first.ops if op.shader == "split_sum"}
    if gpu.config.post_norms:  # Gemma: the matrices write tmp, a norm adds it to the residual
        assert {"blk.0.attn_output.split_sum", "blk.0.ffn_down.split_sum"} <= sums and first.carry is None
    else:  # the sums into the residual go to the norm after them: the output projection's to ffn_norm,
        # ffn_down's to the next layer's attn_norm, but the last layer's (the final norm runs on decode tokens too)
        assert not sums & {"blk.0.attn_output.split_sum", "blk.0.ffn_down.split_sum"}
        assert first.carry.label == "blk.0.ffn_down.split_sum" and last.carry is None
        assert f"blk.{gpu.config.n_layers - 1}.ffn_down.split_sum" in {op.label for op in last.ops}
        norm = next(op for op in gpu.slot_ops[0][1].ops if op.label == "blk.1.attn_norm")
        assert norm.when is first.carry.when
    # ffn_down's 8-bit units read x as gate/up rounded and stored it; BF16's reads the floats
    gate_up, down = (next(op for op in first.ops if op.label == f"blk.0.{name}") for name in ("ffn_gate_up", "ffn_down"))
    assert down.x_stored == (qtype != "BF16") == bool(gate_up.mode & pl.MODE_ROUND_OUT)
    if mix:  # layer 1's V is Q6_K: both QKV matmuls, then their sums, each group's partials apart
        v = gpu.config.n_q + gpu.config.n_kv
        assert gpu.group_partials(1) is not gpu.group_partials(0)
        labels = [d.label for d in gpu.slot_ops[0][1].dispatches(67, 1, decode=False)[:4]]
        assert labels == ["blk.1.attn_norm", "blk.1.qkv@0", f"blk.1.qkv@{v}", "blk.1.rope"]  # rope.wgsl sums them
        labels = [d.label for d in gpu.slot_ops[0][1].dispatches(9, 1, decode=True)[:5]]  # a batch of 9 decode tokens
        assert labels == ["blk.1.attn_norm", "blk.1.qkv@0", f"blk.1.qkv@{v}", "blk.1.qkv@0.split_sum",
                          f"blk.1.qkv@{v}.split_sum"]
        # decode tokens (gemv.wgsl, up to 8) take Q, K and V in one dispatch (layer.MIXED_UNITS): 5 a layer
        for n_tokens, n_splits in ((1, 1), (1, 3), (8, 2)):
            dispatches = gpu.slot_ops[0][1].dispatches(n_tokens, n_splits, decode=True)
            assert [d.label for d in dispatches] == ["blk.1.qkv", "blk.1.attention", "blk.1.attn_output",
                                                     "blk.1.ffn_gate_up", "blk.1.ffn_down"]
    got = np.concatenate([gpu.forward(tokens[:67], all_logits=True)] + [gpu.forward([t])[None] for t in tokens[67:]])
    want = ReferenceBackend.load(model, RunOptions(n_ctx=80)).forward(tokens, all_logits=True)
    np.testing.assert_allclose(got, want, atol=1e-2 * max(1.0, np.abs(want).max()))




def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


def _nll(logits: np.ndarray, ids: list[int]) -> float:
    z = _log_softmax(logits[:-1])
    return float(-z[np.arange(len(z)), ids[1:]].mean())


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_real_model_prefill_through_the_f16_gemm(model):
    """A 256-token chunk of English through gemm.wgsl (f16 products), as discrete GPUs prefill,
    against the numpy reference: mean negative log-likelihood within 0.1%, logits within 1% of the largest, and the
    same top-1 wherever the reference's two best logits are more than 0.5% of the largest apart."""
    opened = open_model(model)
    ids = english_tokens(opened, 256)
    got = WebGPUBackend.load(opened, RunOptions(n_ctx=256, matmul="tiled")).forward(ids, all_logits=True)
    want = ReferenceBackend.load(opened, RunOptions(n_ctx=256)).forward(ids, all_logits=True)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-2 * scale
    assert abs(_nll(got, ids) / _nll(want, ids) - 1) < 1e-3
    best2 = np.sort(want, axis=1)[:, -2:]
    clear = best2[:, 1] - best2[:, 0] > 5e-3 * scale
    np.testing.assert_array_equal(got.argmax(1)[clear], want.argmax(1)[clear])


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_real_model_decode_through_the_gpu_kernels(model):
    """Token by token through gemv.wgsl, as on discrete GPUs (SmolLM2: Q4_1 layers and its Q8_0 LM
    head of 576 columns; Gemma 3: Q5_0, Q4_K, Q6_K and Q8_0 matrices and the 262,144-row Q8_0 LM
    head in two binding chunks) against the numpy reference. Every quantized type's unit rounds x
    to 8 bits, as llama.cpp's GPU mat-vec kernels do, so the bound is the distribution's, not
    float32's: the same argmax wherever the reference's two best logits are more than 0.5% of the
    largest apart, each position's logits within 4% of its largest (1.3-3.6% measured), the mean
    KL divergence from the reference below 7.5e-3 nats (2.7e-3 and 4.7e-3 measured)."""
    opened = open_model(model)
    tokens = [2, 651, 6037, 603, 1105, 578] if model == "gemma3-270m" else [504, 2365, 314, 253, 1345, 28]
    gpu = WebGPUBackend.load(opened, RunOptions(n_ctx=16, matmul="tiled"))
    got = np.stack([gpu.forward([t]) for t in tokens])
    want = ReferenceBackend.load(opened, RunOptions(n_ctx=16)).forward(tokens, all_logits=True)
    largest = np.abs(want).max(1)
    best2 = np.sort(want, axis=1)[:, -2:]
    clear = best2[:, 1] - best2[:, 0] > 5e-3 * largest
    np.testing.assert_array_equal(got.argmax(1)[clear], want.argmax(1)[clear])
    assert (np.abs(got - want).max(1) <= 0.04 * largest).all()
    p, q = _log_softmax(want), _log_softmax(got)
    assert (np.exp(p) * (p - q)).sum(1).mean() < 7.5e-3
