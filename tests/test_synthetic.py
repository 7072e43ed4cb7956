"""Synthetic GGUF files: the loader and gguf's own reader accept them, and they hold what was meant."""

import numpy as np
import pytest
import tokenizers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, TokenType

from airframe.errors import ParameterError
from airframe import family as family_module
from airframe.family import families_by_name, load_config
from airframe.gguf_file import GGUFFile
from airframe.model import open_model
from airframe.models import resolve_model
from airframe.options import RunOptions
from airframe.quants import SUPPORTED
from airframe.reference import ReferenceBackend
from airframe.resources import family_dir
from airframe.synthetic import (encode_tensor, hparam_metadata, plan_tensors, resolve_shape, tensor_values,
                                tokenizer_metadata, write_synthetic_gguf)
from scripts_loader import load_script

QTYPES = [t.name for t in SUPPORTED] + ["Q4_K_M", "Q5_K_M"]
FAMILIES = sorted(families_by_name())

# Largest dequantization error allowed, relative to the largest |value| of the tensor: the
# per-block bounds of tests/test_quantize.py, taken at their worst (range = 2 * amax).
RELATIVE_TOLERANCE = {
    Q.F32: 0.0, Q.F16: 2.0 ** -11, Q.BF16: 2.0 ** -8, Q.Q8_0: 0.57 / 127,
    Q.Q4_0: 1.01 / 8, Q.Q5_0: 1.01 / 16, Q.Q4_1: 1.01 / 15, Q.Q5_1: 1.01 / 31,
    Q.Q4_K: 1.05 / 15, Q.Q5_K: 1.05 / 31, Q.Q6_K: 0.52 / 31,
}


def shape_for(qtype: str) -> str:
    return "tiny256" if "K" in qtype else "tiny"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(family, qtype) -> path of a tiny model, written once per module."""
    folder = tmp_path_factory.mktemp("synthetic")
    paths = {}
    for family in FAMILIES:
        for qtype in QTYPES:
            path = folder / f"{family}-{qtype}.gguf"
            paths[family, qtype] = write_synthetic_gguf(path, family, shape_for(qtype), qtype, seed=7)
    return paths


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_loader_accepts_and_values_match(written, family, qtype):
    gf = GGUFFile(written[family, qtype])
    config = load_config(gf)
    dims = resolve_shape(family, shape_for(qtype))
    assert (config.family, config.n_layers, config.n_embd, config.n_ff) == \
        (family, dims["n_layers"], dims["n_embd"], dims["n_ff"])
    assert (config.n_head, config.n_head_kv, config.head_dim) == (dims["n_head"], dims["n_head_kv"], dims["head_dim"])
    assert config.vocab_size == dims["vocab_size"] == len(gf.get("tokenizer.ggml.tokens"))
    assert config.tied_embeddings == dims["tied_embeddings"]
    plans = plan_tensors(family, dims, qtype)
    assert sorted(gf.tensors) == sorted(p.name for p in plans)
    for plan in plans:
        info = gf.tensor(plan.name)
        assert info.qtype == plan.qtype
        assert info.shape == tuple(reversed(plan.shape))
        meant = tensor_values(plan, seed=7)
        got = gf.dequantize(plan.name)
        assert got.shape == meant.shape
        allowed = RELATIVE_TOLERANCE[plan.qtype] * np.abs(meant).max() + 1e-7
        assert np.abs(got - meant).max() <= allowed, plan.name
    gf.close()


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K", "Q4_K_M"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_reader_reads_the_file(written, family, qtype):
    reader = GGUFReader(written[family, qtype])
    ours = GGUFFile(written[family, qtype])
    assert reader.fields["general.architecture"].contents() == families_by_name()[family].architectures[0]
    assert {t.name: (Q(t.tensor_type), tuple(int(d) for d in t.shape)) for t in reader.tensors} == \
        {t.name: (t.qtype, t.shape) for t in ours.tensors.values()}
    name = "blk.1.ffn_down.weight"
    theirs = next(t for t in reader.tensors if t.name == name).data
    np.testing.assert_array_equal(np.ascontiguousarray(theirs).view(np.uint8).reshape(ours.raw(name).shape),
                                  ours.raw(name))


def test_written_bytes_are_the_encoding_of_the_values(written):
    gf = GGUFFile(written["llama", "Q4_K_M"])
    for plan in plan_tensors("llama", resolve_shape("llama", "tiny256"), "Q4_K_M"):
        np.testing.assert_array_equal(gf.raw(plan.name), encode_tensor(plan, seed=7).reshape(gf.raw(plan.name).shape))


def test_norms_are_near_one_and_matrices_small():
    dims = resolve_shape("gemma3", "tiny")
    for plan in plan_tensors("gemma3", dims, "F32"):
        values = tensor_values(plan, seed=1)
        if plan.is_norm:
            assert plan.qtype == Q.F32 and len(plan.shape) == 1
            assert abs(values.mean() - 1) < 0.02 and values.std() < 0.05
        else:
            assert abs(values.std() - 0.02) < 0.005


def test_q4_k_m_mix_matches_the_real_gemma3_file():
    """llama.cpp's Q4_K_M rules with its fallbacks reproduce every type and shape of the real file."""
    real = GGUFFile(resolve_model("gemma3-270m"))
    plans = plan_tensors("gemma3", resolve_shape("gemma3", "gemma3-270m"), "Q4_K_M")
    assert {p.name: (p.qtype, tuple(reversed(p.shape))) for p in plans} == \
        {t.name: (t.qtype, t.shape) for t in real.tensors.values()}
    real.close()


@pytest.mark.parametrize("family, model", [("llama", "smollm2-135m"), ("gemma3", "gemma3-270m")])
def test_hparams_match_the_real_file(family, model):
    real = GGUFFile(resolve_model(model))
    ours = hparam_metadata(family, resolve_shape(family, model))
    for key, value in real.metadata.items():
        if key.startswith(f"{real.architecture}."):
            assert key in ours, key
            assert ours[key][0] == pytest.approx(value, rel=1e-6), key
    real.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_file_is_a_synthetic_family(written, family):
    """The family file is all a synthetic model takes: it loads back with the file's keys, sizes,
    switches and tensors (the optional ones too)."""
    fam = families_by_name()[family]
    dims = resolve_shape(family, "tiny")
    gf = GGUFFile(written[family, "F32"])
    config = load_config(gf)
    assert (config.family, config.architecture) == (family, fam.architectures[0])
    assert {key for key in gf.metadata if key.startswith(f"{fam.prefix}.")} == \
        {f"{fam.prefix}.{spec['key']}" for spec in fam.hparams.values()}
    for name in fam.hparams:
        assert getattr(config, name) == pytest.approx(dims[name], rel=1e-6), name  # float32 in the file
    for name, value in fam.switches.items():
        if name not in fam.hparams:
            assert getattr(config, name) == value, name
    assert config.layer_tensors == fam.layer_tensors + fam.layer_optional
    assert set(fam.global_tensors) <= set(gf.tensors)
    assert config.tied_embeddings == dims["tied_embeddings"] == ("output.weight" not in gf.tensors)
    gf.close()


# A made-up family: Llama's keys under another prefix, Qwen 3's Q/K norms, Qwen 2's biases, GELU.
TOY_FAMILY = """
architectures = ["toy"]
prefix = "toylm"

[hparams]
n_layers = { key = "block_count" }
ctx_train = { key = "context_length", default = 1024, typical = 512 }
n_embd = { key = "embedding_length" }
n_ff = { key = "feed_forward_length" }
n_head = { key = "attention.head_count" }
n_head_kv = { key = "attention.head_count_kv", default = "n_head" }
head_dim = { key = "attention.key_length", default = "n_embd / n_head" }
head_dim_v = { key = "attention.value_length", default = "head_dim" }
rope_dim = { key = "rope.dimension_count", default = "head_dim" }
rope_base = { key = "rope.freq_base", default = 5000.0 }
rms_eps = { key = "attention.layer_norm_rms_epsilon", default = 1e-5 }
vocab_size = { key = "vocab_size", default = "tokens" }
%s

[tensors]
global = ["token_embd.weight", "output_norm.weight"]
global_optional = ["output.weight"]
layer = [
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
    "attn_q_norm.weight", "attn_k_norm.weight",
    "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
]
layer_optional = ["attn_q.bias", "attn_k.bias", "attn_v.bias"]

[switches]
rope_style = "neox"
activation = "gelu_tanh"
qk_norm = true
"""


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """family/ with one more file, family/toy.toml (TOY_FAMILY plus the hparam lines given)."""
    folder = tmp_path / "family"
    folder.mkdir()
    for path in family_dir().glob("*.toml"):
        (folder / path.name).write_text(path.read_text())

    def add(extra_hparams: str = "") -> None:
        (folder / "toy.toml").write_text(TOY_FAMILY % extra_hparams)
        family_module.families.cache_clear()

    monkeypatch.setattr(family_module, "family_dir", lambda: folder)
    yield add
    family_module.families.cache_clear()


def test_a_new_family_file_is_enough(tmp_path, toy_family):
    toy_family()
    path = write_synthetic_gguf(tmp_path / "toy.gguf", "toy", "tiny", "Q8_0")
    gf = GGUFFile(path)
    assert gf.architecture == "toy" and gf.get("toylm.context_length") == 512  # the typical value
    config = load_config(gf)
    assert (config.family, config.ctx_train, config.rope_base) == ("toy", 512, 5000.0)
    assert config.qk_norm and config.qkv_bias and config.activation == "gelu_tanh"
    assert "blk.1.attn_k_norm.weight" in gf.tensors and "blk.1.attn_v.bias" in gf.tensors
    logits = ReferenceBackend.load(open_model(path), RunOptions(n_ctx=4)).forward([1, 2, 3])
    assert logits.shape == (config.vocab_size,) and np.isfinite(logits).all()


def test_a_size_no_preset_gives_must_be_named(tmp_path, toy_family):
    toy_family('n_expert = { key = "expert_count" }')
    with pytest.raises(ParameterError, match="shape field n_expert is needed for toy"):
        resolve_shape("toy", "tiny")


def test_smollm2_shape_matches_the_real_file():
    real = GGUFFile(resolve_model("smollm2-135m"))
    plans = plan_tensors("llama", resolve_shape("llama", "smollm2-135m"), "Q8_0")
    assert {p.name: tuple(reversed(p.shape)) for p in plans} == {t.name: t.shape for t in real.tensors.values()}
    real.close()


def test_fast_mode_repeats_layer_zero(tmp_path):
    path = write_synthetic_gguf(tmp_path / "fast.gguf", "llama", {"preset": "tiny", "n_layers": 3},
                                "Q8_0", fast=True)
    gf = GGUFFile(path)
    assert "fast" in gf.get("general.name")
    assert load_config(gf).n_layers == 3
    for suffix in families_by_name()["llama"].layer_tensors:
        np.testing.assert_array_equal(gf.raw(f"blk.2.{suffix}"), gf.raw(f"blk.0.{suffix}"))
    assert not np.array_equal(gf.raw("blk.0.attn_q.weight"), gf.raw("blk.0.attn_k.weight"))


def test_seed_changes_values_and_dict_shape_overrides(tmp_path):
    a = write_synthetic_gguf(tmp_path / "a.gguf", "gemma3", {"n_layers": 1, "sliding_window": 64}, "F16", seed=1)
    b = write_synthetic_gguf(tmp_path / "b.gguf", "gemma3", {"n_layers": 1, "sliding_window": 64}, "F16", seed=2,
                             alignment=64)
    ga, gb = GGUFFile(a), GGUFFile(b)
    assert load_config(ga).sliding_window == 64 and load_config(ga).n_layers == 1
    assert gb.alignment == 64
    assert not np.array_equal(ga.raw("token_embd.weight"), gb.raw("token_embd.weight"))


def test_truncated_tokenizer_is_consistent():
    meta = tokenizer_metadata(400)
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == len(meta["tokenizer.ggml.token_type"]) == 400
    known = set(tokens)
    assert meta["tokenizer.ggml.merges"], "some merges survive"
    for merge in meta["tokenizer.ggml.merges"]:
        left, right = merge.split(" ")
        assert left in known and right in known and left + right in known
    bpe = tokenizers.models.BPE({t: i for i, t in enumerate(tokens)},
                                [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]])
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    ids = tok.encode("the cat is on the mat").ids
    assert ids and max(ids) < 400


def test_gemma_tokenizer_can_be_copied_and_cut(tmp_path):
    path = write_synthetic_gguf(tmp_path / "g.gguf", "gemma3", "tiny", "Q8_0", tokenizer="gemma3-270m", vocab=1000)
    gf = GGUFFile(path)
    assert load_config(gf).vocab_size == 1000
    assert gf.get("tokenizer.ggml.model") == "llama"
    assert len(gf.get("tokenizer.ggml.scores")) == len(gf.get("tokenizer.ggml.token_type")) == 1000
    real = tokenizer_metadata(source="gemma3-270m")
    assert gf.get("tokenizer.ggml.tokens") == real["tokenizer.ggml.tokens"][:1000]


def test_padded_tokenizer_for_llama3_vocab():
    meta = tokenizer_metadata(128256)
    full = tokenizer_metadata()
    assert len(meta["tokenizer.ggml.tokens"]) == 128256
    assert meta["tokenizer.ggml.tokens"][:49152] == full["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.tokens"][-1] == "[PAD128255]"
    assert np.all(meta["tokenizer.ggml.token_type"][49152:] == TokenType.UNUSED)
    assert meta["tokenizer.ggml.merges"] == full["tokenizer.ggml.merges"]


def test_bad_requests_name_what_was_expected(tmp_path):
    with pytest.raises(ParameterError, match="family 'qwen9'"):
        write_synthetic_gguf(tmp_path / "x.gguf", "qwen9")
    with pytest.raises(ParameterError, match="preset 'huge'"):
        resolve_shape("llama", "huge")
    with pytest.raises(ParameterError, match="n_layer"):
        resolve_shape("llama", {"n_layer": 3})
    with pytest.raises(ParameterError, match=r"\['sliding_window'\] are unknown for llama"):
        resolve_shape("llama", {"sliding_window": 8})  # llama.toml has no key for a window
    with pytest.raises(ParameterError, match="not a multiple of 3 K/V heads"):
        resolve_shape("llama", {"n_head": 4, "n_head_kv": 3})
    with pytest.raises(ParameterError, match="Q3_K"):
        write_synthetic_gguf(tmp_path / "x.gguf", "llama", "tiny", "Q3_K")
    with pytest.raises(ParameterError, match="does not exist"):
        write_synthetic_gguf(tmp_path / "missing" / "x.gguf")
    with pytest.raises(ParameterError, match="expected at least 3"):
        write_synthetic_gguf(tmp_path / "x.gguf", vocab=2)
    assert list(tmp_path.iterdir()) == [], "a failed write leaves no file behind"
    with pytest.raises(ParameterError, match="seed = -1"):
        write_synthetic_gguf(tmp_path / "x.gguf", "llama", "tiny", "Q8_0", seed=-1)
    with pytest.raises(ParameterError, match="expected at least 3"):
        tokenizer_metadata(2)


def test_script_writes_a_loadable_file(tmp_path):
    module = load_script("make_synthetic_gguf")
    out = tmp_path / "cli.gguf"
    assert module.main(["--family", "gemma3", "--shape", "tiny", "--qtype", "Q5_0", "-o", str(out),
                        "--vocab", "300", "--seed", "3"]) == 0
    config = load_config(GGUFFile(out))
    assert config.vocab_size == 300 and config.family == "gemma3"
    assert module.main(["--qtype", "Q9_9", "-o", str(tmp_path / "bad.gguf")]) == 2
