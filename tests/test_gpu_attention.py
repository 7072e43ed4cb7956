"""The attention programs against numpy (airframe/reference.py) on lavapipe.

- attention_decode.wgsl: one token, its bias, QK-norm, RoPE and K/V write done inside, split along
  the cache, the splits combined by the last to finish of each K/V head (its arrival counters back
  at zero after), or the output written directly with one split; at 1, 63, 64,
  65, 300, 4096 and 8192 positions, splits of one or several blocks, sliding windows, soft-caps;
  a batch of tokens in several slots at different lengths, each as it runs alone.
- attention_prefill.wgsl: a chunk's queries over the cache (flash attention, causal), tokens not a
  multiple of a row block, after cached positions, with windows and soft-caps.

Shapes: SmolLM2 (9 query / 3 K/V heads of 64), Qwen 2.5 0.5B (14 / 2 of 64), Llama 3.2 1B (32 / 8
of 64), Gemma 3 (4 / 1 of 256), a tiny one (4 / 2 of 16). Tolerance: 1e-5 of the largest output
magnitude (float32 sums in another order); the K/V rows written must match to 1e-5. Prefill sums
its products in f16 in the tiled programs where the adapter has shader-f16: 5e-3 of the largest output (2.3e-3 seen on
these inputs of unit variance), and 1e-5 again in its f32 form.
"""

import numpy as np
import pytest

from airframe import reference as ref
from airframe.gpu import pipelines as pl
from airframe.gpu.device import get_context
from gpu_helpers import WithoutF16

TOL = 1e-5
TOL_F16 = 5e-3
SMOLLM2, QWEN, LLAMA, GEMMA, TINY = (9, 3, 64), (14, 2, 64), (32, 8, 64), (4, 1, 256), (4, 2, 16)
EPS = 1e-6


@pytest.fixture(scope="module")
def pipes():
    return pl.Pipelines(get_context())


def shapes(pipes, n_head, n_kv, hd):
    return pl.attention_shapes(n_head, n_kv, hd, int(pipes.ctx.limits["max-compute-workgroup-storage-size"]),
                               pipes.half)


def attn_params(n_head, n_kv, hd, n_ctx, window=0, softcap=0.0):
    return pl.pack_params("attention_decode", n_head=n_head, n_head_kv=n_kv, head_dim=hd, n_ctx=n_ctx, window=window,
                          scale=hd ** -0.5, qkv_stride=(n_head + 2 * n_kv) * hd, softcap=softcap)


class Rope:
    """Layer words (Q/K norm weights, then Q/K/V biases), the angle table, rope params, and the
    numpy version of what they do to fresh heads."""

    def __init__(self, rng, n_head, n_kv, hd, n_ctx, style="normal", qk_norm=False, bias=False, rope_dim=None):
        self.n_head, self.n_kv, self.hd, self.style, self.qk_norm, self.bias = n_head, n_kv, hd, style, qk_norm, bias
        self.rope_dim = rope_dim or hd
        n_q, n_k = n_head * hd, n_kv * hd
        self.norms = rng.uniform(0.5, 1.5, 2 * hd).astype(np.float32)
        self.biases = rng.standard_normal(n_q + 2 * n_k).astype(np.float32) if bias else np.zeros(n_q + 2 * n_k, np.float32)
        self.words = np.concatenate([self.norms, self.biases]).view(np.uint32)
        theta = ref.rope_angles(np.arange(n_ctx), self.rope_dim, 10000.0)
        self.table = np.stack([np.cos(theta), np.sin(theta)], -1).astype(np.float32)
        self.params = pl.pack_params(
            "rope", n_head=n_head, n_head_kv=n_kv, head_dim=hd, rope_dim=self.rope_dim, neox=int(style == "neox"),
            qk_norm=int(qk_norm), q_norm_w=0, k_norm_w=hd, eps=EPS, qkv_stride=n_q + 2 * n_k, n_ctx=n_ctx,
            table=0, qkv_bias=int(bias), q_bias=2 * hd, k_bias=2 * hd + n_q, v_bias=2 * hd + n_q + n_k,
            **pl.rope_groups(n_q + 2 * n_k))

    def apply(self, qkv, positions):
        """(q, k, v) of raw projections (tokens, stride) as the kernels must make them."""
        n_q, n_k, hd = self.n_head * self.hd, self.n_kv * self.hd, self.hd
        x = qkv + self.biases
        q = x[:, :n_q].reshape(-1, self.n_head, hd)
        k = x[:, n_q:n_q + n_k].reshape(-1, self.n_kv, hd)
        v = x[:, n_q + n_k:].reshape(-1, self.n_kv, hd)
        if self.qk_norm:
            q, k = ref.rmsnorm(q, self.norms[:hd], EPS), ref.rmsnorm(k, self.norms[hd:], EPS)
        q = ref.rope(q, positions, self.rope_dim, 10000.0, self.style)
        k = ref.rope(k, positions, self.rope_dim, 10000.0, self.style)
        return q, k, v


def decode(pipes, qkv, kv, n_past, split_len, rope, window=0, softcap=0.0):
    """(output, cache) of one decode token at n_past."""
    out, cache = decode_rows(pipes, qkv, kv[None], [(0, n_past)], split_len, rope, window, softcap)
    return out[0], cache[0]


def decode_rows(pipes, qkv, kv, rows, split_len, rope, window=0, softcap=0.0):
    """(outputs, caches) of a decode batch: token r (qkv[r]) at position n_past of cache `slot` for
    each (slot, n_past) of `rows`, the caches (slots, 2, n_kv, n_ctx, hd) in one buffer."""
    n_head, n_kv, hd = rope.n_head, rope.n_kv, rope.hd
    n_ctx = kv.shape[3]
    splits = [pl.ceil_div(n_past + 1, split_len) for _, n_past in rows]
    # each K/V head's partials in whole 128-byte lines (attention_decode.wgsl's head_part)
    kv_floats = -(-(n_head // n_kv) * max(splits) * (hd + 4) // 32) * 32
    part_floats = n_kv * kv_floats
    table = np.frombuffer(pl.pack_rows([(slot * kv[0].size // 4, n_past, split_len, r * part_floats)
                                        for r, (slot, n_past) in enumerate(rows)]), np.uint32)
    part = np.zeros(len(rows) * part_floats, np.float32)
    out = np.full((len(rows), n_head * hd), 7.0, np.float32)
    arrived = np.zeros((len(rows), n_kv), np.uint32)
    decode_shape, _ = shapes(pipes, n_head, n_kv, hd)
    cache, part, out, arrived = pl.run_once(
        pipes, "attention_decode", None,
        [qkv, rope.words, rope.table, kv, part, out, attn_params(n_head, n_kv, hd, n_ctx, window, softcap),
         rope.params, table, arrived], (max(splits), n_kv, len(rows)), decode_shape)
    assert not arrived.any(), "the last split of each K/V head sets its counter back to 0"
    return out, cache


def decode_case(rng, shape, n_past, **rope_kw):
    n_head, n_kv, hd = shape
    n_ctx = n_past + 3
    rope = Rope(rng, n_head, n_kv, hd, n_ctx, **rope_kw)
    qkv = rng.standard_normal((1, (n_head + 2 * n_kv) * hd)).astype(np.float32)
    kv = rng.standard_normal((2, n_kv, n_ctx, hd)).astype(np.float32)
    kv[:, :, n_past] = 0.0  # the new position, written by the kernel
    return rope, qkv, kv


def decode_reference(rope, qkv, kv, n_past, window=0, softcap=0.0):
    q, k, v = rope.apply(qkv, np.array([n_past]))
    want_kv = kv.copy()
    want_kv[0][:, n_past], want_kv[1][:, n_past] = k[0], v[0]
    end = n_past + 1
    out = ref.attention(q, want_kv[0][:, :end], want_kv[1][:, :end], np.array([n_past]), rope.hd ** -0.5, window,
                        softcap)
    return out.reshape(-1), want_kv


@pytest.mark.parametrize("shape", [SMOLLM2, QWEN, LLAMA, GEMMA, TINY], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n_past,split_len", [(0, 64), (62, 64), (63, 64), (64, 64), (300, 64), (300, 512),
                                              (4095, 256), (511, 2)])
def test_decode_at_every_length(pipes, shape, n_past, split_len):
    """1, 63, 64, 65, 301 and 4096 positions; 1 to 16 splits; a split of several blocks (512); the
    most splits a token has (backend.MAX_SPLITS, more than the workgroup's invocations)."""
    rng = np.random.default_rng(n_past)
    rope, qkv, kv = decode_case(rng, shape, n_past)
    got, cache = decode(pipes, qkv, kv, n_past, split_len, rope)
    want, want_kv = decode_reference(rope, qkv, kv, n_past)
    np.testing.assert_allclose(cache.reshape(want_kv.shape), want_kv, atol=1e-5)
    np.testing.assert_allclose(got, want, atol=TOL * np.abs(want).max())


@pytest.mark.parametrize("shape", [SMOLLM2, GEMMA], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n_past,split_len", [(0, 64), (300, 128)])
def test_decode_without_subgroups(shape, n_past, split_len):
    """The block maxima and sums through workgroup memory only (adapters without subgroups)."""
    shared = pl.Pipelines(get_context(), reduce="shared")
    rng = np.random.default_rng(n_past + 1)
    rope, qkv, kv = decode_case(rng, shape, n_past)
    got, _ = decode(shared, qkv, kv, n_past, split_len, rope)
    want, _ = decode_reference(rope, qkv, kv, n_past)
    np.testing.assert_allclose(got, want, atol=TOL * np.abs(want).max())


def test_decode_at_8192_positions(pipes):
    rng = np.random.default_rng(8)
    rope, qkv, kv = decode_case(rng, SMOLLM2, 8191)
    got, _ = decode(pipes, qkv, kv, 8191, 128, rope)  # 64 splits
    want, _ = decode_reference(rope, qkv, kv, 8191)
    np.testing.assert_allclose(got, want, atol=TOL * np.abs(want).max())


@pytest.mark.parametrize("shape", [SMOLLM2, GEMMA], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("style,qk_norm,bias,rope_dim", [
    ("normal", False, False, None),  # Llama
    ("neox", True, False, None),     # Gemma 3, Qwen 3
    ("neox", False, True, 32),       # Qwen 2's biases; RoPE on part of the head (Phi)
])
@pytest.mark.parametrize("n_past,split_len,window,softcap", [(0, 64, 0, 0.0), (90, 64, 0, 50.0), (300, 64, 40, 0.0),
                                                             (300, 512, 128, 0.0)])
def test_decode_rope_window_and_softcap(pipes, shape, style, qk_norm, bias, rope_dim, n_past, split_len, window,
                                        softcap):
    rng = np.random.default_rng(12)
    rope, qkv, kv = decode_case(rng, shape, n_past, style=style, qk_norm=qk_norm, bias=bias, rope_dim=rope_dim)
    got, cache = decode(pipes, qkv, kv, n_past, split_len, rope, window, softcap)
    want, want_kv = decode_reference(rope, qkv, kv, n_past, window, softcap)
    np.testing.assert_allclose(cache.reshape(want_kv.shape), want_kv, atol=1e-5)
    np.testing.assert_allclose(got, want, atol=TOL * np.abs(want).max())


def test_decode_fixed_small_case(pipes):
    """One head of 4 at position 1 with RoPE angles of zero (position 0's table row at both):
    softmax of the two scores weights the two value rows."""
    rope = Rope(np.random.default_rng(0), 1, 1, 4, 3)
    rope.table[:] = [1.0, 0.0]  # cos 1, sin 0: no rotation at any position
    qkv = np.array([[1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0]], np.float32)  # q, k, v
    kv = np.zeros((2, 1, 3, 4), np.float32)
    kv[0, 0, 0] = [0.0, 0.0, 0.0, 0.0]
    kv[1, 0, 0] = [-1.0, 0.0, 1.0, 0.0]
    got, cache = decode(pipes, qkv, kv, 1, 64, rope)
    w = np.exp(np.array([0.0, 2.0 * 0.5]))  # scores q.k * 1/sqrt(4)
    w /= w.sum()
    np.testing.assert_allclose(got, w[0] * kv[1, 0, 0] + w[1] * np.array([1, 2, 3, 4]), rtol=1e-6)
    np.testing.assert_array_equal(cache.reshape(2, 1, 3, 4)[:, 0, 1], [[2, 0, 0, 0], [1, 2, 3, 4]])


@pytest.mark.parametrize("shape", [SMOLLM2, LLAMA, GEMMA], ids=lambda s: "x".join(map(str, s)))
def test_decode_batch_rows_at_different_lengths(pipes, shape):
    """A batch of three tokens in slots 2, 0 and 3 of one buffer at positions 300, 0 and 70 (5, 1
    and 2 splits): each row's output and cache are what it gets alone, bit for bit, and match
    numpy; slot 1, in no row, is left as it was."""
    n_head, n_kv, hd = shape
    rng = np.random.default_rng(7)
    rows = [(2, 300), (0, 0), (3, 70)]
    n_ctx = 303
    rope = Rope(rng, n_head, n_kv, hd, n_ctx)
    qkv = rng.standard_normal((len(rows), (n_head + 2 * n_kv) * hd)).astype(np.float32)
    kv = rng.standard_normal((4, 2, n_kv, n_ctx, hd)).astype(np.float32)
    for slot, n_past in rows:
        kv[slot, :, :, n_past] = 0.0
    got, cache = decode_rows(pipes, qkv, kv, rows, 64, rope)
    np.testing.assert_array_equal(cache[1], kv[1])
    for r, (slot, n_past) in enumerate(rows):
        alone, alone_cache = decode(pipes, qkv[r:r + 1], kv[slot], n_past, 64, rope)
        np.testing.assert_array_equal(got[r], alone)
        np.testing.assert_array_equal(cache[slot], alone_cache)
        want, want_kv = decode_reference(rope, qkv[r:r + 1], kv[slot], n_past)
        np.testing.assert_allclose(cache[slot], want_kv, atol=1e-5)
        np.testing.assert_allclose(got[r], want, atol=TOL * np.abs(want).max())


# ---- prefill ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[("tiled", True), ("tiled", False), ("rows", True)],
                ids=["f16", "f32-without-shader-f16", "f32-rows"])
def prefill_pipes(request):
    """attention_prefill.wgsl's two forms: `half` as f16 (tiled, with shader-f16) and as f32."""
    matmul, f16 = request.param
    ctx = get_context()
    assert ctx.has_f16, "lavapipe has shader-f16: both forms are tested here"
    pipes = pl.Pipelines(ctx if f16 else WithoutF16(ctx), matmul=matmul)
    assert pipes.half == ("f16" if f16 and matmul == "tiled" else "f32")
    return pipes


def prefill(pipes, q_rotated, kv, n_past, shape, window=0, softcap=0.0):
    n_head, n_kv, hd = shape
    tokens = q_rotated.shape[0]
    qkv = np.zeros((tokens, (n_head + 2 * n_kv) * hd), np.float32)
    qkv[:, :n_head * hd] = q_rotated.reshape(tokens, -1)
    out = np.full((tokens, n_head * hd), 7.0, np.float32)
    _, prefill_shape = shapes(pipes, n_head, n_kv, hd)
    group = n_head // n_kv
    (got,) = pl.run_once(pipes, "attention_prefill", None,
                         [qkv, kv, out, attn_params(n_head, n_kv, hd, kv.shape[2], window, softcap),
                          pl.pack_step(n_past, tokens)], (pl.ceil_div(tokens * group, 64), n_kv, 1), prefill_shape)
    return got


def test_prefill_tile_keys_follow_the_workgroup_memory():
    """64-key tiles where they fit in `half`: on lavapipe (32 KiB) the f16 form takes the GPUs' tile,
    the f32 form the 32-key one, so test_prefill_chunk runs both."""
    def keys(limit, half):
        return pl.attention_shapes(*LLAMA, limit, half)[1]["ATTN_KEYS"]
    assert (keys(32768, "f16"), keys(32768, "f32")) == (64, 32)
    assert (keys(49152, "f16"), keys(49152, "f32")) == (64, 64)
    assert keys(24575, "f16") == 32


@pytest.mark.parametrize("shape", [SMOLLM2, QWEN, LLAMA, GEMMA, TINY], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n_past,tokens,window,softcap", [
    (0, 37, 0, 0.0),      # a first chunk, causal, not a multiple of a row block
    (0, 2, 0, 0.0),
    (40, 30, 16, 0.0),    # sliding window over cached positions
    (100, 77, 0, 30.0),   # soft-capped scores after cached positions
])
def test_prefill_chunk(prefill_pipes, shape, n_past, tokens, window, softcap):
    pipes = prefill_pipes
    n_head, n_kv, hd = shape
    rng = np.random.default_rng(tokens)
    end = n_past + tokens
    q = rng.standard_normal((tokens, n_head, hd)).astype(np.float32)
    kv = rng.standard_normal((2, n_kv, end + 5, hd)).astype(np.float32)
    got = prefill(pipes, q, kv, n_past, shape, window, softcap)
    want = ref.attention(q, kv[0][:, :end], kv[1][:, :end], np.arange(n_past, end), hd ** -0.5, window, softcap)
    tol = TOL_F16 if pipes.half == "f16" else TOL
    np.testing.assert_allclose(got.reshape(want.shape), want, atol=tol * np.abs(want).max())
