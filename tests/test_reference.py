"""The numpy reference on its own: op identities, prefill/decode consistency, a known continuation.

Its agreement with an implementation nobody here wrote (HF transformers) is in test_reference_hf.py.
"""

import numpy as np
import pytest

from airframe.errors import ContextOverflowError, ParameterError
from airframe.model import open_model
from airframe.options import RunOptions
from airframe.reference import ReferenceBackend, attention, gelu_tanh, greedy, rmsnorm, rope

PROMPT_SMOLLM2 = [504, 3575, 282, 4649, 314]  # "The capital of France is"


@pytest.fixture(scope="module")
def smollm2():
    return ReferenceBackend.load(open_model("smollm2-135m"), RunOptions(n_ctx=64))


def test_rmsnorm_fixed_case():
    x = np.array([[3.0, 4.0]], dtype=np.float32)
    w = np.array([1.0, 2.0], dtype=np.float32)
    rms = np.sqrt((9 + 16) / 2 + 1e-6)
    np.testing.assert_allclose(rmsnorm(x, w, 1e-6), [[3 / rms, 8 / rms]], rtol=1e-6)


@pytest.mark.parametrize("style", ["normal", "neox"])
def test_rope_is_a_rotation_by_position(style):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)
    pos = np.arange(5)
    out = rope(x, pos, 16, 10000.0, style)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_array_equal(out[0], x[0])  # position 0 is the identity
    # the dot product of two rotated vectors depends only on their distance
    q, k = x[:1], x[1:2]
    d1 = np.sum(rope(q, np.array([7]), 16, 1e4, style) * rope(k, np.array([3]), 16, 1e4, style))
    d2 = np.sum(rope(q, np.array([14]), 16, 1e4, style) * rope(k, np.array([10]), 16, 1e4, style))
    assert d1 == pytest.approx(d2, rel=1e-4)


def test_rope_pairs_differ_between_styles():
    x = np.zeros((1, 1, 4), dtype=np.float32)
    x[0, 0, 0] = 1.0
    normal = rope(x, np.array([1]), 4, 1.0, "normal")[0, 0]
    neox = rope(x, np.array([1]), 4, 1.0, "neox")[0, 0]
    np.testing.assert_allclose(normal, [np.cos(1), np.sin(1), 0, 0], atol=1e-6)  # pair (0, 1)
    np.testing.assert_allclose(neox, [np.cos(1), 0, np.sin(1), 0], atol=1e-6)  # pair (0, 2)


def test_attention_against_loops_with_gqa_and_window():
    rng = np.random.default_rng(1)
    n_head, n_kv, hd, n_ctx = 4, 2, 8, 6
    q = rng.standard_normal((3, n_head, hd)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    positions = np.array([3, 4, 5])
    out = attention(q, k, v, positions, 0.5, window=3)
    for qi, p in enumerate(positions):
        for h in range(n_head):
            keys = [j for j in range(n_ctx) if j <= p and p - j < 3]
            s = np.array([q[qi, h] @ k[h // 2, j] * 0.5 for j in keys])
            w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(out[qi, h], w @ v[h // 2, keys], rtol=1e-5, atol=1e-6)


def test_gelu_tanh_known_values():
    np.testing.assert_allclose(gelu_tanh(np.array([0.0, 1.0, -1.0], dtype=np.float32)),
                               [0.0, 0.841192, -0.158808], atol=1e-5)


def test_greedy_continuation_of_smollm2_begins_paris(smollm2):
    out = greedy(smollm2, PROMPT_SMOLLM2, 3)
    tokens = smollm2.model.gf.metadata["tokenizer.ggml.tokens"]
    assert "".join(tokens[t] for t in out).startswith("ĠParis")


def test_decode_after_prefill_equals_one_shot_prefill(smollm2):
    seq = PROMPT_SMOLLM2 + [7042, 30, 198]
    smollm2.reset()
    one_shot = smollm2.forward(seq, all_logits=True)
    smollm2.reset()
    smollm2.forward(seq[:5])
    stepped = [smollm2.forward([t]) for t in seq[5:]]
    np.testing.assert_allclose(np.stack(stepped), one_shot[5:], atol=2e-4, rtol=1e-4)


def test_context_overflow_names_both_sizes(smollm2):
    smollm2.reset()
    with pytest.raises(ContextOverflowError, match="65.*64"):
        smollm2.forward(list(range(65)))


def test_bad_token_ids_are_parameter_errors(smollm2):
    """As on the other backends: a 400 through the server, not a 500."""
    smollm2.reset()
    with pytest.raises(ParameterError, match="token id 49152 is outside the vocabulary 0..49151"):
        smollm2.forward([1, 49152])
    with pytest.raises(ParameterError, match="token id -1 is outside"):
        smollm2.forward([-1])
    with pytest.raises(ParameterError, match=r"shape \(0,\), expected a non-empty 1-D sequence"):
        smollm2.forward([])
    assert smollm2.n_past == 0
