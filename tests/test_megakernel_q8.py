"""Q8_0 weights in the megakernel: a model whose matrices are all Q8_0 is packed in its own bytes,
re-laid out for the worker (planner.WEIGHT_FORMATS), and the VM computes with exactly the model's
weights: against the numpy reference, which dequantizes the same file to float32, only the
summation order differs (logits within 1e-5; measured 1.4e-6 on logits up to 2; the same top-1).

The model is a synthetic Q8_0 llama of SmolLM2's widths (576, whose rows need padding to 16
bytes; 9 query heads) cut to two layers, so that every branch of the layout is exercised quickly."""

import numpy as np
import pytest

from airframe.errors import UnsupportedError
from airframe.family import load_config
from airframe.gguf_file import GGUFFile
from airframe.megakernel.plan.package import Package, weight_format, write_package
from airframe.megakernel.plan.planner import Q8_BLOCK, make_plan, plan_stats, q8_down_block_bytes, q8_row_bytes
from airframe.megakernel.plan.target import load_target
from airframe.megakernel.plan.validator import PlanError, validate
from airframe.megakernel.plan.vm import VM
from airframe.reference import ReferenceBackend, ReferenceModel
from airframe.synthetic import write_synthetic_gguf

SHAPE = {"preset": "smollm2-135m", "n_layers": 2}
LOGIT_TOLERANCE = 1e-5
N_TOKENS = 40


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("q8") / "smol-q8.gguf", "llama", SHAPE, "Q8_0")


@pytest.fixture(scope="module")
def q8_package(q8_model, tmp_path_factory):
    """12 workers and a 64-position cache: 40 tokens cross from one attention chunk to several."""
    return write_package(q8_model, load_target("rtx3050", workers=12), tmp_path_factory.mktemp("q8_pkg"), ctx=64,
                         progress=False)


def _stored(package, name: str) -> np.ndarray:
    """A Q8_0 tensor of weights.bin widened to float32, in GGUF orientation, read by the layout's
    own rules (not through the VM)."""
    slot = package.plan.tensors[name]
    raw = np.asarray(package.weights[slot.offset:slot.offset + slot.n_bytes])
    rows, cols = slot.shape
    if slot.transposed:  # blocks of 32 rows: their quants, then one f16 scale per column
        blocks = raw.reshape(rows // Q8_BLOCK, -1)
        quants = blocks[:, :Q8_BLOCK * cols].reshape(rows, cols).view(np.int8)
        scales = blocks[:, Q8_BLOCK * cols:].copy().view(np.float16).astype(np.float32)
        return (quants.astype(np.float32) * np.repeat(scales, Q8_BLOCK, axis=0)).T
    stride = q8_row_bytes(cols)
    table = raw.reshape(rows, stride)
    assert not table[:, cols + cols // 16:].any(), f"{name}: the padding of its rows is not zero"
    scales = table[:, cols:cols + cols // 16].copy().view(np.float16).astype(np.float32)
    return table[:, :cols].view(np.int8).astype(np.float32) * np.repeat(scales, Q8_BLOCK, axis=1)


def test_a_q8_0_model_is_packed_in_its_own_weights(q8_model, q8_package):
    gf = GGUFFile(q8_model)
    plan = q8_package.plan
    assert plan.consts["weights_q8"] == 1
    assert q8_row_bytes(576) == 624 and plan.tensors["blk.0.attn_q.weight"].n_bytes == 576 * 624
    assert plan.tensors["blk.0.ffn_down.weight"].n_bytes == 1536 // 32 * q8_down_block_bytes(576)
    for name in ("token_embd.weight", "blk.1.attn_q.weight", "blk.1.attn_v.weight",
                 "blk.0.attn_output.weight", "blk.0.ffn_up.weight", "blk.1.ffn_down.weight"):
        assert np.array_equal(_stored(q8_package, name), gf.dequantize(name)), name
    assert np.array_equal(np.asarray(q8_package.weights[plan.tensors["blk.0.ffn_norm.weight"].offset:][:576 * 4]
                                     ).view(np.float32), gf.dequantize("blk.0.ffn_norm.weight"))


def test_the_format_is_q8_0_only_when_every_matrix_is(q8_model, smollm2_path, tmp_path):
    gf = GGUFFile(q8_model)
    assert weight_format(gf, load_config(gf)) == "q8_0"
    smol = GGUFFile(smollm2_path)  # Q4_1 with a Q8_0 LM head: widened to BF16 as before
    assert weight_format(smol, load_config(smol)) == "bf16"
    mixed = GGUFFile(write_synthetic_gguf(tmp_path / "mixed.gguf", "llama", "tiny", "Q4_K_M"))
    assert weight_format(mixed, load_config(mixed)) == "bf16"


def test_vm_on_q8_0_matches_the_reference_over_40_tokens(q8_model, q8_package):
    gf = GGUFFile(q8_model)
    config = load_config(gf)
    reference = ReferenceBackend(ReferenceModel(gf, config), n_ctx=64)
    vm = VM(q8_package.plan, q8_package.weights)
    ids = np.random.default_rng(3).integers(0, config.vocab_size, N_TOKENS)
    worst = 0.0
    for pos, token in enumerate(ids):
        logits, greedy = vm.step(int(token), pos)
        want = reference.forward([int(token)])
        worst = max(worst, float(np.abs(logits - want).max()))
        assert greedy == int(np.argmax(want)), pos
    assert worst < LOGIT_TOLERANCE * max(1.0, float(np.abs(want).max())), worst


def test_q8_0_plan_is_order_free_inside_a_wave(q8_package):
    tokens = [5, 77, 301, 2, 4000]
    runs = []
    for seed in (None, 4):
        vm = VM(q8_package.plan, q8_package.weights)
        runs.append(vm.forward(tokens, all_logits=True, rng=None if seed is None else np.random.default_rng(seed)))
    assert runs[0].tobytes() == runs[1].tobytes()


def test_q8_0_halves_the_bytes_a_token_streams(q8_model):
    gf = GGUFFile(q8_model)
    config = load_config(gf)
    target = load_target("rtx3050", workers=12)
    q8, bf16 = (plan_stats(make_plan(config, target, ctx=64, weights=w), pos=0)["bytes_per_token"]
                for w in ("q8_0", "bf16"))
    assert q8 < 0.55 * bf16
    assert abs(q8 - bf16 * 17 / 32) < 0.01 * bf16  # 17/16 bytes a weight against 2


def test_q8_0_needs_whole_blocks(q8_model):
    config = load_config(GGUFFile(q8_model))
    from dataclasses import replace

    with pytest.raises(UnsupportedError, match="n_ff = 1544"):
        make_plan(replace(config, n_ff=1544), load_target("rtx3050"), ctx=64, weights="q8_0")
    with pytest.raises(UnsupportedError, match="weight format 'q4_k'"):
        make_plan(config, load_target("rtx3050"), ctx=64, weights="q4_k")


def test_validator_refuses_a_matrix_of_the_other_format(q8_package):
    plan = q8_package.plan
    validate(plan)
    from dataclasses import replace

    tensors = dict(plan.tensors, **{"blk.1.ffn_up.weight": replace(plan.tensors["blk.1.ffn_up.weight"], dtype="bf16")})
    with pytest.raises(PlanError, match="blk.1.ffn_up.weight stored as bf16, expected q8_0"):
        validate(replace(plan, tensors=tensors))
    assert Package.load(q8_package.path).plan.consts["weights_q8"] == 1
