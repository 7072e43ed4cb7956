"""attention_decode.wgsl's two shortcuts for short and single-token work:

- with a single split it writes the normalized output itself (the runtime then skips
  attention_merge.wgsl): the same query over 1, 2 and many splits, against each other and numpy;
- ATTN_ROPE = 1 (decode) does rope.wgsl's work itself (bias, QK-norm, RoPE, the K/V write of the new
  position): the same as rope.wgsl followed by the plain variant, cache included.
"""

import numpy as np
import pytest

from airframe import reference as ref
from airframe.gpu import pipelines as pl
from airframe.gpu.device import get_context

TOL = 1e-5  # relative to the largest output magnitude: float32 sums in another order
SHAPES = [(9, 3, 64), (32, 8, 64), (4, 1, 256)]  # SmolLM2, Llama 3.2 1B, Gemma 3
UNTOUCHED = 7.0


@pytest.fixture(scope="module")
def kernels():
    return pl.Pipelines(get_context())


def attention(kernels, qkv, kv, n_past, tokens, split_len, n_head, n_kv, hd, window=0, rope=None):
    """(direct output, merged output, cache): what attention_decode wrote to OUT itself, the merge of
    its partials, and the K/V cache after it. `rope` = (layer words, angle table, RoPE params) runs ATTN_ROPE."""
    n_ctx = kv.shape[2]
    n_splits = pl.ceil_div(n_past + tokens, split_len)
    step = pl.pack_step(n_past, tokens, 0, split_len)
    params = pl.pack_params("attention_decode", n_head=n_head, n_head_kv=n_kv, head_dim=hd, n_ctx=n_ctx,
                           window=window, scale=hd ** -0.5, qkv_stride=qkv.shape[1], softcap=0.0)
    words, table, rope_params = rope or (np.zeros(4, np.uint32), np.zeros(4, np.float32), bytes(64))
    part = np.zeros(tokens * n_head * n_splits * (hd + 2), np.float32)
    untouched = np.full((tokens, n_head * hd), UNTOUCHED, np.float32)
    shape = {**pl.attention_defines(n_head, n_kv, hd), "ATTN_ROPE": int(rope is not None)}
    cache, part, direct = pl.run_once(kernels, "attention_decode", None,
                                     [qkv, words, table, kv, part, untouched, params, rope_params, step],
                                     (n_splits, n_kv, tokens), shape)
    merge = pl.pack_params("attention_merge", n_head=n_head, head_dim=hd)
    (merged,) = pl.run_once(kernels, "attention_merge", None, [part, np.zeros_like(untouched), merge, step],
                           (n_head, tokens, 1))
    return direct, merged, cache


@pytest.mark.parametrize("n_head,n_kv,hd", SHAPES)
@pytest.mark.parametrize("tokens,window", [(1, 0), (3, 0), (1, 40)])
def test_one_split_without_merge_equals_merged_splits(kernels, n_head, n_kv, hd, tokens, window):
    rng = np.random.default_rng(11)
    n_past = 200
    end = n_past + tokens
    qkv = rng.standard_normal((tokens, (n_head + 2 * n_kv) * hd)).astype(np.float32)
    kv = rng.standard_normal((2, n_kv, end + 5, hd)).astype(np.float32)
    q = qkv[:, :n_head * hd].reshape(tokens, n_head, hd)
    want = ref.attention(q, kv[0][:, :end], kv[1][:, :end], np.arange(n_past, end), hd ** -0.5, window)
    scale = np.abs(want).max()
    one, one_merged, _ = attention(kernels, qkv, kv, n_past, tokens, 256, n_head, n_kv, hd, window)  # 1 split
    np.testing.assert_array_equal(one, one_merged)  # exactly what the merge writes
    np.testing.assert_allclose(one.reshape(want.shape), want, atol=TOL * scale)
    for split_len in (128, 16):  # 2 splits, 13 splits: the merge's output, OUT left alone
        direct, merged, _ = attention(kernels, qkv, kv, n_past, tokens, split_len, n_head, n_kv, hd, window)
        assert (direct == UNTOUCHED).all()
        np.testing.assert_allclose(merged, one, atol=TOL * scale)


def test_one_split_fixed_small_case(kernels):
    """One head of 4 over 2 positions, worked out by hand: softmax([q.k0, q.k1] / 2) @ [v0, v1]."""
    q = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    k = np.array([[2.0, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    v = np.array([[1.0, 2, 3, 4], [5, 6, 7, 8]], np.float32)
    qkv = np.concatenate([q, k[1], v[1]])[None]
    kv = np.stack([k, v])[:, None]  # (2, 1 kv head, 2 positions, 4)
    direct, _, _ = attention(kernels, qkv, kv, 1, 1, 64, 1, 1, 4)
    w = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()
    np.testing.assert_allclose(direct[0], w @ v, rtol=1e-6)


def rope_inputs(rng, n_head, n_kv, hd, n_ctx, style, qk_norm, bias, rope_dim):
    """Layer words (Q/K norm weights, then Q/K/V biases), the angle table, rope.wgsl's params."""
    n_q, n_k = n_head * hd, n_kv * hd
    norms = rng.uniform(0.5, 1.5, 2 * hd).astype(np.float32)
    biases = rng.standard_normal(n_q + 2 * n_k).astype(np.float32)
    words = np.concatenate([norms, biases]).view(np.uint32)
    theta = ref.rope_angles(np.arange(n_ctx), rope_dim, 10000.0)
    table = np.stack([np.cos(theta), np.sin(theta)], -1).astype(np.float32)
    params = pl.pack_params("rope", n_head=n_head, n_head_kv=n_kv, head_dim=hd, rope_dim=rope_dim,
                           neox=int(style == "neox"), qk_norm=int(qk_norm), q_norm_w=0, k_norm_w=hd, eps=1e-6,
                           qkv_stride=n_q + 2 * n_k, n_ctx=n_ctx, table=0, qkv_bias=int(bias), q_bias=2 * hd,
                           k_bias=2 * hd + n_q, v_bias=2 * hd + n_q + n_k)
    return words, table, params


@pytest.mark.parametrize("n_head,n_kv,hd", SHAPES)
@pytest.mark.parametrize("style,qk_norm,bias,rope_dim", [
    ("normal", False, False, None),  # Llama
    ("neox", True, False, None),     # Gemma 3, Qwen 3
    ("neox", False, True, 32),       # Qwen 2's biases; RoPE on part of the head (Phi)
])
@pytest.mark.parametrize("n_past,split_len", [(0, 64), (90, 64), (300, 16)])  # 1, 2 and 19 splits
def test_rope_in_attention_equals_rope_then_attention(kernels, n_head, n_kv, hd, style, qk_norm, bias, rope_dim,
                                                      n_past, split_len):
    rng = np.random.default_rng(12)
    n_ctx = n_past + 4
    words, table, rope_params = rope_inputs(rng, n_head, n_kv, hd, n_ctx, style, qk_norm, bias, rope_dim or hd)
    qkv = rng.standard_normal((1, (n_head + 2 * n_kv) * hd)).astype(np.float32)
    kv = rng.standard_normal((2, n_kv, n_ctx, hd)).astype(np.float32)
    kv[:, :, n_past] = 0.0  # the new position, written by either path
    rotated, want_cache = pl.run_once(kernels, "rope", None, [words, table, qkv, kv, rope_params, pl.pack_step(n_past, 1)],
                                     (n_head + n_kv, 1, 1))
    _, want, _ = attention(kernels, rotated, want_cache, n_past, 1, split_len, n_head, n_kv, hd)
    direct, merged, cache = attention(kernels, qkv, kv, n_past, 1, split_len, n_head, n_kv, hd,
                                      rope=(words, table, rope_params))
    got = direct if n_past + 1 <= split_len else merged
    np.testing.assert_allclose(cache, want_cache, atol=1e-5)
    np.testing.assert_allclose(got, want, atol=TOL * np.abs(want).max())
