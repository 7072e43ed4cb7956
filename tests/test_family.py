"""family.load_config on the real models and on small files with hostile hyperparameters."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from airframe.errors import GGUFError, UnsupportedError
from airframe.family import (CAP_HPARAMS, FLOAT_HPARAMS, INT_HPARAMS, TENSOR_SHAPES, _parse_family, families,
                             families_by_name, family_for, load_config, shape_of, tensor_shapes)
from airframe.gguf_file import GGUFFile
from airframe.models import resolve_model

# A one-layer llama with every size tiny: n_embd 8, 2 heads of 4, 1 K/V head, n_ff 16, vocab 5.
TINY = {"block_count": 1, "embedding_length": 8, "feed_forward_length": 16,
        "attention.head_count": 2, "attention.head_count_kv": 1}
TINY_TENSORS = {
    "token_embd.weight": (5, 8), "output_norm.weight": (8,),
    "blk.0.attn_norm.weight": (8,), "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8),
    "blk.0.attn_v.weight": (4, 8), "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,),
    "blk.0.ffn_gate.weight": (16, 8), "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16),
}


def tiny_llama(path: Path, keys: dict | None = None, tensors: dict | None = None, tokens=True) -> GGUFFile:
    """Write the tiny llama with `keys` (after "llama.") and `tensors` (numpy shapes) overriding."""
    w = GGUFWriter(str(path), "llama")
    for key, value in {**TINY, **(keys or {})}.items():
        if value is None:
            continue
        if isinstance(value, str):
            w.add_string(f"llama.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"llama.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"llama.{key}", value)
        else:
            w.add_uint64(f"llama.{key}", value)
    if tokens:
        w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(5)])
    for name, shape in {**TINY_TENSORS, **(tensors or {})}.items():
        if shape is not None:
            w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


def test_families_are_found():
    assert {"llama", "gemma3"} <= set(families())
    assert family_for("gemma3").switches["qk_norm"] is True
    with pytest.raises(UnsupportedError, match="'gpt2' is not supported; supported: .*llama"):
        family_for("gpt2")


def test_tiny_llama_config(tmp_path):
    config = load_config(tiny_llama(tmp_path / "t.gguf"))
    assert (config.n_layers, config.n_embd, config.n_ff) == (1, 8, 16)
    assert (config.n_head, config.n_head_kv, config.head_dim, config.rope_dim) == (2, 1, 4, 4)
    assert config.vocab_size == 5 and config.tied_embeddings
    assert config.rope_base == 10000.0 and config.rms_eps == 1e-5  # the family's defaults
    assert config.layer_tensors == family_for("llama").layer_tensors


def test_vocab_from_embedding_without_token_list(tmp_path):
    assert load_config(tiny_llama(tmp_path / "t.gguf", tokens=False)).vocab_size == 5


def test_real_models():
    smol = load_config(GGUFFile(resolve_model("smollm2-135m")))
    assert smol.family == "llama" and smol.rope_style == "normal" and not smol.qk_norm
    assert smol.n_head * smol.head_dim == smol.n_embd
    gemma = load_config(GGUFFile(resolve_model("gemma3-270m")))
    assert gemma.family == "gemma3" and gemma.qk_norm and gemma.post_norms
    assert gemma.sliding_window > 0 and gemma.is_local_layer(0) and not gemma.is_local_layer(5)
    assert gemma.layer_rope_base(0) == gemma.rope_base_local != gemma.layer_rope_base(5)
    assert gemma.embedding_scale() == pytest.approx(math.sqrt(gemma.n_embd))
    for config in (smol, gemma):
        assert config.tied_embeddings  # neither file has output.weight
        assert config.n_head % config.n_head_kv == 0


@pytest.mark.parametrize("key, value, found, expected", [
    ("block_count", "one", "'one'", "an integer"),
    ("embedding_length", 1 << 40, str(1 << 40), "an integer in 0.."),
    ("attention.layer_norm_rms_epsilon", float("nan"), "nan", "a finite positive number"),
    ("rope.freq_base", -1.0, "-1.0", "a finite positive number"),
    ("rope.freq_base", "high", "'high'", "a finite positive number"),
    ("context_length", 2.5, "2.5", "an integer"),
    ("attention.head_count", 0, "n_head", "positive"),
    ("attention.head_count_kv", 3, "not a multiple of 3 K/V heads", "query heads"),
    ("rope.dimension_count", 5, "rope dimension 5", "an even value"),
])
def test_bad_hyperparameter_names_key_value_and_expectation(tmp_path, key, value, found, expected):
    gf = tiny_llama(tmp_path / "t.gguf", {key: value})
    with pytest.raises(GGUFError) as info:
        load_config(gf)
    message = str(info.value)
    assert str(gf.path) in message and found in message and expected in message


def test_head_dim_default_with_zero_heads_is_an_error(tmp_path):
    gf = tiny_llama(tmp_path / "t.gguf", {"attention.head_count": 0})
    with pytest.raises(GGUFError, match="n_head"):
        load_config(gf)


def test_per_layer_array_must_be_uniform(tmp_path):
    gf = tiny_llama(tmp_path / "t.gguf", {"attention.head_count_kv": [1, 2]})
    with pytest.raises(UnsupportedError, match=r"head_count_kv = \[1, 2\], expected one value"):
        load_config(gf)
    assert load_config(tiny_llama(tmp_path / "u.gguf", {"attention.head_count_kv": [1]})).n_head_kv == 1


def test_missing_required_key(tmp_path):
    gf = tiny_llama(tmp_path / "t.gguf", {"block_count": None})
    with pytest.raises(GGUFError, match="required key 'llama.block_count' is missing"):
        load_config(gf)


def test_huge_layer_count_fails_fast(tmp_path):
    gf = tiny_llama(tmp_path / "t.gguf", {"block_count": (1 << 31) - 1})
    with pytest.raises(GGUFError, match=f"n_layers = {(1 << 31) - 1}, but the file has only 11 tensors"):
        load_config(gf)


def test_missing_tensor_is_named(tmp_path):
    gf = tiny_llama(tmp_path / "t.gguf", tensors={"blk.0.ffn_up.weight": None})
    with pytest.raises(GGUFError, match="missing tensors: blk.0.ffn_up.weight"):
        load_config(gf)


def test_tensors_beyond_the_block_count_are_refused(tmp_path):
    """A damaged block_count (1 here, 2 layers stored) is refused instead of running one layer."""
    second = {name.replace("blk.0.", "blk.1."): shape for name, shape in TINY_TENSORS.items() if name.startswith("blk.0.")}
    gf = tiny_llama(tmp_path / "t.gguf", tensors=second)
    with pytest.raises(GGUFError, match=r"tensors blk.1.attn_norm.weight, .* and 4 more are not part of a "
                                        r"1-layer llama model; .*is the block count right"):
        load_config(gf)


@pytest.mark.parametrize("name", ["blk.0.attn_sinks.weight", "blk.00.attn_q.weight", "extra.weight"])
def test_unknown_tensors_are_refused(tmp_path, name):
    gf = tiny_llama(tmp_path / "t.gguf", tensors={name: (8,)})
    with pytest.raises(GGUFError, match=f"tensors {name} are not part of a 1-layer llama model"):
        load_config(gf)


def test_optional_layer_tensor_in_some_layers_only_is_refused(tmp_path):
    from airframe.synthetic import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "q.gguf", "qwen2", "tiny")
    with GGUFFile(path) as gf:
        assert load_config(gf).qkv_bias
    data = bytearray(path.read_bytes())
    name_at = data.index(b"blk.1.attn_q.bias")
    data[name_at:name_at + 17] = b"blk.1.attn_q.biaz"  # the same length: only the name changes
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="attn_q.bias is in 1 of 2 layers, expected every layer or none; "
                                        "missing: blk.1.attn_q.bias"):
        load_config(GGUFFile(path))


def test_integer_tensors_are_refused(tmp_path):
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for key, value in TINY.items():
        w.add_uint64(f"llama.{key}", value)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(5)])
    for name, shape in TINY_TENSORS.items():
        w.add_tensor(name, np.zeros(shape, np.int32 if name == "output_norm.weight" else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="tensor 'output_norm.weight' has type I32, expected a float or quantized type"):
        load_config(GGUFFile(tmp_path / "t.gguf"))


@pytest.mark.parametrize("name, shape, expected", [
    ("blk.0.attn_k.weight", (8, 8), "[n_embd, n_head_kv * head_dim] = [8, 4]"),
    ("token_embd.weight", (6, 8), "[n_embd, vocab_size] = [8, 5]"),
    ("blk.0.ffn_down.weight", (16, 8), "[n_ff, n_embd] = [16, 8]"),
    ("output_norm.weight", (9,), "[n_embd] = [8]"),
])
def test_tensor_shape_must_match_hyperparameters(tmp_path, name, shape, expected):
    gf = tiny_llama(tmp_path / "t.gguf", tensors={name: shape})
    with pytest.raises(GGUFError) as info:
        load_config(gf)
    found = list(reversed(shape))
    assert f"tensor {name!r} has shape {found}, expected {expected}" in str(info.value)


def test_every_family_tensor_has_a_known_shape():
    for fam in families_by_name().values():
        for name in fam.global_tensors + fam.global_optional + fam.layer_tensors + fam.layer_optional:
            assert name in TENSOR_SHAPES, f"{fam.name}: {name} has no expected shape"


def test_every_hyperparameter_has_a_type():
    """The loader checks each value by its type and synthetic.py writes its key with it."""
    for fam in families_by_name().values():
        for name in fam.hparams:
            assert name in INT_HPARAMS + FLOAT_HPARAMS + CAP_HPARAMS, f"{fam.name}: {name} has no type"


def test_fused_shapes_of_phi3():
    hp = {"n_embd": 8, "n_ff": 16, "n_head": 2, "n_head_kv": 1, "head_dim": 4, "head_dim_v": 4}
    shapes = tensor_shapes(families_by_name()["phi3"])
    assert shape_of(shapes["ffn_up.weight"], hp) == (8, 32)
    assert shape_of(shapes["attn_qkv.weight"], hp) == (8, 16)
    assert shape_of(tensor_shapes(family_for("llama"))["ffn_up.weight"], hp) == (8, 16)


def test_misspelt_hyperparameter_field_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('architectures = ["bad"]\n[hparams]\nn_layers = { key = "block_count", typcial = 2 }\n')
    with pytest.raises(ValueError, match=r"bad.toml: hparam n_layers = .*typcial.*no fields but key, default, typical"):
        _parse_family(path)
