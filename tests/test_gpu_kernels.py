"""The non-matmul shaders against their numpy references, one dispatch at a time on fresh buffers
(lavapipe in CI): RMSNorm, QK-norm + RoPE + K/V write, the embedding lookup. The matmuls are in
test_gpu_matmul.py, attention in test_gpu_attention.py.

Tolerances are stated per test (float32 sums in a different order: ~1e-5 relative).
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from airframe import reference as ref
from airframe.gpu import pipelines as pl
from airframe.gpu.device import get_context
from airframe.quants import quant
from gpu_helpers import close, quantized

RTOL = 2e-5  # relative to the largest output magnitude


@pytest.fixture(scope="module")
def kernels():
    return pl.Pipelines(get_context())


@pytest.mark.parametrize("add,splits", [(False, 0), (True, 0), (False, 2), (False, 3)])
def test_rmsnorm(kernels, add, splits):
    """Y (+)= RMSNorm(X); with K-split partials, X += their sum first (written back), as after a
    split matmul that adds to the residual."""
    rng = np.random.default_rng(3)
    n, tokens = 576, 3
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    x = rng.standard_normal((tokens, n)).astype(np.float32)
    y = rng.standard_normal((tokens, n)).astype(np.float32)
    part = rng.standard_normal((max(splits, 1), tokens, n)).astype(np.float32)
    params = pl.pack_params("rmsnorm", n=n, norm_w=0, eps=1e-6, add=int(add), x_stride=n, y_stride=n,
                            splits=splits)
    got_x, got = pl.run_once(kernels, "rmsnorm", None, [w.view(np.uint32), x, y.copy(), part, params,
                                                        pl.pack_step(0, tokens)], (tokens, 1, 1))
    want_x = x + part[:splits].sum(axis=0)
    close(got_x, want_x, RTOL)
    close(got, ref.rmsnorm(want_x, w, 1e-6) + (y if add else 0), RTOL)


@pytest.mark.parametrize("style,qk_norm,groups", [("normal", False, ()), ("neox", True, ()),
                                                  ("normal", False, ((0, 2),)), ("neox", True, ((0, 2), (768, 3))),
                                                  ("normal", True, ((0, 0), (576, 2), (768, 2)))])
def test_rope_qk_norm_and_cache_write(kernels, style, qk_norm, groups):
    """SmolLM2's 9 query / 3 K/V heads of 64 at positions 5..8 of a 16-position cache. With
    `groups` (first column, K-splits) the QKV rows come as the sums of K-split partials per group
    (a group of no splits lies in QKV), as after a chunk's split QKV matmuls."""
    rng = np.random.default_rng(4)
    n_head, n_kv, hd, n_ctx, n_past, tokens, base = 9, 3, 64, 16, 5, 4, 10000.0
    stride = (n_head + 2 * n_kv) * hd
    qkv = rng.standard_normal((tokens, stride)).astype(np.float32)
    parts = [np.zeros(4, np.float32)] * 3
    given = qkv.copy()  # what QKV holds: the columns of split groups are left stale
    for g, (start, splits) in enumerate(groups):
        end = groups[g + 1][0] if g + 1 < len(groups) else stride
        if splits:
            pieces = rng.standard_normal((splits, tokens, end - start)).astype(np.float32)
            qkv[:, start:end] = 0.0
            for piece in pieces:  # in the kernel's order: the values V must equal exactly
                qkv[:, start:end] += piece
            parts[g] = pieces
            given[:, start:end] = np.nan
    norms = rng.uniform(0.5, 1.5, 2 * hd).astype(np.float32)
    theta = ref.rope_angles(np.arange(n_ctx), hd, base)
    table = np.stack([np.cos(theta), np.sin(theta)], -1).astype(np.float32)
    kv = np.zeros(2 * n_kv * n_ctx * hd, np.float32)
    params = pl.pack_params("rope", n_head=n_head, n_head_kv=n_kv, head_dim=hd, rope_dim=hd,
                           neox=int(style == "neox"), qk_norm=int(qk_norm), q_norm_w=0, k_norm_w=hd, eps=1e-6,
                           qkv_stride=stride, n_ctx=n_ctx, table=0, qkv_bias=0, q_bias=0, k_bias=0,
                           v_bias=0, **pl.rope_groups(stride, list(groups)))
    got_qkv, got_kv = pl.run_once(kernels, "rope", None, [norms.view(np.uint32), table, given, kv, params,
                                                         pl.pack_step(n_past, tokens), *parts],
                                  (n_head + n_kv, tokens, 1))
    pos = np.arange(n_past, n_past + tokens)
    q = qkv[:, :n_head * hd].reshape(tokens, n_head, hd)
    k = qkv[:, n_head * hd:(n_head + n_kv) * hd].reshape(tokens, n_kv, hd)
    v = qkv[:, (n_head + n_kv) * hd:].reshape(tokens, n_kv, hd)
    if qk_norm:
        q, k = ref.rmsnorm(q, norms[:hd], 1e-6), ref.rmsnorm(k, norms[hd:], 1e-6)
    close(got_qkv[:, :n_head * hd].reshape(tokens, n_head, hd), ref.rope(q, pos, hd, base, style), RTOL)
    cache = got_kv.reshape(2, n_kv, n_ctx, hd)
    close(cache[0][:, pos].transpose(1, 0, 2), ref.rope(k, pos, hd, base, style), RTOL)
    np.testing.assert_array_equal(cache[1][:, pos].transpose(1, 0, 2), v)
    assert not cache[:, :, :n_past].any() and not cache[:, :, n_past + tokens:].any()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.BF16], ids=lambda q: q.name)
def test_embedding_chunk(kernels, qtype):
    """Rows 10..29 bound as one chunk: tokens inside are looked up and scaled, the others untouched."""
    rng = np.random.default_rng(6)
    cols = 256
    words, dense = quantized(rng, 40, cols, qtype)
    ids = np.array([12, 3, 29, 10, 35], np.uint32)
    y = np.full((ids.size, cols), 7.0, np.float32)
    params = pl.pack_params("embedding", first_row=10, n_rows=20, cols=cols, row_words=words.shape[1], scale=2.0)
    (got,) = pl.run_once(kernels, "embedding", quant(qtype), [words[10:30], ids, y, params,
                                                                 pl.pack_step(0, ids.size)], (ids.size, 1, 1))
    inside = (ids >= 10) & (ids < 30)
    np.testing.assert_array_equal(got[inside], dense[ids[inside]] * 2.0)
    assert (got[~inside] == 7.0).all()
