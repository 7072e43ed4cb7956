"""RoPE scaling: frequencies against transformers' own rope functions, models scaled by YaRN, linear,
Llama 3 factors and Phi-3's LongRoPE against transformers at positions beyond the original context,
GGUF keys and tensors, and the user's override.

Tolerance of the model comparisons: as in test_families.py (float32 from identical weights,
measured <= 6e-7 at 384 positions), bound 2e-5. Without the scaling the same logits move by
4e-3 to 7e-3 beyond the original context (random tiny weights attend almost uniformly, so RoPE
moves them little), which test_scaling_matters_beyond_the_original_context asserts stays above 1e-3.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest

from airframe.backend import open_backend
from airframe.errors import GGUFError, ParameterError
from airframe.family import load_config
from airframe.gguf_file import GGUFFile
from airframe.model import open_model
from airframe.options import RunOptions
from airframe.reference import ReferenceBackend, ReferenceModel
from airframe.rope_scaling import (NONE, RopeScaling, inv_frequencies, llama3_freq_factors, mscale,
                                   read_rope_scaling, requested, yarn_corr_dims)
from airframe.synthetic import write_synthetic_gguf
from hf_rope import hf_rope_parameters

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ORIGINAL_CTX = 128
N_TOKENS = 384           # three times the original context
MAX_DIFF = 2e-5
MIN_EFFECT = 1e-3
# head_dim 64 and an original context of 128 put YaRN's ramp at pairs 0..11 of 32
SHAPE = {"preset": "tiny", "n_embd": 128, "n_head": 2, "n_head_kv": 1, "head_dim": 64, "ctx_train": 4 * ORIGINAL_CTX}
SCALINGS = {
    "yarn": RopeScaling("yarn", 4.0, ORIGINAL_CTX),
    "linear": RopeScaling("linear", 4.0, ORIGINAL_CTX),
    "llama3": RopeScaling("llama3", 8.0, ORIGINAL_CTX),
    "longrope": RopeScaling("longrope", 4.0, ORIGINAL_CTX),  # factor = ctx_train / original, as Phi-3's
}


def _torch():
    if os.environ.get("CI"):
        import torch
        import transformers
    else:
        torch = pytest.importorskip("torch", reason="pip install -r scripts/requirements-hf.txt")
        transformers = pytest.importorskip("transformers", reason="pip install -r scripts/requirements-hf.txt")
    return torch, transformers


def hf_overrides(s: RopeScaling, base: float, gf: GGUFFile) -> dict:
    """Config values transformers' GGUF loader does not read: the rope parameters, and for LongRoPE
    the factor tensors and Phi3Config's own original_max_position_embeddings (default 4096)."""
    params = hf_rope_parameters(s, base)
    if s.type != "longrope":
        return {"rope_parameters": params}
    params.pop("factor")  # transformers derives it from max_position_embeddings, as the converter did
    params["long_factor"] = gf.dequantize("rope_factors_long.weight").tolist()
    params["short_factor"] = gf.dequantize("rope_factors_short.weight").tolist()
    return {"rope_parameters": params, "original_max_position_embeddings": s.original_ctx}


def hf_logits(path: Path, overrides: dict, tokens: list[int]) -> np.ndarray:
    torch, transformers = _torch()
    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **overrides).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


# ---- the frequencies -----------------------------------------------------------------------------
def test_none_and_linear():
    plain = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv_frequencies(64, 10000.0), plain, rtol=1e-15)
    np.testing.assert_allclose(inv_frequencies(64, 10000.0, SCALINGS["linear"]), plain / 4, rtol=1e-15)
    assert mscale(NONE) == mscale(SCALINGS["linear"]) == 1.0


def test_yarn_by_hand():
    """Pairs rotating more than beta_fast times over the original context keep their frequency,
    fewer than beta_slow times are divided by the factor, a linear ramp between; mscale 0.1 ln s + 1."""
    s = SCALINGS["yarn"]
    low, high = yarn_corr_dims(64, 10000.0, s)
    # dim(r) = d ln(ctx / (2 pi r)) / (2 ln base): dim(32) = -1.57 -> 0, dim(1) = 10.47 -> 11
    assert (low, high) == (0.0, 11.0)
    plain = inv_frequencies(64, 10000.0)
    ours = inv_frequencies(64, 10000.0, s)
    assert ours[0] == plain[0]
    np.testing.assert_allclose(ours[11:], plain[11:] / 4, rtol=1e-15)
    kept = (ours[:12] - plain[:12] / 4) / (plain[:12] - plain[:12] / 4)  # share of the original frequency
    np.testing.assert_allclose(kept, 1 - np.arange(12) / 11, atol=1e-12)
    assert mscale(s) == pytest.approx(0.1 * math.log(4) + 1)
    assert mscale(dataclasses.replace(s, attn_factor=0.5)) == pytest.approx(0.5 * (0.1 * math.log(4) + 1))


@pytest.mark.hf
@pytest.mark.parametrize("kind", ["yarn", "linear", "llama3"])
@pytest.mark.parametrize("base, dim", [(10000.0, 64), (500000.0, 128), (1000000.0, 16)])
def test_frequencies_match_transformers(kind, base, dim):
    """transformers' rope init functions (modeling_rope_utils) on a config with the same values."""
    torch, transformers = _torch()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    s = SCALINGS[kind]
    config = transformers.LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim,
                                      max_position_embeddings=4 * s.original_ctx,
                                      rope_parameters=hf_rope_parameters(s, base))
    inv, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    np.testing.assert_allclose(inv_frequencies(dim, base, s), inv.double().numpy(), rtol=1e-6)
    assert mscale(s) == pytest.approx(attention_factor, rel=1e-12)


def test_llama3_factors_by_hand():
    """Short wavelengths keep their frequency, long ones are divided by the factor, a blend between."""
    s = SCALINGS["llama3"]
    factors = llama3_freq_factors(64, 10000.0, s)
    wavelen = 2 * math.pi / inv_frequencies(64, 10000.0)
    assert (factors[wavelen < ORIGINAL_CTX / 4] == 1).all()
    assert (factors[wavelen > ORIGINAL_CTX] == 8).all()
    middle = (wavelen >= ORIGINAL_CTX / 4) & (wavelen <= ORIGINAL_CTX)
    assert middle.any() and ((factors[middle] >= 1) & (factors[middle] <= 8)).all()


# ---- keys, tensors and overrides -----------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rope")


def scaled_model(folder: Path, family: str, kind: str | None, **options) -> Path:
    name = f"{family}-{kind or 'plain'}{'-keys' if options.get('rope_freqs') is False else ''}.gguf"
    if not (folder / name).exists():
        write_synthetic_gguf(folder / name, family, SHAPE, "F32", seed=5,
                             rope_scaling=SCALINGS[kind] if kind else None, **options)
    return folder / name


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_declared_scaling_is_read_from_the_keys(folder, kind):
    config = load_config(GGUFFile(scaled_model(folder, "llama", kind)))
    assert config.rope_scaling == SCALINGS[kind]
    assert load_config(GGUFFile(scaled_model(folder, "llama", None))).rope_scaling == NONE


def test_llama3_from_keys_equals_the_rope_freqs_tensor(folder):
    """Without rope_freqs.weight, the factors come from the llama3 keys: same logits."""
    tokens = list(range(1, 200))
    options = RunOptions(n_ctx=256)
    with_tensor = ReferenceBackend.load(open_model(scaled_model(folder, "llama", "llama3")), options)
    from_keys = ReferenceBackend.load(open_model(scaled_model(folder, "llama", "llama3", rope_freqs=False)), options)
    assert with_tensor.rope_freqs is not None and from_keys.rope_freqs is None
    assert from_keys.config.rope_scaling == SCALINGS["llama3"]
    np.testing.assert_allclose(from_keys.forward(tokens, all_logits=True), with_tensor.forward(tokens, all_logits=True),
                               atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "webgpu"])
def test_user_override_equals_declared_yarn(folder, backend):
    """`rope_scaling="yarn", rope_scale=4` on a file without scaling gives the logits of the same
    weights with YaRN declared in the file (original context: the file's context_length)."""
    tokens = list(range(3, 3 + 160))
    plain = dataclasses.replace(SCALINGS["yarn"], original_ctx=0)  # only the factor is asked for
    options = RunOptions(n_ctx=160)
    declared = open_backend(backend, open_model(scaled_model(folder, "llama", "yarn")), options)
    asked = open_backend(backend, open_model(_with_ctx_train(folder), rope_scaling="yarn", rope_scale=4.0), options)
    assert asked.config.rope_scaling == dataclasses.replace(plain, original_ctx=ORIGINAL_CTX)
    np.testing.assert_allclose(asked.forward(tokens, all_logits=True), declared.forward(tokens, all_logits=True),
                               atol=1e-6)


def _with_ctx_train(folder: Path) -> Path:
    """The YaRN file's weights, no scaling keys, trained context = the original context."""
    path = folder / "llama-yarn-as-plain.gguf"
    if not path.exists():
        write_synthetic_gguf(path, "llama", {**SHAPE, "ctx_train": ORIGINAL_CTX}, "F32", seed=5)
    return path


def test_requested_errors(folder):
    assert requested(None, None) is None
    assert requested("none", None) == NONE
    for kind, factor, words in [("ntk", 2.0, "expected one of"), ("longrope", 2.0, "expected one of"),
                                ("yarn", None, "needs --rope-scale"),
                                ("yarn", 0.5, "expected a number >= 1"), ("linear", float("nan"), ">= 1")]:
        with pytest.raises(ParameterError, match=words):
            requested(kind, factor)
    asked = open_model(_with_ctx_train(folder), rope_scaling="yarn", rope_scale=2.0)
    with pytest.raises(ParameterError, match="cuda"):
        open_backend("cuda", asked, RunOptions())
    with pytest.raises(ParameterError, match="expected a number >= 1"):
        open_model("unused.gguf", rope_scaling="yarn", rope_scale=0.5)  # refused before the file is looked for


def test_bad_scaling_type_in_the_file(folder):
    path = folder / "bad.gguf"
    write_synthetic_gguf(path, "llama", "tiny", "F32", rope_scaling=RopeScaling("yarn", 2.0, 64))
    gf = GGUFFile(path)
    gf.metadata["llama.rope.scaling.type"] = "ntk-by-parts"
    with pytest.raises(GGUFError, match="rope.scaling.type = 'ntk-by-parts', expected one of"):
        read_rope_scaling(gf, "llama", 2048)
    gf.metadata["llama.rope.scaling.type"] = "longrope"
    with pytest.raises(GGUFError, match="'longrope' without the tensors"):
        read_rope_scaling(gf, "llama", 2048)


def test_local_layers_are_not_scaled(folder):
    """Gemma 3: sliding-window layers (own RoPE base) keep plain RoPE; global layers get the scaling."""
    path = write_synthetic_gguf(folder / "gemma3-linear.gguf", "gemma3", {"n_layers": 6, "sliding_window": 8}, "F32",
                                rope_scaling=RopeScaling("linear", 8.0, 1024))
    config = load_config(GGUFFile(path))
    assert [config.layer_rope_scaling(i).type for i in range(6)] == ["none"] * 5 + ["linear"]
    tokens = list(range(1, 41))
    model, options = open_model(path), RunOptions(n_ctx=40)
    reference = open_backend("reference", model, options).forward(tokens, all_logits=True)
    webgpu = open_backend("webgpu", model, options).forward(tokens, all_logits=True)
    assert np.abs(webgpu - reference).max() <= MAX_DIFF


# ---- models against transformers beyond the original context ---------------------------------------
@pytest.fixture(scope="module", params=[("llama", "yarn"), ("qwen2", "yarn"), ("llama", "linear"), ("llama", "llama3"),
                                        ("phi3", "longrope")], ids=lambda p: "-".join(p))
def scaled(request, folder):
    family, kind = request.param
    path = scaled_model(folder, family, kind)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 512, N_TOKENS)]
    model, options = open_model(path), RunOptions(n_ctx=N_TOKENS)
    reference = ReferenceBackend.load(model, options)
    ours = reference.forward(tokens, all_logits=True)
    webgpu = open_backend("webgpu", model, options).forward(tokens, all_logits=True)
    theirs = hf_logits(path, hf_overrides(SCALINGS[kind], reference.config.rope_base, reference.model.gf), tokens)
    unscaled = ReferenceBackend(ReferenceModel(reference.model.gf, dataclasses.replace(reference.config,
                                                                                       rope_scaling=NONE)), N_TOKENS)
    unscaled.rope_freqs = None
    return dict(ours=ours, webgpu=webgpu, theirs=theirs, unscaled=unscaled.forward(tokens, all_logits=True))


@pytest.mark.hf
def test_scaled_model_agrees_with_transformers(scaled):
    beyond = slice(ORIGINAL_CTX, N_TOKENS)
    for name in ("ours", "webgpu"):
        diff = np.abs(scaled[name] - scaled["theirs"])
        print(f"\n{name}: max |diff| {diff.max():.2e}, beyond the original context {diff[beyond].max():.2e}")
        assert diff.max() <= MAX_DIFF
        assert (scaled[name].argmax(-1) == scaled["theirs"].argmax(-1)).all()


@pytest.mark.hf
def test_scaling_matters_beyond_the_original_context(scaled):
    beyond = slice(ORIGINAL_CTX, N_TOKENS)
    assert np.abs(scaled["unscaled"] - scaled["theirs"])[beyond].max() >= MIN_EFFECT


def test_longer_context_than_trained_warns(folder, caplog):
    path = _with_ctx_train(folder)  # trained context 128, no scaling declared
    with caplog.at_level("WARNING", logger="airframe.rope"):
        open_backend("reference", open_model(path), RunOptions(n_ctx=300))
    assert "--rope-scaling yarn --rope-scale 3" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="airframe.rope"):
        open_backend("reference", open_model(path, rope_scaling="yarn", rope_scale=3.0), RunOptions(n_ctx=300))
        open_backend("reference", open_model(path), RunOptions(n_ctx=128))
    assert caplog.text == ""


@pytest.mark.hf
def test_longrope_uses_the_short_factors_within_the_original_context(folder):
    """n_ctx <= the original context: rope_factors_short (llama.cpp and transformers alike)."""
    path = scaled_model(folder, "phi3", "longrope")
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 512, ORIGINAL_CTX)]
    model = open_model(path)
    reference = ReferenceBackend.load(model, RunOptions(n_ctx=ORIGINAL_CTX))
    np.testing.assert_array_equal(reference.rope_freqs, reference.model.gf.dequantize("rope_factors_short.weight"))
    ours = reference.forward(tokens, all_logits=True)
    webgpu = open_backend("webgpu", model, RunOptions(n_ctx=ORIGINAL_CTX)).forward(tokens, all_logits=True)
    theirs = hf_logits(path, hf_overrides(SCALINGS["longrope"], reference.config.rope_base, reference.model.gf), tokens)
    assert np.abs(ours - theirs).max() <= MAX_DIFF and np.abs(webgpu - theirs).max() <= MAX_DIFF
    long = ReferenceBackend.load(model, RunOptions(n_ctx=ORIGINAL_CTX + 1))
    assert np.abs(long.forward(tokens, all_logits=True) - theirs).max() >= MIN_EFFECT


def test_the_megakernel_refuses_declared_scaling(folder):
    """The CUDA plan builds its RoPE from rope_freqs.weight only: a declared scaling is refused by name."""
    from airframe.errors import UnsupportedError
    from airframe.megakernel.plan.planner import check_supported

    check_supported(load_config(GGUFFile(scaled_model(folder, "llama", "llama3"))))  # rope_freqs.weight: fine
    with pytest.raises(UnsupportedError, match="rope scaling yarn"):
        check_supported(load_config(GGUFFile(scaled_model(folder, "llama", "yarn"))))
