"""Each shader against its numpy reference, one dispatch at a time on fresh buffers (lavapipe in CI).

Matmuls compare against the dequantized weights (gguf's numpy code) times float32 inputs; float kernels
use tolerances stated per test (float32 sums in a different order: ~1e-5 relative).
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from airframe import reference as ref
from airframe.errors import ParameterError
from airframe.gguf_file import dequantize_rows
from airframe.gpu import kernels as K
from airframe.gpu.device import get_context
from airframe.gpu.quant_layout import SUPPORTED, gpu_quant, relayout
from airframe.quantize import quantize

RTOL = 2e-5  # relative to the largest output magnitude


@pytest.fixture(scope="module")
def kernels():
    return K.Kernels(get_context())


@pytest.fixture(scope="module")
def shared_kernels():
    """gemv.wgsl reducing through workgroup memory only (devices without subgroups)."""
    return K.Kernels(get_context(), reduce="shared")


@pytest.fixture(scope="module")
def wide_kernels():
    """gemv.wgsl with 256 invocations making 3 rows per workgroup."""
    return K.Kernels(get_context(), gemv_wg=256, gemv_rows=3)


@pytest.fixture(scope="module")
def vec4_kernels():
    """gemv.wgsl for every decode matmul."""
    return K.Kernels(get_context(), gemv_kind="vec4")


@pytest.fixture(scope="module")
def narrow_kernels():
    """gemv_chunk.wgsl for every decode matmul, 32 invocations making 4 rows, workgroup-memory reduction."""
    return K.Kernels(get_context(), gemv_kind="chunk", chunk_wg=32, gemv_rows=4, reduce="shared")


@pytest.fixture(scope="module")
def wide_chunk_kernels():
    """gemv_chunk.wgsl with 256 invocations making 3 rows (most invocations without a chunk)."""
    return K.Kernels(get_context(), gemv_kind="chunk", chunk_wg=256, gemv_rows=3)


def close(got, want, rtol=RTOL):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


def quantized(rng, rows, cols, qtype):
    """(words, float32 weights the GPU must reproduce) of a random matrix."""
    raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return relayout(raw, qtype), dequantize_rows(raw, qtype)


def matmul_params(rows, cols, row_words, mode=0, w=(0, 0, 0), segs=(K.NO_SEGMENT, K.NO_SEGMENT), norm_w=0,
                  x_stride=None, y_stride=None, y_off=0, eps=1e-5):
    return K.pack_params("gemv", rows=rows, cols=cols, row_words=row_words, mode=mode, w0=w[0], w1=w[1], w2=w[2],
                         seg1=segs[0], seg2=segs[1], norm_w=norm_w, eps=eps, x_stride=x_stride or cols,
                         y_stride=y_stride or rows, y_off=y_off)


def run_matmul(kernels, shader, qtype, words, x, rows, cols, params, y=None):
    n_tokens = x.shape[0]
    if shader in ("gemv", "gemv_chunk"):
        grid = (K.ceil_div(rows, kernels.gemv_rows), n_tokens, 1)
    elif shader == "gemm":
        grid = (K.ceil_div(rows, K.GEMM_ROWS), K.ceil_div(n_tokens, K.GEMM_TOKENS), 1)
    else:
        grid = (K.ceil_div(rows, K.ROWS_WG), K.ceil_div(n_tokens, K.ROWS_TOKENS), 1)
    y = np.zeros((n_tokens, rows), np.float32) if y is None else y
    (out,) = K.run_once(kernels, shader, gpu_quant(qtype), [words, x, y, params, K.pack_step(0, n_tokens)], grid)
    return out


def cols_for(qtype):
    return 512 if gpu_quant(qtype).block_elems == 256 else 96


def test_gemv_fixed_small_case(kernels):
    w = np.array([[1, 2, 3, 4], [0, 1, 0, 1], [-1, 0, 0, 0]], np.float32)
    x = np.array([[1, 1, 1, 1]], np.float32)
    got = run_matmul(kernels, "gemv", Q.F32, w.view(np.uint32), x, 3, 4, matmul_params(3, 4, 4))
    np.testing.assert_array_equal(got, [[10, 2, -1]])


@pytest.mark.parametrize("shader,n_tokens", [("gemv", 1), ("gemv_chunk", 1), ("gemm", 19), ("gemm_rows", 11)])
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_matmul_every_quant_type(kernels, shader, n_tokens, qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 37, cols_for(qtype)  # 37: not a multiple of any workgroup's rows
    words, dense = quantized(rng, rows, cols, qtype)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    got = run_matmul(kernels, shader, qtype, words, x, rows, cols, matmul_params(rows, cols, words.shape[1]))
    close(got, x @ dense.T)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("variant", ["shared_kernels", "wide_kernels", "narrow_kernels", "wide_chunk_kernels"])
def test_gemv_variants(request, variant, qtype):
    shared_kernels = request.getfixturevalue(variant)
    rng = np.random.default_rng(7)
    rows, cols = 21, cols_for(qtype)
    words, dense = quantized(rng, rows, cols, qtype)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    got = run_matmul(shared_kernels, "gemv", qtype, words, x, rows, cols, matmul_params(rows, cols, words.shape[1]))
    close(got, x @ dense.T)


@pytest.mark.parametrize("qtype", [Q.F16, Q.F32], ids=lambda q: q.name)
@pytest.mark.parametrize("variant", ["vec4_kernels", "narrow_kernels", "wide_chunk_kernels"])
def test_gemv_row_not_whole_chunks(request, variant, qtype):
    """100 columns: 3 chunks of 8 vec4 and one vec4 left over, with the RMSNorm fused."""
    kernels = request.getfixturevalue(variant)
    rng = np.random.default_rng(3)
    rows, cols = 9, 100
    words, dense = quantized(rng, rows, cols, qtype)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    buffer = np.concatenate([norm.view(np.uint32), words.ravel()])
    x = rng.standard_normal((1, cols)).astype(np.float32)
    params = matmul_params(rows, cols, words.shape[1], K.MODE_NORM, w=(cols, 0, 0), norm_w=0)
    got = run_matmul(kernels, "gemv", qtype, buffer, x, rows, cols, params)
    close(got, ref.rmsnorm(x, norm, 1e-5) @ dense.T, 1e-4)


@pytest.mark.parametrize("kind,rows,qtype,want", [
    ("chunked-head", 128256, Q.Q6_K, "gemv_chunk"), ("chunked-head", 128256, Q.Q8_0, "gemv_chunk"),
    ("chunked-head", 8192, Q.Q4_K, "gemv"), ("chunked-head", 128256, Q.BF16, "gemv"), ("vec4", 128256, Q.Q6_K, "gemv"),
    ("chunk", 64, Q.F16, "gemv_chunk")])
def test_gemv_shader_choice(kind, rows, qtype, want):
    """chunked-head: the chunked program only for LM-head-sized matrices in a type with its own chunk_dot
    (the typed kernels' choices: tests/test_gpu_gemv.py)."""
    assert K.Kernels(get_context(), gemv_kind=kind).decode_matmul(rows, 2048, gpu_quant(qtype))[0] == want


def test_gemv_kind_names_what_it_expects(monkeypatch):
    monkeypatch.setenv("AIRFRAME_GEMV_KIND", "fast")
    with pytest.raises(ParameterError, match="expected one of auto, typed"):
        K.Kernels(get_context())


@pytest.mark.parametrize("shader,n_tokens", [("gemv", 1), ("gemv_chunk", 1), ("gemm", 20), ("gemm_rows", 9)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_matmul_norm_gated_activation(kernels, shader, n_tokens, activation):
    """act(gate . rmsnorm(x)) * (up . rmsnorm(x)) with gate and up in one buffer after the norm weight."""
    rng = np.random.default_rng(1)
    rows, cols = 45, 576  # SmolLM2's width
    gate_w, gate = quantized(rng, rows, cols, Q.Q4_1)
    up_w, up = quantized(rng, rows, cols, Q.Q4_1)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    buffer = np.concatenate([norm.view(np.uint32), gate_w.ravel(), up_w.ravel()])
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 3
    mode = K.MODE_NORM | K.MODE_GATED | (K.MODE_GELU if activation == "gelu_tanh" else 0)
    params = matmul_params(rows, cols, gate_w.shape[1], mode, w=(cols, cols + gate_w.size, 0), norm_w=0)
    got = run_matmul(kernels, shader, Q.Q4_1, buffer, x, rows, cols, params)
    h = ref.rmsnorm(x, norm, 1e-5)
    close(got, ref.ACTIVATIONS[activation](h @ gate.T) * (h @ up.T), 1e-4)


@pytest.mark.parametrize("shader,n_tokens", [("gemv", 1), ("gemv_chunk", 1), ("gemm", 17), ("gemm_rows", 3)])
def test_matmul_segments_and_residual(kernels, shader, n_tokens):
    """Three weights (q, k, v) stacked into one output row at an offset, added to what Y holds."""
    rng = np.random.default_rng(2)
    cols = 64
    parts = [quantized(rng, r, cols, Q.Q8_0) for r in (36, 12, 12)]
    words = [p[0] for p in parts]
    offsets = np.cumsum([0] + [w.size for w in words])[:3]
    buffer = np.concatenate([w.ravel() for w in words])
    rows = 60
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    y = rng.standard_normal((n_tokens, rows + 5)).astype(np.float32)
    params = matmul_params(rows, cols, words[0].shape[1], K.MODE_ACCUMULATE, w=tuple(int(o) for o in offsets),
                           segs=(36, 48), y_stride=rows + 5, y_off=5)
    got = run_matmul(kernels, shader, Q.Q8_0, buffer, x, rows, cols, params, y=y.copy())
    want = y.copy()
    want[:, 5:] += x @ np.concatenate([p[1] for p in parts]).T
    close(got, want)


@pytest.mark.parametrize("add", [False, True])
def test_rmsnorm(kernels, add):
    rng = np.random.default_rng(3)
    n, tokens = 576, 3
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    x = rng.standard_normal((tokens, n)).astype(np.float32)
    y = rng.standard_normal((tokens, n)).astype(np.float32)
    params = K.pack_params("rmsnorm", n=n, norm_w=0, eps=1e-6, add=int(add), x_stride=n, y_stride=n)
    (got,) = K.run_once(kernels, "rmsnorm", None, [w.view(np.uint32), x, y.copy(), params,
                                                   K.pack_step(0, tokens)], (tokens, 1, 1))
    close(got, ref.rmsnorm(x, w, 1e-6) + (y if add else 0))


@pytest.mark.parametrize("style,qk_norm", [("normal", False), ("neox", True)])
def test_rope_qk_norm_and_cache_write(kernels, style, qk_norm):
    """SmolLM2's 9 query / 3 K/V heads of 64 at positions 5..8 of a 16-position cache."""
    rng = np.random.default_rng(4)
    n_head, n_kv, hd, n_ctx, n_past, tokens, base = 9, 3, 64, 16, 5, 4, 10000.0
    stride = (n_head + 2 * n_kv) * hd
    qkv = rng.standard_normal((tokens, stride)).astype(np.float32)
    norms = rng.uniform(0.5, 1.5, 2 * hd).astype(np.float32)
    theta = ref.rope_angles(np.arange(n_ctx), hd, base)
    table = np.stack([np.cos(theta), np.sin(theta)], -1).astype(np.float32)
    kv = np.zeros(2 * n_kv * n_ctx * hd, np.float32)
    params = K.pack_params("rope", n_head=n_head, n_head_kv=n_kv, head_dim=hd, rope_dim=hd,
                           neox=int(style == "neox"), qk_norm=int(qk_norm), q_norm_w=0, k_norm_w=hd, eps=1e-6,
                           qkv_stride=stride, n_ctx=n_ctx, table=0)
    got_qkv, got_kv = K.run_once(kernels, "rope", None, [norms.view(np.uint32), table, qkv, kv, params,
                                                         K.pack_step(n_past, tokens)], (n_head + n_kv, tokens, 1))
    pos = np.arange(n_past, n_past + tokens)
    q = qkv[:, :n_head * hd].reshape(tokens, n_head, hd)
    k = qkv[:, n_head * hd:(n_head + n_kv) * hd].reshape(tokens, n_kv, hd)
    v = qkv[:, (n_head + n_kv) * hd:].reshape(tokens, n_kv, hd)
    if qk_norm:
        q, k = ref.rmsnorm(q, norms[:hd], 1e-6), ref.rmsnorm(k, norms[hd:], 1e-6)
    close(got_qkv[:, :n_head * hd].reshape(tokens, n_head, hd), ref.rope(q, pos, hd, base, style))
    cache = got_kv.reshape(2, n_kv, n_ctx, hd)
    close(cache[0][:, pos].transpose(1, 0, 2), ref.rope(k, pos, hd, base, style))
    np.testing.assert_array_equal(cache[1][:, pos].transpose(1, 0, 2), v)
    assert not cache[:, :, :n_past].any() and not cache[:, :, n_past + tokens:].any()


@pytest.mark.parametrize("n_past,tokens,window,split_len", [
    (0, 1, 0, 256),       # first decode step
    (300, 1, 0, 64),      # decode over 5 splits, the last one partial
    (0, 37, 0, 256),      # prefill chunk, causal
    (40, 30, 16, 64),     # sliding window crossing split borders
    (700, 2, 0, 8),       # 88 splits: more than the merge's invocations
])
@pytest.mark.parametrize("n_head,n_kv,hd", [(9, 3, 64), (8, 2, 128), (4, 1, 256)])  # SmolLM2, Llama 3 8B, Gemma 3
def test_attention_splits_and_merge(kernels, n_past, tokens, window, split_len, n_head, n_kv, hd):
    rng = np.random.default_rng(5)
    n_ctx = n_past + tokens + 3
    stride = (n_head + 2 * n_kv) * hd
    qkv = rng.standard_normal((tokens, stride)).astype(np.float32)
    kv = rng.standard_normal((2, n_kv, n_ctx, hd)).astype(np.float32)
    n_splits = K.ceil_div(n_past + tokens, split_len)
    part = np.zeros(tokens * n_head * n_splits * (hd + 2), np.float32)
    step = K.pack_step(n_past, tokens, 0, split_len)
    params = K.pack_params("attention_decode", n_head=n_head, n_head_kv=n_kv, head_dim=hd, n_ctx=n_ctx,
                           window=window, scale=hd ** -0.5, qkv_stride=stride)
    out = np.zeros((tokens, n_head * hd), np.float32)  # written by attention_decode only with one split
    unused = np.zeros(4, np.float32)  # layer weights, RoPE table and params: ATTN_ROPE only
    _, part, _ = K.run_once(kernels, "attention_decode", None,
                            [qkv, unused, unused, kv, part, out, params, bytes(64), step], (n_splits, n_kv, tokens),
                            {**K.attention_defines(n_head, n_kv, hd), "ATTN_ROPE": 0})
    merge = K.pack_params("attention_merge", n_head=n_head, head_dim=hd)
    out = np.zeros((tokens, n_head * hd), np.float32)
    (got,) = K.run_once(kernels, "attention_merge", None, [part, out, merge, step], (n_head, tokens, 1))
    end = n_past + tokens
    q = qkv[:, :n_head * hd].reshape(tokens, n_head, hd)
    want = ref.attention(q, kv[0][:, :end], kv[1][:, :end], np.arange(n_past, end), hd ** -0.5, window)
    close(got.reshape(tokens, n_head, hd), want, 1e-5)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.BF16], ids=lambda q: q.name)
def test_embedding_chunk(kernels, qtype):
    """Rows 10..29 bound as one chunk: tokens inside are looked up and scaled, the others untouched."""
    rng = np.random.default_rng(6)
    cols = 256
    words, dense = quantized(rng, 40, cols, qtype)
    ids = np.array([12, 3, 29, 10, 35], np.uint32)
    y = np.full((ids.size, cols), 7.0, np.float32)
    params = K.pack_params("embedding", first_row=10, n_rows=20, cols=cols, row_words=words.shape[1], scale=2.0)
    (got,) = K.run_once(kernels, "embedding", gpu_quant(qtype), [words[10:30], ids, y, params,
                                                                 K.pack_step(0, ids.size)], (ids.size, 1, 1))
    inside = (ids >= 10) & (ids < 30)
    np.testing.assert_array_equal(got[inside], dense[ids[inside]] * 2.0)
    assert (got[~inside] == 7.0).all()
