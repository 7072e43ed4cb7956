"""The typed decode matmuls (shaders/gemv_<type>.wgsl) against numpy on lavapipe, forced with
AIRFRAME_GEMV_KIND=typed (lavapipe otherwise runs matmuls through gemm_rows.wgsl).

Reference: gguf's dequantized weights times float32 inputs. Tolerance: 2e-5 of the largest output
magnitude for plain products (float32 sums in another order), 1e-4 where an RMSNorm or activation
is fused; the fixed small cases are exact.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from airframe import reference as ref
from airframe.errors import ParameterError
from airframe.gguf_file import dequantize_rows
from airframe.gpu import kernels as K
from airframe.gpu.device import get_context
from airframe.gpu.quant_layout import gpu_quant, relayout
from airframe.quantize import quantize

TYPED = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.BF16]
RTOL, RTOL_FUSED = 2e-5, 1e-4


@pytest.fixture(scope="module")
def typed():
    return K.Kernels(get_context(), gemv_kind="typed")


@pytest.fixture(scope="module")
def narrow_shared():
    """32 invocations (several units each on long rows), workgroup-memory sums."""
    return K.Kernels(get_context(), gemv_kind="typed", typed_wg=32, reduce="shared")


def close(got, want, rtol):
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * max(1.0, float(np.abs(want).max())))


def quantized(rng, rows, cols, qtype):
    """(words, float32 weights the GPU must reproduce) of a random matrix."""
    raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return relayout(raw, qtype), dequantize_rows(raw, qtype)


def params(rows, cols, row_words, mode=0, w=(0, 0, 0), segs=(K.NO_SEGMENT, K.NO_SEGMENT), norm_w=0,
           x_stride=None, y_stride=None, y_off=0):
    return K.pack_params("gemv", rows=rows, cols=cols, row_words=row_words, mode=mode, w0=w[0], w1=w[1], w2=w[2],
                         seg1=segs[0], seg2=segs[1], norm_w=norm_w, eps=1e-5, x_stride=x_stride or cols,
                         y_stride=y_stride or rows, y_off=y_off)


def run_typed(kernels, qtype, words, x, rows, cols, p, y=None, lm_first=0, n_tokens=None):
    """One dispatch of the program decode_matmul picks (checked to be the typed one)."""
    quant = gpu_quant(qtype)
    shader, rows_per_group, shape = kernels.decode_matmul(rows, cols, quant)
    assert shader == "gemv_" + quant.shader.removesuffix(".wgsl")
    n_tokens = n_tokens or x.shape[0]
    y = np.zeros((n_tokens, rows), np.float32) if y is None else y
    grid = (K.ceil_div(rows, rows_per_group), n_tokens, 1)
    step = K.pack_step(0, n_tokens, lm_first)
    (out,) = K.run_once(kernels, shader, quant, [words, x, y, p, step], grid, shape)
    return out


def aligned(*parts):
    """Word arrays one after another, each at a multiple of 4 words; returns (buffer, offsets)."""
    out, offsets = [], []
    at = 0
    for part in parts:
        flat = np.ascontiguousarray(part).view(np.uint32).ravel()
        offsets.append(at)
        pad = -len(flat) % 4
        out += [flat, np.zeros(pad, np.uint32)]
        at += len(flat) + pad
    return np.concatenate(out), offsets


def test_fixed_small_case_q8_0(typed):
    """Integer weights with a block maximum of 127 quantize to d = 1 exactly: the sums are exact."""
    w = np.tile(np.arange(-16, 16, dtype=np.float32), (3, 2))  # (3, 64)
    w[:, [0, 32]] = 127  # each block's maximum
    w[1] *= -1
    x = np.ones((1, 64), np.float32)
    x[0, 5] = 2
    words = relayout(quantize(w, Q.Q8_0), Q.Q8_0)
    got = run_typed(typed, Q.Q8_0, words, x, 3, 64, params(3, 64, words.shape[1]))
    np.testing.assert_array_equal(got, x @ w.T)


def test_fixed_small_case_bf16(typed):
    w = np.arange(2 * 32, dtype=np.float32).reshape(2, 32) - 20
    x = np.full((1, 32), 0.5, np.float32)
    words = relayout(quantize(w, Q.BF16), Q.BF16)
    got = run_typed(typed, Q.BF16, words, x, 2, 32, params(2, 32, words.shape[1]))
    np.testing.assert_array_equal(got, x @ w.T)


@pytest.mark.parametrize("qtype", TYPED, ids=lambda q: q.name)
@pytest.mark.parametrize("variant", ["typed", "narrow_shared"])
def test_every_type_and_workgroup(request, variant, qtype):
    """37 rows (not a multiple of the 4 rows per workgroup); 2048 columns (several units per invocation
    with 32 invocations), and 576 (SmolLM2: 36 units of 16 in 64 invocations) where the type allows."""
    kernels = request.getfixturevalue(variant)
    rng = np.random.default_rng(int(qtype))
    for cols in (2048, 256 if gpu_quant(qtype).block_elems == 256 else 576):
        words, dense = quantized(rng, 37, cols, qtype)
        x = rng.standard_normal((1, cols)).astype(np.float32)
        close(run_typed(kernels, qtype, words, x, 37, cols, params(37, cols, words.shape[1])), x @ dense.T, RTOL)


@pytest.mark.parametrize("qtype", TYPED, ids=lambda q: q.name)
@pytest.mark.parametrize("activation,variant", [("silu", "typed"), ("gelu_tanh", "narrow_shared")])
def test_norm_gated_activation(request, qtype, activation, variant):
    """act(gate . rmsnorm(x)) * (up . rmsnorm(x)), norm weight then gate then up in one buffer."""
    rng = np.random.default_rng(1)
    rows, cols = 45, 512
    gate_w, gate = quantized(rng, rows, cols, qtype)
    up_w, up = quantized(rng, rows, cols, qtype)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    buffer, (n_at, g_at, u_at) = aligned(norm, gate_w, up_w)
    x = rng.standard_normal((1, cols)).astype(np.float32) * 3
    mode = K.MODE_NORM | K.MODE_GATED | (K.MODE_GELU if activation == "gelu_tanh" else 0)
    p = params(rows, cols, gate_w.shape[1], mode, (g_at, u_at, 0), norm_w=n_at)
    got = run_typed(request.getfixturevalue(variant), qtype, buffer, x, rows, cols, p)
    h = ref.rmsnorm(x, norm, 1e-5)
    close(got, ref.ACTIVATIONS[activation](h @ gate.T) * (h @ up.T), RTOL_FUSED)


@pytest.mark.parametrize("qtype", TYPED, ids=lambda q: q.name)
def test_segments_norm_and_residual(narrow_shared, qtype):
    """q, k, v stacked into one output row at an offset, the input normalized, added to what Y holds."""
    rng = np.random.default_rng(2)
    cols = 256
    parts = [quantized(rng, r, cols, qtype) for r in (36, 12, 12)]
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    buffer, offsets = aligned(norm, *[p[0] for p in parts])
    rows = 60
    x = rng.standard_normal((1, cols)).astype(np.float32)
    y = rng.standard_normal((1, rows + 5)).astype(np.float32)
    p = params(rows, cols, parts[0][0].shape[1], K.MODE_ACCUMULATE | K.MODE_NORM, tuple(offsets[1:]), (36, 48),
               norm_w=offsets[0], y_stride=rows + 5, y_off=5)
    got = run_typed(narrow_shared, qtype, buffer, x, rows, cols, p, y=y.copy())
    want = y.copy()
    want[:, 5:] += ref.rmsnorm(x, norm, 1e-5) @ np.concatenate([p[1] for p in parts]).T
    close(got, want, RTOL_FUSED)


@pytest.mark.parametrize("qtype", TYPED, ids=lambda q: q.name)
def test_lm_head_reads_the_step_token(typed, qtype):
    """MODE_X_STEP: the LM head of the last position reads input row S.lm_first."""
    rng = np.random.default_rng(5)
    rows, cols = 19, 256
    words, dense = quantized(rng, rows, cols, qtype)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    got = run_typed(typed, qtype, words, x, rows, cols, params(rows, cols, words.shape[1], K.MODE_X_STEP),
                    lm_first=3, n_tokens=1)
    close(got, x[3:] @ dense.T, RTOL)


@pytest.mark.parametrize("kind,qtype,cols,want", [
    ("auto", Q.Q4_K, 2048, ("gemv_q4_k", {"GEMV_WG": 64})),     # 64 units of 32 weights
    ("auto", Q.Q6_K, 8192, ("gemv_q6_k", {"GEMV_WG": 128})),   # 256 units, at most 128 invocations
    ("auto", Q.Q8_0, 8192, ("gemv_q8_0", {"GEMV_WG": 256})),
    ("typed", Q.Q8_0, 576, ("gemv_q8_0", {"GEMV_WG": 64})),     # 36 units of 16 weights
    ("typed", Q.BF16, 16, ("gemv_bf16", {"GEMV_WG": 32})),
    ("typed", Q.BF16, 100, ("gemv", None)),      # not a whole number of 16-weight units
    ("typed", Q.Q4_0, 2048, ("gemv", None)),     # no typed kernel
    ("vec4", Q.Q4_K, 2048, ("gemv", None)),
    ("chunked-head", Q.Q6_K, 2048, ("gemv_chunk", None))])
def test_decode_matmul_choice(kind, qtype, cols, want):
    shader, _, shape = K.Kernels(get_context(), gemv_kind=kind).decode_matmul(128256, cols, gpu_quant(qtype))
    assert (shader, shape) == want


def test_typed_workgroup_names_what_it_expects():
    with pytest.raises(ParameterError, match="48 invocations, expected 32/64/128/256"):
        K.Kernels(get_context(), typed_wg=48)


@pytest.mark.parametrize("model,max_diff", [("smollm2-135m", 0.02), ("gemma3-270m", 0.05)])
def test_real_model_decode(monkeypatch, model, max_diff):
    """Token by token through the typed kernels (SmolLM2: its Q8_0 LM head of 576 columns; Gemma 3:
    Q4_K attn_output and ffn_down, Q6_K ffn_down, Q8_0 attn_v and the 262,144-row Q8_0 LM head in two
    binding chunks) against the numpy reference: the same argmax at every position, logits within
    the teacher-forced test's bound."""
    from airframe.gpu.runtime import WebGPUBackend
    from airframe.model import open_model
    from airframe.options import RunOptions
    from airframe.reference import ReferenceBackend

    monkeypatch.setenv("AIRFRAME_MATMUL", "tiled")
    monkeypatch.setenv("AIRFRAME_GEMV_KIND", "typed")
    opened = open_model(model)
    tokens = [2, 651, 6037, 603, 1105, 578] if model == "gemma3-270m" else [504, 2365, 314, 253, 1345, 28]
    gpu = WebGPUBackend.load(opened, RunOptions(n_ctx=16))
    got = np.stack([gpu.forward([t]) for t in tokens])
    want = ReferenceBackend.load(opened, RunOptions(n_ctx=16)).forward(tokens, all_logits=True)
    np.testing.assert_array_equal(got.argmax(1), want.argmax(1))
    assert np.abs(got - want).max() < max_diff
