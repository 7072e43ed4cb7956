"""The matmul programs against numpy on lavapipe: gemv.wgsl (decode, each type's unit, subgroup
and workgroup-memory sums), gemm.wgsl (prefill chunks) and gemm_rows.wgsl (CPU adapters).

Reference: gguf's dequantized weights times float32 inputs, in float64. Tolerance: 2e-5 of the
largest output magnitude for plain products (float32 sums in another order), 1e-4 where an RMSNorm
or activation is fused, 3e-3 for gemm.wgsl (f16 products, each 32-column step summed in f16), 2e-2
for the gemv units that round x to 8 bits (gemv/x_int8.wgsl: 3e-3 to 5e-3 measured, 1.2e-2 where a
gated activation multiplies two outputs); the fixed small cases are exact. Shapes are odd on
purpose: 37 and 45 rows (not a multiple of 4, 16, 32, 64 or 128), 19 and 77 tokens (not a multiple
of a 64-token tile), and SmolLM2's 576 and Qwen's 896 columns where the type's block allows them.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from airframe import reference as ref
from airframe.gpu import pipelines as pl
from airframe.gpu.device import get_context
from airframe.gpu.layer import MIXED_UNITS
from airframe.gpu.pack import relayout
from airframe.quantize import quantize
from airframe.quants import SUPPORTED, quant
from gpu_helpers import WithoutF16, close, quantized

RTOL, RTOL_FUSED, RTOL_F16, RTOL_INT8 = 2e-5, 1e-4, 3e-3, 2e-2


def x_rounded(qtype) -> bool:
    """Whether the type's gemv unit rounds x to 8 bits."""
    q = quant(qtype)
    return pl.shader_constant(f"gemv/{q.shader}.wgsl", "INT8_X") == 1  # gemv/x_int8.wgsl


def rtol(program: str, fused: bool = False, qtype=None) -> float:
    if program == "gemm":
        return RTOL_F16
    if program == "gemv" and qtype is not None and x_rounded(qtype):
        return RTOL_INT8
    return RTOL_FUSED if fused else RTOL


@pytest.fixture(scope="module")
def tiled():
    return pl.Pipelines(get_context(), matmul="tiled")


@pytest.fixture(scope="module")
def shared():
    """gemv.wgsl adding across lanes through workgroup memory (adapters without subgroups)."""
    return pl.Pipelines(get_context(), matmul="tiled", reduce="shared")


def params(rows, cols, row_words, mode=0, w=(0, 0, 0), segs=(pl.NO_SEGMENT, pl.NO_SEGMENT), norm_w=0,
           x_stride=None, y_stride=None, y_off=0, row_words2=None, xq_off=0):
    return pl.pack_params("gemv", rows=rows, cols=cols, row_words=row_words, mode=mode, w0=w[0], w1=w[1], w2=w[2],
                          seg1=segs[0], seg2=segs[1], norm_w=norm_w, eps=1e-5, x_stride=x_stride or cols,
                          y_stride=y_stride or rows, y_off=y_off, row_words2=row_words2 or row_words, xq_off=xq_off)


def aligned(*parts):
    """Word arrays one after another, each at a multiple of 64 words (as pack.py places tensors);
    returns (buffer, offsets)."""
    out, offsets, at = [], [], 0
    for part in parts:
        flat = np.ascontiguousarray(part).view(np.uint32).ravel()
        pad = -len(flat) % 64
        offsets.append(at)
        out += [flat, np.zeros(pad, np.uint32)]
        at += len(flat) + pad
    return np.concatenate(out), offsets


def mode_of(p: bytes) -> int:
    """The mode field of packed gemv params (gemv.wgsl compiles it in as MODE)."""
    names, packer = pl._params_layout("gemv")
    return dict(zip(names, packer.unpack(p)))["mode"]


def run(pipes, program, qtype, words, x, rows, p, y=None, *, rows_wg=8, gated=False,
        n_tokens=None, lm_first=0, unit=None, cols=None, x_stored=False, split_rows=None):
    """One dispatch of `program` ("gemv", "gemm", "gemm_rows") over n_tokens tokens of x; gemv with
    `unit` (shaders/gemv/<unit>.wgsl) else the type's own, reading x as stored rounded where x_stored,
    splitting a row's units as a workgroup of split_rows would (default rows_wg)."""
    n_tokens = n_tokens or x.shape[0]
    q = quant(qtype)
    y = np.zeros((n_tokens, rows), np.float32) if y is None else y
    if program == "gemv":
        tokens = min(n_tokens, pipes.gemv_group)
        shape = pipes.gemv_shape(unit or q.shader, rows_wg, tokens, cols or x.shape[1], mode_of(p), x_stored,
                                 split_rows)
        grid = (pl.ceil_div(rows, rows_wg), pl.ceil_div(n_tokens, tokens), 1)
    elif program == "gemm":
        shape = None
        grid = (pipes.gemm_groups(rows, gated), pl.ceil_div(n_tokens, pl.GEMM_TILE_TOKENS), 1)
    else:
        tokens = pl.rows_tokens(n_tokens)
        shape = {"ROWS_TOKENS": tokens}
        grid = (pl.ceil_div(rows, pl.ROWS_WG), pl.ceil_div(n_tokens, tokens), 1)
    step = pl.pack_step(0, n_tokens, lm_first)
    (out,) = pl.run_once(pipes, program, q, [words, x, y, p, step], grid, shape)
    return out


def normed_for(pipes, program, x, buffer, norm_at, mode):
    """(input, mode) of a MODE_NORM matmul: gemm.wgsl reads x normalized by rmsnorm.wgsl first (the
    layer's chunk_norm op), without MODE_NORM; the other programs normalize it themselves."""
    if program != "gemm":
        return x, mode
    n_tokens, cols = x.shape
    p = pl.pack_params("rmsnorm", n=cols, norm_w=norm_at, eps=1e-5, add=0, x_stride=cols, y_stride=cols, splits=0)
    no_partials = np.zeros(4, np.float32)
    _, h = pl.run_once(pipes, "rmsnorm", None, [buffer, x, np.zeros_like(x), no_partials, p,
                                                pl.pack_step(0, n_tokens)], (n_tokens, 1, 1))
    return h, mode & ~pl.MODE_NORM


def cols_for(qtype):
    return (2304, 256) if quant(qtype).gpu_block == 256 else (2048, 576, 896)


# ---- fixed small cases --------------------------------------------------------------------------
def test_gemv_fixed_small_case_q8_0(tiled):
    """Integer weights with a block maximum of 127 quantize to d = 1 exactly, and integer x with 127
    in every 16 values rounds to itself: the sums are exact."""
    w = np.tile(np.arange(-16, 16, dtype=np.float32), (3, 2))  # (3, 64)
    w[:, [0, 32]] = 127  # each block's maximum
    w[1] *= -1
    x = np.ones((1, 64), np.float32)
    x[0, ::16] = 127
    x[0, 5] = -2
    words = relayout(quantize(w, Q.Q8_0), Q.Q8_0)
    got = run(tiled, "gemv", Q.Q8_0, words, x, 3, params(3, 64, words.shape[1]))
    np.testing.assert_array_equal(got, x @ w.T)


@pytest.mark.parametrize("program", ["gemv", "gemm", "gemm_rows"])
def test_fixed_small_case_bf16(tiled, program):
    w = np.arange(3 * 32, dtype=np.float32).reshape(3, 32) - 20
    x = np.full((2, 32), 0.5, np.float32)
    x[1] = 2
    words = relayout(quantize(w, Q.BF16), Q.BF16)
    n_tokens = 1 if program == "gemv" else 2
    got = run(tiled, program, Q.BF16, words, x[:n_tokens], 3, params(3, 32, words.shape[1]))
    np.testing.assert_array_equal(got, x[:n_tokens] @ w.T)


# ---- every type ---------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
@pytest.mark.parametrize("variant,rows_wg", [("tiled", 4), ("tiled", 8), ("tiled", 32), ("shared", 4), ("shared", 16)])
def test_gemv_every_type(request, qtype, variant, rows_wg):
    pipes = request.getfixturevalue(variant)
    rng = np.random.default_rng(int(qtype))
    for cols in cols_for(qtype):
        words, dense = quantized(rng, 37, cols, qtype)
        x = rng.standard_normal((1, cols)).astype(np.float32)
        got = run(pipes, "gemv", qtype, words, x, 37, params(37, cols, words.shape[1]), rows_wg=rows_wg)
        close(got, x @ dense.T, rtol("gemv", qtype=qtype))


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
@pytest.mark.parametrize("program", ["gemv", "gemm_rows"])
def test_batch_every_type(tiled, qtype, program):
    """A decode batch: up to pipes.gemv_group tokens per gemv.wgsl workgroup, and gemm_rows.wgsl with
    the forward's token count per invocation (up to 8, a program each); every token's outputs are the
    ones it gets alone, bit for bit, and those match numpy; 8 and 11 tokens take 2 and 3 workgroups along y."""
    check_batch(tiled, qtype, program, cols_for(qtype)[-1], rows_wg=8)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_batch_staged_x(tiled, qtype):
    """The same with 32 rows per workgroup, where the quantized types' units round x once into
    workgroup memory (gemv/x_int8.wgsl): a token alone in one chunk of the row, 4 tokens in several
    where workgroup memory is lavapipe's 32 KiB or less; a lane's units, so its sums, are the same
    either way."""
    cols = 4096
    check_batch(tiled, qtype, "gemv", cols, rows_wg=32)
    shape = tiled.gemv_shape(quant(qtype).shader, 32, tiled.gemv_group, cols)
    assert shape["GEMV_STAGE_X"] == 1 and tiled.gemv_shape(quant(qtype).shader, 8, 1, cols)["GEMV_STAGE_X"] == 0
    if tiled.gemv_room <= 32768:
        assert shape["GEMV_XBLOCKS"] * 16 < cols


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.BF16], ids=lambda q: q.name)
def test_batch_taller_workgroups(tiled, qtype):
    """A batch's workgroups with 4 times one token's rows (decode_matmul's GEMV_TALLER), each row's
    units split between subgroups as in one token's workgroup: the same bits as alone."""
    check_batch(tiled, qtype, "gemv", cols_for(qtype)[0], rows_wg=8, batch_rows_wg=32)


def check_batch(pipes, qtype, program, cols, rows_wg, batch_rows_wg=None):
    rng = np.random.default_rng(int(qtype) + 300)
    words, dense = quantized(rng, 37, cols, qtype)
    x = rng.standard_normal((11, cols)).astype(np.float32)
    p = params(37, cols, words.shape[1])
    alone = np.concatenate([run(pipes, program, qtype, words, x[i:i + 1], 37, p, rows_wg=rows_wg)
                            for i in range(len(x))])
    close(alone, x @ dense.T, rtol(program, qtype=qtype))
    for n_tokens in (2, 3, 8, 11):
        got = run(pipes, program, qtype, words, x[:n_tokens], 37, p, rows_wg=batch_rows_wg or rows_wg,
                  split_rows=rows_wg)
        np.testing.assert_array_equal(got, alone[:n_tokens])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.BF16], ids=lambda q: q.name)
def test_gemv_batch_without_subgroups(shared, qtype):
    """The same through lanes_shared.wgsl (adapters without subgroups): 5 tokens of a gated matrix
    with its input normalized, each as it is alone."""
    rng = np.random.default_rng(int(qtype) + 400)
    rows, cols = 37, cols_for(qtype)[-1]
    (gate_w, _), (up_w, _) = quantized(rng, rows, cols, qtype), quantized(rng, rows, cols, qtype)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    buffer, (n_at, g_at, u_at) = aligned(norm, gate_w, up_w)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    p = params(rows, cols, gate_w.shape[1], pl.MODE_NORM | pl.MODE_GATED, (g_at, u_at, 0), norm_w=n_at)
    alone = np.concatenate([run(shared, "gemv", qtype, buffer, x[i:i + 1], rows, p, gated=True) for i in range(5)])
    np.testing.assert_array_equal(run(shared, "gemv", qtype, buffer, x, rows, p, gated=True), alone)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_gemm_every_type(tiled, qtype):
    rng = np.random.default_rng(int(qtype) + 100)
    cols = cols_for(qtype)[-1]
    words, dense = quantized(rng, 45, cols, qtype)
    for n_tokens in (19, 77):
        x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
        got = run(tiled, "gemm", qtype, words, x, 45, params(45, cols, words.shape[1]))
        close(got, x @ dense.T, RTOL_F16)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_gemm_rows_every_type(tiled, qtype):
    rng = np.random.default_rng(int(qtype) + 200)
    cols = cols_for(qtype)[-1]
    words, dense = quantized(rng, 37, cols, qtype)
    for n_tokens in (1, 11):
        x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
        got = run(tiled, "gemm_rows", qtype, words, x, 37, params(37, cols, words.shape[1]))
        close(got, x @ dense.T, RTOL)


# ---- fusions --------------------------------------------------------------------------------------
FUSED_CASES = [("gemv", 1), ("gemv", 5), ("gemm", 20), ("gemm", 77), ("gemm_rows", 9)]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.BF16, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("program,n_tokens", FUSED_CASES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_norm_gated_activation(tiled, qtype, program, n_tokens, activation):
    """act(gate . rmsnorm(x)) * (up . rmsnorm(x)), the norm weight, gate and up in one buffer (for
    gemm.wgsl, rmsnorm.wgsl normalizes first)."""
    rng = np.random.default_rng(1)
    rows, cols = 45, 512
    gate_w, gate = quantized(rng, rows, cols, qtype)
    up_w, up = quantized(rng, rows, cols, qtype)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    buffer, (n_at, g_at, u_at) = aligned(norm, gate_w, up_w)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * 3
    mode = pl.MODE_NORM | pl.MODE_GATED | (pl.MODE_GELU if activation == "gelu_tanh" else 0)
    x_in, mode = normed_for(tiled, program, x, buffer, n_at, mode)
    p = params(rows, cols, gate_w.shape[1], mode, (g_at, u_at, 0), norm_w=n_at)
    got = run(tiled, program, qtype, buffer, x_in, rows, p, gated=True)
    h = ref.rmsnorm(x, norm, 1e-5)
    close(got, ref.ACTIVATIONS[activation](h @ gate.T) * (h @ up.T), rtol(program, True, qtype))


def rounded_blocks(y):
    """numpy's gemv/x_round.wgsl: each run of 16 values as int8 q, with step = max |value| / 127."""
    blocks = y.reshape(*y.shape[:-1], -1, 16).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    return np.rint(blocks * inv).astype(np.int32), (amax / np.float32(127)).astype(np.float32)[..., 0]


@pytest.mark.parametrize("qtype,down_type", [(Q.Q4_K, Q.Q4_K), (Q.Q4_K, Q.Q6_K), (Q.BF16, Q.Q8_0), (Q.Q5_0, Q.Q5_1),
                                             (Q.Q4_0, Q.Q4_0), (Q.Q5_K, Q.Q5_K)], ids=lambda q: q.name)
@pytest.mark.parametrize("n_tokens,rows_wg", [(1, 16), (3, 16), (8, 32)])
def test_gated_output_rounded_for_ffn_down(tiled, qtype, down_type, n_tokens, rows_wg):
    """MODE_ROUND_OUT: the gated gemv stores its output rounded after the floats (records of 16 int8
    and their step, step * sum and sum), and ffn_down's gemv reading them (its STAGE_X 2) makes the
    bits it makes when it rounds the floats itself, alone and in a batch, close to numpy's."""
    rng = np.random.default_rng(int(qtype) * 7 + int(down_type))
    # ffn_down's rows: whole K-quant blocks, or 800 = 50 workgroups of 16 rows and 25 of 32
    n_ff, cols = 768 if quant(down_type).gpu_block == 256 else 800, cols_for(qtype)[-1]
    (gate_w, gate), (up_w, up) = quantized(rng, n_ff, cols, qtype), quantized(rng, n_ff, cols, qtype)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    buffer, (n_at, g_at, u_at) = aligned(norm, gate_w, up_w)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    stored_at = n_tokens * n_ff + 4  # a float offset past the outputs, as Scratch.ffn_stored
    mode = pl.MODE_NORM | pl.MODE_GATED | pl.MODE_ROUND_OUT
    p = params(n_ff, cols, gate_w.shape[1], mode, (g_at, u_at, 0), norm_w=n_at, xq_off=stored_at)
    out = run(tiled, "gemv", qtype, buffer, x, n_ff, p, np.zeros(stored_at + n_tokens * n_ff // 2, np.float32),
              rows_wg=rows_wg, n_tokens=n_tokens)
    h = out[:n_tokens * n_ff].reshape(n_tokens, n_ff)
    plain = run(tiled, "gemv", qtype, buffer, x, n_ff, params(n_ff, cols, gate_w.shape[1], mode & ~pl.MODE_ROUND_OUT,
                                                            (g_at, u_at, 0), norm_w=n_at), rows_wg=rows_wg)
    np.testing.assert_array_equal(h, plain)
    hn = ref.rmsnorm(x, norm, 1e-5)
    close(h, ref.ACTIVATIONS["silu"](hn @ gate.T) * (hn @ up.T), rtol("gemv", True, qtype))

    records = out[stored_at:].reshape(n_tokens, n_ff // 16, 8)
    q = records[..., :4].copy().view(np.int8).astype(np.int32)
    step, scaled, sq, total = records[..., 4], records[..., 5], records[..., 6], records[..., 7].copy().view(np.int32)
    want_q, want_step = rounded_blocks(h)
    np.testing.assert_allclose(step, want_step, rtol=1e-6)
    assert np.abs(q - want_q).max() <= 1 and np.mean(q != want_q) < 0.01  # ties may round the other way
    np.testing.assert_array_equal(total, q.sum(axis=-1))
    np.testing.assert_allclose(scaled, step * total, rtol=1e-6)
    assert not sq.any()

    down_w, down = quantized(rng, 37, n_ff, down_type)
    pd = params(37, n_ff, down_w.shape[1], xq_off=stored_at)
    from_stored = run(tiled, "gemv", down_type, down_w, out[None], 37, pd, n_tokens=n_tokens, cols=n_ff, x_stored=True)
    itself = run(tiled, "gemv", down_type, down_w, h, 37, pd)
    np.testing.assert_array_equal(from_stored, itself)
    close(from_stored, h @ down.T, rtol("gemv", qtype=down_type))
    if n_tokens > 1:
        alone = run(tiled, "gemv", down_type, down_w, out[None], 37, pd, n_tokens=1, cols=n_ff, x_stored=True)
        np.testing.assert_array_equal(from_stored[:1], alone)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.BF16, Q.Q5_0], ids=lambda q: q.name)
@pytest.mark.parametrize("program,n_tokens", FUSED_CASES + [("gemm", 30)])
def test_segments_norm_and_residual(shared, qtype, program, n_tokens):
    """q, k, v stacked into one output row at an offset, the input normalized, added to what Y holds."""
    rng = np.random.default_rng(2)
    cols = 256
    parts = [quantized(rng, r, cols, qtype) for r in (36, 12, 12)]
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    buffer, offsets = aligned(norm, *[p[0] for p in parts])
    rows = 60
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    y = rng.standard_normal((n_tokens, rows + 4)).astype(np.float32)
    x_in, mode = normed_for(shared, program, x, buffer, offsets[0], pl.MODE_ACCUMULATE | pl.MODE_NORM)
    p = params(rows, cols, parts[0][0].shape[1], mode, tuple(offsets[1:]), (36, 48),
               norm_w=offsets[0], y_stride=rows + 4, y_off=4)
    got = run(shared, program, qtype, buffer, x_in, rows, p, y=y.copy())
    want = y.copy()
    want[:, 4:] += ref.rmsnorm(x, norm, 1e-5) @ np.concatenate([p[1] for p in parts]).T
    close(got, want, rtol(program, True, qtype))


@pytest.mark.parametrize("first", [Q.Q4_K, Q.Q5_K], ids=lambda q: q.name)
@pytest.mark.parametrize("variant", ["tiled", "shared"])
@pytest.mark.parametrize("n_tokens,rows_wg", [(1, 8), (3, 16), (8, 8), (8, 32)])
def test_mixed_k_q6_k_segments(request, first, variant, n_tokens, rows_wg):
    """Q4_K_M's and Q5_K_M's QKV in one gemv (layer.MIXED_UNITS): Q4_K or Q5_K q and k, then a
    Q6_K v with rows of another length, the input normalized, each quad of rows on its own type's
    unit."""
    pipes = request.getfixturevalue(variant)
    rng = np.random.default_rng(5)
    cols = 512
    parts = [quantized(rng, r, cols, t) for r, t in ((36, first), (12, first), (12, Q.Q6_K))]
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    buffer, offsets = aligned(norm, *[p[0] for p in parts])
    rows = 60
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    p = params(rows, cols, parts[0][0].shape[1], pl.MODE_NORM, tuple(offsets[1:]), (36, 48), norm_w=offsets[0],
               row_words2=parts[2][0].shape[1])
    assert parts[2][0].shape[1] != parts[0][0].shape[1]
    unit = MIXED_UNITS[(quant(first).shader, "q6_k")]
    got = run(pipes, "gemv", first, buffer, x, rows, p, rows_wg=rows_wg, unit=unit)
    want = ref.rmsnorm(x, norm, 1e-5) @ np.concatenate([p[1] for p in parts]).T
    close(got, want, RTOL_INT8)


@pytest.mark.parametrize("program,n_tokens", [("gemv", 1), ("gemv", 3), ("gemm", 3), ("gemm_rows", 3)])
def test_lm_head_reads_from_the_step_token(tiled, program, n_tokens):
    """MODE_X_STEP: the LM head reads input rows S.lm_first.. (the last position of a chunk)."""
    rng = np.random.default_rng(5)
    rows, cols = 19, 256
    words, dense = quantized(rng, rows, cols, Q.Q6_K)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    got = run(tiled, program, Q.Q6_K, words, x, rows, params(rows, cols, words.shape[1], pl.MODE_X_STEP),
              n_tokens=n_tokens, lm_first=2)
    close(got, x[2:2 + n_tokens] @ dense.T, rtol(program, qtype=Q.Q6_K))


# ---- the program a matrix gets ------------------------------------------------------------------
@pytest.mark.parametrize("qtype,rows,cols,want", [
    (Q.Q4_K, 128256, 2048, (32, "q4_k")),   # many rows: one quad per subgroup
    (Q.Q8_0, 2048, 8192, (4, "q8_0")),      # few rows, long ones: 8 subgroups per quad, 2 units a lane
    (Q.Q6_K, 2048, 8192, (8, "q6_k")),      # the same with 1 unit a lane: two quads, 4 subgroups each
    (Q.Q4_K, 3072, 2048, (16, "q4_k")),     # 64 units a row keep only 2 subgroups busy
    (Q.Q8_0, 16384, 2048, (32, "q8_0")), (Q.BF16, 3072, 2048, (8, "bf16")),
    (Q.Q4_0, 8192, 2048, (16, "q4_0")), (Q.Q5_K, 100, 256, (32, "q5_k"))])
def test_decode_matmul_choice(tiled, qtype, rows, cols, want):
    rows_wg, shape = tiled.decode_matmul(rows, cols, quant(qtype))
    assert (rows_wg, shape["GEMV_UNIT"]) == want and shape["GEMV_ROWS_WG"] == rows_wg


@pytest.mark.parametrize("rows,cols,n_tokens,want", [
    (128256, 2048, 8, 128), (128256, 2048, 4, 128), (8192, 2048, 8, 64), (8192, 2048, 4, 32),
    (2048, 8192, 8, 16), (3072, 2048, 8, 16), (2048, 2048, 8, 16), (128256, 2048, 1, 32)])
def test_a_batch_takes_taller_workgroups_while_the_grid_fills_the_gpu(tiled, rows, cols, n_tokens, want):
    """Up to GEMV_TALLER times one token's rows, while the workgroups of all token groups stay at
    least GEMV_BATCH_GRID (the 1B shape's LM head, gate/up, ffn_down, QKV and output projection);
    the split of a row's units stays one token's."""
    rows_wg, shape = tiled.decode_matmul(rows, cols, quant(Q.Q4_K), n_tokens)
    one, _ = tiled.decode_matmul(rows, cols, quant(Q.Q4_K))
    assert rows_wg == want and shape["GEMV_SPLIT_QUADS"] == one // 4
    grid = pl.ceil_div(rows, rows_wg) * pl.ceil_div(n_tokens, tiled.gemv_group)
    assert rows_wg == one or grid >= pl.GEMV_BATCH_GRID


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("splits", [2, 3])
def test_gemm_split_along_k(tiled, qtype, accumulate, splits):
    """Workgroups along z: each sums its share of the 32-column steps (32 steps in 3: 10, 11, 11)
    into its own (tokens, rows) partial, and split_sum.wgsl adds the partials into y (a column
    slice of a wider y, onto it with accumulate)."""
    rng = np.random.default_rng(int(qtype) + accumulate)
    rows, cols, n_tok, y_stride, y_off = 45, 1024, 77, 50, 3
    words, dense = quantized(rng, rows, cols, qtype)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    step = pl.pack_step(0, n_tok)
    (part,) = pl.run_once(tiled, "gemm", quant(qtype), [words, x, np.zeros((splits, n_tok, rows), np.float32),
                                                        params(rows, cols, words.shape[1]), step],
                          (1, pl.ceil_div(n_tok, pl.GEMM_TILE_TOKENS), splits))
    steps = cols // pl.GEMM_K
    bounds = [z * steps // splits * pl.GEMM_K for z in range(splits + 1)]
    want = np.stack([x[:, a:b].astype(np.float64) @ dense[:, a:b].T.astype(np.float64)
                     for a, b in zip(bounds, bounds[1:])])
    close(part, want, RTOL_F16)
    y0 = rng.standard_normal((n_tok, y_stride)).astype(np.float32)
    sums = pl.pack_params("split_sum", rows=rows, splits=splits, y_stride=y_stride, y_off=y_off,
                          accumulate=int(accumulate))
    (y,) = pl.run_once(tiled, "split_sum", None, [part, y0, sums, step], (1, n_tok, 1))
    expected = y0.copy()
    expected[:, y_off:y_off + rows] = part.sum(axis=0) + (y0[:, y_off:y_off + rows] if accumulate else 0)
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows,cols,gated,half,want", [
    (2048, 8192, False, "f16", 3),   # ffn_down: 3 parts of 2,048+ columns
    (576, 1536, False, "f16", 2),    # SmolLM2's ffn_down: parts of 768
    (512, 2048, False, "f16", 4),    # Q4_K_M's V, a QKV matmul of its own: 4 row tiles
    (128, 64, False, "f16", 2),      # as many as the 2 steps of 32 columns
    (2048, 2048, False, "f16", 2),   # attn_output
    (3072, 2048, False, "f16", 2),   # QKV
    (4096, 2048, False, "f16", 2),   # 32 row tiles
    (4097, 2048, False, "f16", 1),   # 33
    (8192, 2048, True, "f16", 1),    # gate/up
    (128256, 2048, False, "f16", 1), # an LM head
    (896, 4840, False, "f16", 1),    # columns not a multiple of a step
    (2048, 8192, False, "f32", 1),   # gemm_rows.wgsl's adapters
])
def test_gemm_split_choice(tiled, rows, cols, gated, half, want):
    pipes = tiled if half == "f16" else pl.Pipelines(get_context(), matmul="rows")
    assert pipes.half == half and pipes.gemm_splits(rows, cols, gated) == want


@pytest.mark.parametrize("rows,gated,want", [(16384, False, 128), (2048, False, 16), (8192, True, 128), (45, False, 1)])
def test_gemm_row_tiles(tiled, rows, gated, want):
    """Tiles of 128 rows; a gate/up tile holds 64 gate rows and their 64 up rows."""
    assert tiled.gemm_groups(rows, gated) == want


@pytest.mark.parametrize("context,want", [(get_context, "gemm"), (lambda: WithoutF16(get_context()), "gemm_rows")])
def test_chunks_need_f16_for_gemm(context, want):
    """gemm.wgsl computes in f16: an adapter without shader-f16 prefills through gemm_rows.wgsl; up to
    gemv_tokens tokens take gemv.wgsl on either."""
    from airframe.gpu.layer import Op

    pipes = pl.Pipelines(context(), matmul="tiled")
    op = Op("m", "matmul", quant(Q.Q8_0), None, rows=64, cols=256)
    assert pipes.gemv_tokens == pl.GEMV_TOKENS
    op.dispatch(pipes, pipes.gemv_tokens + 1, 1)
    op.dispatch(pipes, pipes.gemv_tokens, 1)
    assert [key[0] for key in pipes._pipelines] == [want, "gemv"]
