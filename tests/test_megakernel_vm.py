"""The numpy VM against the numpy reference, and its fixed reduction orders.

The package stores matrices as BF16, so the reference is fed the same BF16-rounded matrices
(norm weights stay F32 in both): what is left is summation order, so logits agree to 1e-3
(measured: 7e-5 on SmolLM2's logits of magnitude ~30) and the top-1 token is the same everywhere.
"""

from pathlib import Path

import numpy as np
import pytest

from airframe.family import load_config
from airframe.gguf_file import GGUFFile
from airframe.megakernel.plan.opcodes import attn_span
from airframe.megakernel.plan.package import write_package
from airframe.megakernel.plan.target import load_target
from airframe.megakernel.plan.vm import (VM, FixedPointRangeError, bf16_to_f32, dot_rows, f32_to_bf16, fixed_point_sum,
                                    group_sum, lane_sum, norm_sum, rmsnorm, rmsnorm_deferred, sequential_sum)
from airframe.reference import ReferenceBackend, ReferenceModel
from airframe.tokenizer import build_hf_tokenizer, read_vocab

LOGIT_TOLERANCE = 1e-3
N_TOKENS = 128


def bf16_round(values: np.ndarray) -> np.ndarray:
    return bf16_to_f32(f32_to_bf16(values)).reshape(values.shape)


class Bf16ReferenceModel(ReferenceModel):
    """The reference's float32 weights with every matrix rounded to BF16, as the package stores them."""

    def __init__(self, gf, config):
        super().__init__(gf, config)
        self.token_embd = bf16_round(self.token_embd)
        self.output = self.token_embd if config.tied_embeddings else bf16_round(self.output)

    def layer(self, i):
        if i not in self._layers:
            self._layers[i] = {n: bf16_round(v) if v.ndim == 2 else v for n, v in super().layer(i).items()}
        return self._layers[i]


@pytest.fixture(scope="module")
def english_ids(smollm2_path):
    tokenizer = build_hf_tokenizer(read_vocab(GGUFFile(smollm2_path)))
    text = (Path(__file__).parent / "data" / "english.txt").read_text()
    return tokenizer.encode(text).ids[:N_TOKENS]


@pytest.fixture(scope="module")
def smollm2_package(smollm2_path, tmp_path_factory):
    """8 workers and 64-position chunks: 128 tokens cross from one attention chunk to two (a context
    of up to 64 positions stays in one chunk, so the spread rule changes nothing here)."""
    out = tmp_path_factory.mktemp("smollm2_pkg")
    return write_package(smollm2_path, load_target("rtx3050", workers=8), out, ctx=N_TOKENS, progress=False)


@pytest.fixture(scope="module")
def smollm2_spread_package(smollm2_path, tmp_path_factory):
    """12 workers and a 256-position cache: four chunks of up to 64; from position 95 on the context is
    spread over three and then four chunks of 32-33 positions (opcodes.attn_span), where fixed
    chunks would use two of 64."""
    out = tmp_path_factory.mktemp("smollm2_spread_pkg")
    return write_package(smollm2_path, load_target("rtx3050", workers=12), out, ctx=2 * N_TOKENS, progress=False)


@pytest.fixture(scope="module")
def smollm2_wide_package(smollm2_path, tmp_path_factory):
    """24 workers and a 256-position cache: eight chunks of up to 32, and the wide regime at a small
    scale (up to 8 chunks of at least 16 positions): from position 47 on, 3 to 8 chunks of 16-19."""
    out = tmp_path_factory.mktemp("smollm2_wide_pkg")
    return write_package(smollm2_path, load_target("rtx3050", workers=24), out, ctx=2 * N_TOKENS, progress=False,
                         attn_wide=8, attn_wide_min=16)


@pytest.mark.parametrize("which", ["fixed chunks", "spread", "wide"])
def test_vm_matches_the_bf16_reference_over_128_tokens(smollm2_path, smollm2_package, smollm2_spread_package,
                                                       smollm2_wide_package, english_ids, which):
    package = {"fixed chunks": smollm2_package, "spread": smollm2_spread_package, "wide": smollm2_wide_package}[which]
    k = package.plan.consts
    spans = [attn_span(k, p) for p in (31, 47, 63, 64, 94, 95, N_TOKENS - 1)]
    assert spans == {"fixed chunks": [64] * 7, "spread": [64, 64, 64, 64, 64, 32, 32],
                     "wide": [32, 16, 16, 17, 19, 16, 16]}[which]
    assert which != "wide" or (N_TOKENS - 1) // spans[-1] + 1 == k["attn_chunks"] == 8  # all 8 at the end
    gf = GGUFFile(smollm2_path)
    reference = ReferenceBackend(Bf16ReferenceModel(gf, load_config(gf)), N_TOKENS)
    want = reference.forward(english_ids, all_logits=True)
    vm = VM(package.plan, package.weights)
    got = vm.forward(english_ids, all_logits=True)
    assert len(english_ids) == N_TOKENS
    assert np.abs(got - want).max() < LOGIT_TOLERANCE
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))


def test_vm_greedy_token_is_the_argmax_with_lowest_id_on_ties(smollm2_package):
    vm = VM(smollm2_package.plan, smollm2_package.weights)
    logits, token = vm.step(504, 0)
    assert token == int(np.argmax(logits))
    k = vm.k
    cand = vm._region("cand", 0, 2 * k["lm_parts"])
    cand[0::2] = 5.0  # every slot ties: the lowest id wins
    cand[1::2].view(np.uint32)[:] = np.arange(k["lm_parts"])[::-1] + 100
    assert vm.greedy() == 100


def test_worker_order_inside_a_wave_does_not_change_a_bit(smollm2_path, tmp_path):
    package = write_package(smollm2_path, load_target("rtx3050"), tmp_path, ctx=16, attn_chunk=2, progress=False)
    tokens = [504, 3575, 282, 4649, 314]
    runs = []
    for seed in (None, 1, 2):
        vm = VM(package.plan, package.weights)
        rng = None if seed is None else np.random.default_rng(seed)
        runs.append(vm.forward(tokens, all_logits=True, rng=rng))
    assert runs[0].tobytes() == runs[1].tobytes() == runs[2].tobytes()


def test_lane_sum_fixed_small_case_matches_the_written_order():
    rng = np.random.default_rng(0)
    products = rng.standard_normal((3, 600)).astype(np.float32) * np.float32(1e3)
    acc = np.zeros((3, 32), np.float32)  # the worker's order spelled out element by element
    for j in range(600):
        acc[:, (j // 8) % 32] += products[:, j]
    for half in (16, 8, 4, 2, 1):
        acc = acc[:, :half] + acc[:, half:2 * half]
    assert lane_sum(products).tobytes() == acc[:, 0].tobytes()
    w, x = products[:, :512], rng.standard_normal(512).astype(np.float32)
    assert dot_rows(w, x).tobytes() == lane_sum(w * x).tobytes()
    ones = np.zeros((3, 32), np.float32)  # vec = 1: element p goes to lane p % 32
    for p in range(600):
        ones[:, p % 32] += products[:, p]
    for half in (16, 8, 4, 2, 1):
        ones = ones[:, :half] + ones[:, half:2 * half]
    assert lane_sum(products, 32, 1).tobytes() == ones[:, 0].tobytes()


def test_group_sum_fixed_small_case():
    values = np.random.default_rng(1).standard_normal((37, 5)).astype(np.float32)
    groups = np.zeros((16, 5), np.float32)
    for i in range(37):
        groups[i % 16] += values[i]
    total = np.zeros(5, np.float32)
    for g in range(16):
        total += groups[g]
    assert group_sum(values, 16).tobytes() == total.tobytes()


@pytest.mark.parametrize("n", [576, 2048, 200])
def test_norm_sum_fixed_small_case_matches_the_written_order(n):
    # the worker's RMSNorm sum spelled out: quad q's squares from +0 in order, the 32 quads of
    # each 128-element chunk folded in halves (a warp's shuffles), the chunk sums added in order
    x = (np.random.default_rng(n).standard_normal(n) * 30).astype(np.float32)
    chunks = -(-n // 128)
    quads = np.zeros((chunks, 32), np.float32)
    for i in range(n):
        quads[i // 128, (i // 4) % 32] += x[i] * x[i]
    for half in (16, 8, 4, 2, 1):
        quads = quads[:, :half] + quads[:, half:2 * half]
    total = np.float32(0.0)
    for c in range(chunks):
        total = np.float32(total + quads[c, 0])
    assert norm_sum(x).tobytes() == total.tobytes()
    assert float(norm_sum(x)) == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-6)


def test_deferred_norm_scale_is_one_rounding_from_the_norm_first():
    # dot(w, x * g) * inv (the QKV and FFN tasks) against dot(w, (x * inv) * g) (the final norm's form)
    rng = np.random.default_rng(7)
    x, g = rng.standard_normal(2048).astype(np.float32), rng.uniform(0.5, 1.5, 2048).astype(np.float32)
    w = rng.standard_normal((64, 2048)).astype(np.float32)
    y, inv = rmsnorm_deferred(x, g, 1e-5)
    assert y.tobytes() == (x * g).tobytes() and inv.dtype == np.float32
    assert np.allclose(dot_rows(w, y) * inv, dot_rows(w, rmsnorm(x, g, 1e-5)), rtol=1e-5, atol=1e-5)
    mean = np.mean(x.astype(np.float64) ** 2)
    assert float(inv) == pytest.approx(1 / np.sqrt(mean + 1e-5), rel=1e-6)


def test_sequential_sum_is_left_to_right():
    values = np.array([1e8, 1.0, -1e8, 1.0], np.float32)
    assert sequential_sum(values) == np.float32(1.0)  # (((0 + 1e8) + 1) - 1e8) + 1 = 0 + 1


def test_bf16_rounding_is_to_nearest_even():
    values = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf], np.float32)  # 1 + 2^-8 is a tie
    assert bf16_to_f32(f32_to_bf16(values)).tolist() == [1.0, 1.0, 1.015625, -2.5, np.inf]
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]


@pytest.fixture(scope="module")
def smollm2_split_package(smollm2_path, tmp_path_factory):
    """127 workers, split: QKV and WO rows cut into split-K pieces, leftover FFN rows shared."""
    out = tmp_path_factory.mktemp("smollm2_split")
    return write_package(smollm2_path, load_target("h200", workers=127), out, ctx=32, progress=False, split=True)


def test_split_plan_matches_the_bf16_reference(smollm2_path, smollm2_split_package, english_ids):
    plan = smollm2_split_package.plan
    assert plan.tasks["side"].any()  # split-K pieces exist
    assert plan.consts["ffn_parts"] > plan.target.workers  # shared FFN rows exist
    gf = GGUFFile(smollm2_path)
    ids = english_ids[:10]  # ~2 s a token in the VM: 127 workers, ~1,200 tasks a layer
    want = ReferenceBackend(Bf16ReferenceModel(gf, load_config(gf)), 32).forward(ids, all_logits=True)
    got = VM(plan, smollm2_split_package.weights).forward(ids, all_logits=True)
    assert np.abs(got - want).max() < LOGIT_TOLERANCE
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))


def test_split_plan_is_order_free_inside_a_wave(smollm2_split_package):
    tokens = [504, 3575]
    runs = []
    for seed in (None, 3):
        vm = VM(smollm2_split_package.plan, smollm2_split_package.weights)
        rng = None if seed is None else np.random.default_rng(seed)
        runs.append(vm.forward(tokens, all_logits=True, rng=rng))
    assert runs[0].tobytes() == runs[1].tobytes()


def test_fixed_point_sum_is_exact_and_order_free():
    # the FFN reduce (the worker's op_ffn adds the same integers with atomics, in any order)
    rng = np.random.default_rng(5)
    parts = (rng.standard_normal((132, 2048)) * rng.choice([1e-4, 1.0, 300.0], (132, 1))).astype(np.float32)
    total = fixed_point_sum(parts)
    assert total.dtype == np.float32
    assert total.tobytes() == fixed_point_sum(parts[rng.permutation(132)]).tobytes()
    counts = [[round(float(v) * 2**32) for v in col] for col in parts[:, :3].T]  # spelled out in Python ints
    want = np.array([sum(c) / 2**32 for c in counts], np.float32)  # one rounding of the exact count
    assert total[:3].tobytes() == want.tobytes()
    exact = parts.astype(np.float64).sum(axis=0)
    assert np.all(np.abs(total - exact) <= np.spacing(np.abs(exact).astype(np.float32)) + 132 * 2.0**-33)
    assert fixed_point_sum(np.zeros((3, 4), np.float32)).tobytes() == np.zeros(4, np.float32).tobytes()


def test_fixed_point_sum_refuses_what_could_overflow():
    ok = np.full((2, 3), 4194303.5, np.float32)  # just below 2^22
    assert np.all(fixed_point_sum(ok) == np.float32(8388607.0))
    for bad in (4194304.0, np.inf, np.nan):
        parts = np.ones((2, 3), np.float32)
        parts[1, 2] = bad
        with pytest.raises(FixedPointRangeError, match="fixed-point"):
            fixed_point_sum(parts)
