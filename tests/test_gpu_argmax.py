"""argmax.wgsl against numpy's argmax: ties to the lowest id, NaN above everything (the first NaN
wins), -0.0 equal to +0.0, -inf a value like any other, any of them flagged in the ring; vocabularies not a multiple of a workgroup's
2,048 logits, and Gemma 3's 262,144."""

import numpy as np
import pytest

from airframe.gpu import pipelines as pl
from airframe.gpu.device import get_context
from airframe.gpu.greedy import ARGMAX_PER_GROUP, NON_FINITE, batch_bounds

UNTOUCHED = 77


@pytest.fixture(scope="module")
def kernels():
    return pl.Pipelines(get_context())


def gpu_argmax(kernels, logits: np.ndarray, n_past: int = 3, ring_len: int = 8):
    """Both stages as the runtime runs them: (token ids buffer, ring) after stage 2."""
    n = logits.size
    groups = pl.ceil_div(n, ARGMAX_PER_GROUP)
    params = pl.pack_params("argmax", n=n, n_groups=groups, ring_len=ring_len)
    step = pl.pack_step(n_past, 1)
    tokens = np.full(4, UNTOUCHED, np.uint32)
    ring = np.full(ring_len, UNTOUCHED, np.uint32)
    candidates = np.zeros((groups, 4), np.uint32)
    candidates, _, _ = pl.run_once(kernels, "argmax", None, [logits, candidates, tokens, ring, params, step],
                                  (groups, 1, 1), {"ARGMAX_STAGE": 1})
    _, tokens, ring = pl.run_once(kernels, "argmax", None, [logits, candidates, tokens, ring, params, step],
                                 (1, 1, 1), {"ARGMAX_STAGE": 2})
    return tokens, ring


def check(kernels, logits: np.ndarray) -> int:
    tokens, ring = gpu_argmax(kernels, logits.astype(np.float32))
    want = int(np.argmax(logits))
    flag = NON_FINITE if not np.isfinite(logits).all() else 0  # the host's signal of damaged logits
    assert tokens[0] == want and ring[3] == want | flag
    assert (tokens[1:] == UNTOUCHED).all() and (np.delete(ring, 3) == UNTOUCHED).all()
    return want


def test_fixed_small_case(kernels):
    assert check(kernels, np.array([0.5, 3.0, -1.0, 3.0, 2.9])) == 1


@pytest.mark.parametrize("n", [1, 7, 2047, 2048, 2049, 49152, 100003, 262144])  # 49,152: SmolLM2; 262,144: Gemma 3
def test_random_logits(kernels, n):
    rng = np.random.default_rng(n)
    check(kernels, rng.standard_normal(n) * 10)


def test_ties_go_to_the_lowest_id_across_workgroups(kernels):
    logits = np.zeros(5 * ARGMAX_PER_GROUP + 11, np.float32)
    logits[[9000, 4097, 10000]] = 2.5
    assert check(kernels, logits) == 4097
    assert check(kernels, np.full(3000, -7.0)) == 0


def test_negative_and_positive_zero_tie(kernels):
    logits = np.full(3000, -1.0, np.float32)
    logits[2500], logits[1200] = 0.0, -0.0
    assert check(kernels, logits) == 1200


def test_minus_infinity(kernels):
    logits = np.full(4100, -np.inf, np.float32)
    assert check(kernels, logits) == 0  # all -inf: the first
    logits[4099] = -1e30
    assert check(kernels, logits) == 4099


def test_nan_counts_as_the_largest_and_the_first_nan_wins(kernels):
    logits = np.random.default_rng(3).standard_normal(6000).astype(np.float32)
    logits[100] = np.inf
    logits[[5000, 3000]] = np.nan
    assert check(kernels, logits) == 3000


def test_the_ring_is_written_only_inside_its_length(kernels):
    tokens, ring = gpu_argmax(kernels, np.arange(10, dtype=np.float32), n_past=8, ring_len=8)
    assert tokens[0] == 9 and (ring == UNTOUCHED).all()


def test_batch_bounds():
    assert batch_bounds(0, 16) == []
    assert batch_bounds(1, 16) == [(0, 1)]
    assert batch_bounds(40, 16) == [(0, 1), (1, 17), (17, 33), (33, 40)]
