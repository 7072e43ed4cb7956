"""attention_decode.wgsl with a single split writes the normalized output itself (the runtime then
skips attention_merge.wgsl): the same query over 1, 2 and many splits, against each other and the
numpy reference."""

import numpy as np
import pytest

from airframe import reference as ref
from airframe.gpu import kernels as K
from airframe.gpu.device import get_context

TOL = 1e-5  # relative to the largest output magnitude: float32 sums in another order


@pytest.fixture(scope="module")
def kernels():
    return K.Kernels(get_context())


def attention(kernels, qkv, kv, n_past, tokens, split_len, n_head, n_kv, hd, window=0):
    """(direct output, merged output): what attention_decode wrote to OUT itself, and the merge of its partials."""
    n_ctx = kv.shape[2]
    n_splits = K.ceil_div(n_past + tokens, split_len)
    step = K.pack_step(n_past, tokens, 0, split_len)
    params = K.pack_params("attention_decode", n_head=n_head, n_head_kv=n_kv, head_dim=hd, n_ctx=n_ctx,
                           window=window, scale=hd ** -0.5, qkv_stride=qkv.shape[1])
    part = np.zeros(tokens * n_head * n_splits * (hd + 2), np.float32)
    untouched = np.full((tokens, n_head * hd), 7.0, np.float32)
    part, direct = K.run_once(kernels, "attention_decode", None, [qkv, kv, part, untouched, params, step],
                              (n_splits, n_kv, tokens), K.attention_defines(n_head, n_kv, hd))
    merge = K.pack_params("attention_merge", n_head=n_head, head_dim=hd)
    (merged,) = K.run_once(kernels, "attention_merge", None, [part, np.zeros_like(untouched), merge, step],
                           (n_head, tokens, 1))
    return direct, merged


@pytest.mark.parametrize("n_head,n_kv,hd", [(9, 3, 64), (32, 8, 64), (4, 1, 256)])  # SmolLM2, Llama 3.2 1B, Gemma 3
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
    one, one_merged = attention(kernels, qkv, kv, n_past, tokens, 256, n_head, n_kv, hd, window)   # 1 split
    np.testing.assert_array_equal(one, one_merged)  # exactly what the merge writes
    np.testing.assert_allclose(one.reshape(want.shape), want, atol=TOL * scale)
    for split_len in (128, 16):  # 2 splits, 13 splits: the merge's output, OUT left alone
        direct, merged = attention(kernels, qkv, kv, n_past, tokens, split_len, n_head, n_kv, hd, window)
        assert (direct == 7.0).all()
        np.testing.assert_allclose(merged, one, atol=TOL * scale)


def test_one_split_fixed_small_case(kernels):
    """One head of 4 over 2 positions, worked out by hand: softmax([q.k0, q.k1] / 2) @ [v0, v1]."""
    q = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    k = np.array([[2.0, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    v = np.array([[1.0, 2, 3, 4], [5, 6, 7, 8]], np.float32)
    qkv = np.concatenate([q, k[1], v[1]])[None]
    kv = np.stack([k, v])[:, None]  # (2, 1 kv head, 2 positions, 4)
    direct, _ = attention(kernels, qkv, kv, 1, 1, 64, 1, 1, 4)
    w = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()
    np.testing.assert_allclose(direct[0], w @ v, rtol=1e-6)
