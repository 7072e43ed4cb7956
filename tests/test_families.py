"""Every family people run, at tiny size: HF transformers, the numpy reference and the WebGPU backend
on the same synthetic GGUF file (random weights, SmolLM2's tokenizer metadata, real tensor names and
keys) agree on the logits of every position.

transformers loads the GGUF itself (its GGUF loader supports llama, mistral, qwen2, qwen3, phi3,
gemma2 and gemma3) and runs its own modeling code: an implementation nobody here wrote. Where its
GGUF loader does not read a value the file holds, the test passes that value as a config override,
read from the file through our loader and named here:
  qwen3   head_dim (attention.key_length is not mapped; Qwen3Config's default is 128)
  gemma*  query_pre_attn_scalar = head_dim (the default 256 is the real models' head_dim; llama.cpp
          scales queries by 1/sqrt(head_dim))
  gemma2  attn_logit_softcapping, final_logit_softcapping (the *_softcapping keys are not mapped)
  phi3    sliding_window (attention.sliding_window is not mapped for phi3)
  llama3  rope_parameters (the loader ignores rope_freqs.weight; Meta's llama3 rope type recomputes it)
Mistral: the loader only picks MistralForCausalLM when general.name contains "mistral", so the Llama
model it loads is copied into a MistralForCausalLM built from the same config values.

Tolerance: all three compute in float32 from the same dequantized weights. Measured on 32 positions
(logits up to ~0.8): |reference - transformers| <= 4.5e-7, |webgpu - transformers| <= 5.5e-7, and
|webgpu - reference| <= 3.1e-6 over every quant type. The bound, 2e-5, is 6x the largest of those;
turning off one family switch (a bias, a norm, a cap, the window) moves the logits by 0.25 to 1.5
(test_each_switch_matters asserts >= 1e-3).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from airframe.gpu.backend import WebGPUBackend
from airframe.model import open_model
from airframe.options import RunOptions
from airframe.reference import ReferenceBackend, ReferenceModel
from airframe.rope_scaling import RopeScaling
from airframe.synthetic import write_synthetic_gguf
from hf_rope import hf_rope_parameters
from airframe.tokenizer import load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("CI"):  # scripts/test.sh installs them: missing there is a failure, not a skip
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="pip install -r scripts/requirements-hf.txt")
    transformers = pytest.importorskip("transformers", reason="pip install -r scripts/requirements-hf.txt")

pytestmark = pytest.mark.hf

N_TOKENS = 32
PREFILL = 24          # the WebGPU backend prefills this many, then decodes the rest one by one
MAX_DIFF = 2e-5
MIN_SWITCH_EFFECT = 1e-3
TEXT = (Path(__file__).parent / "data" / "english.txt").read_text()[:2000]


@dataclasses.dataclass(frozen=True)
class Case:
    family: str                      # synthetic family (= family file)
    shape: dict                      # overrides of the "tiny" preset
    rope_scaling: RopeScaling | None = None


CASES = {
    "llama": Case("llama", {}),
    "tinyllama": Case("llama", {"n_head": 8, "n_head_kv": 2, "head_dim": 8}),   # 4 query heads per K/V head
    "llama3.2": Case("llama", {"tied_embeddings": True, "ctx_train": 256},
                     RopeScaling("llama3", 8.0, 16)),                            # rope_freqs.weight
    "mistral": Case("llama", {"n_head_kv": 1}),
    "qwen2": Case("qwen2", {}),
    "qwen3": Case("qwen3", {"head_dim": 32}),                                  # head_dim != n_embd / n_head
    "phi3": Case("phi3", {"n_head_kv": 4, "sliding_window": 8}),               # no GQA; every layer local
    "gemma2": Case("gemma2", {"tied_embeddings": True, "sliding_window": 8,
                              "attn_logit_softcap": 0.05, "final_logit_softcap": 0.5}),  # caps small enough to bite
    "gemma3": Case("gemma3", {"tied_embeddings": True, "sliding_window": 8}),
}


def hf_overrides(name: str, config) -> dict:
    """Config values the GGUF loader of transformers does not read from this file (module docstring)."""
    out = {}
    if config.family == "qwen3":
        out["head_dim"] = config.head_dim
    if config.family.startswith("gemma"):
        out["query_pre_attn_scalar"] = config.head_dim
    if config.family == "phi3":
        out["sliding_window"] = config.sliding_window
    if config.family == "gemma2":
        out["attn_logit_softcapping"] = config.attn_logit_softcap
        out["final_logit_softcapping"] = config.final_logit_softcap
    scaling = CASES[name].rope_scaling
    if scaling is not None:
        out["rope_parameters"] = hf_rope_parameters(scaling, config.rope_base)
    return out


def hf_model(path: Path, overrides: dict, as_mistral: bool = False):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **overrides).eval()
    if not as_mistral:
        return model
    c = model.config
    config = transformers.MistralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, rope_parameters=dict(c.rope_parameters),
        tie_word_embeddings=c.tie_word_embeddings, sliding_window=None)
    mistral = transformers.MistralForCausalLM(config).eval()
    mistral.load_state_dict(model.state_dict())
    return mistral


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


class Compared:
    """One case's file, token ids and the logits of the three implementations."""

    def __init__(self, name: str, folder: Path):
        case = CASES[name]
        self.path = write_synthetic_gguf(folder / f"{name}.gguf", case.family, {"preset": "tiny", **case.shape},
                                         "Q8_0", seed=11, rope_scaling=case.rope_scaling)
        opened = open_model(self.path)
        self.tokens = load_tokenizer(opened.gguf).encode(TEXT)[:N_TOKENS]
        assert len(self.tokens) == N_TOKENS
        self.reference = ReferenceBackend.load(opened, RunOptions(n_ctx=N_TOKENS))
        self.config = self.reference.config
        self.ours = self.reference.forward(self.tokens, all_logits=True)
        torch.set_num_threads(os.cpu_count() or 1)
        model = hf_model(self.path, hf_overrides(name, self.config), as_mistral=name == "mistral")
        self.hf_class = type(model).__name__
        self.theirs = hf_logits(model, self.tokens)
        gpu = WebGPUBackend.load(opened, RunOptions(n_ctx=N_TOKENS))
        prefill = gpu.forward(self.tokens[:PREFILL], all_logits=True)
        decode = [gpu.forward([t]) for t in self.tokens[PREFILL:]]
        self.gpu = np.concatenate([prefill, np.stack(decode)])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module", params=sorted(CASES))
def compared(request, folder) -> Compared:
    return Compared(request.param, folder)


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[float, np.ndarray]:
    return float(np.abs(a - b).max()), a.argmax(-1) == b.argmax(-1)


def test_reference_agrees_with_transformers(compared):
    assert compared.ours.shape == compared.theirs.shape == (N_TOKENS, compared.config.vocab_size)
    diff, same_top1 = agreement(compared.ours, compared.theirs)
    print(f"\n{compared.path.stem} ({compared.hf_class}): max |reference - transformers| {diff:.2e}")
    assert diff <= MAX_DIFF
    assert same_top1.all()


def test_webgpu_agrees_with_transformers_and_reference(compared):
    diff_hf, top1_hf = agreement(compared.gpu, compared.theirs)
    diff_ref, top1_ref = agreement(compared.gpu, compared.ours)
    print(f"\n{compared.path.stem}: max |webgpu - transformers| {diff_hf:.2e}, |webgpu - reference| {diff_ref:.2e}")
    assert diff_hf <= MAX_DIFF and diff_ref <= MAX_DIFF
    assert top1_hf.all() and top1_ref.all()


def test_the_family_file_was_used(compared):
    """Each case runs the family (and transformers class) it is meant to."""
    expected = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "gemma3": "Gemma3ForCausalLM"}
    name = compared.path.stem
    assert compared.hf_class == expected.get(name, "LlamaForCausalLM")
    assert compared.config.family == CASES[name].family


# ---- each switch matters: turning it off moves the logits far beyond the tolerance -----------------
def _without(config, name: str):
    if name == "qkv_bias":
        return dataclasses.replace(config, layer_tensors=tuple(t for t in config.layer_tensors if ".bias" not in t))
    if name.endswith("softcap"):
        return dataclasses.replace(config, **{name: 0.0})
    if name == "sliding_window":
        return dataclasses.replace(config, sliding_window=0)
    return dataclasses.replace(config, **{name: False})


@pytest.mark.parametrize("case, switch", [("qwen2", "qkv_bias"), ("qwen3", "qk_norm"), ("gemma2", "attn_logit_softcap"),
                                          ("gemma2", "final_logit_softcap"), ("gemma2", "sliding_window"),
                                          ("gemma3", "post_norms"), ("phi3", "sliding_window")])
def test_each_switch_matters(folder, case, switch):
    spec = CASES[case]
    path = write_synthetic_gguf(folder / f"switch-{case}.gguf", spec.family, {"preset": "tiny", **spec.shape},
                                "F32", seed=11)
    right = ReferenceBackend.load(open_model(path), RunOptions(n_ctx=N_TOKENS))
    tokens = load_tokenizer(right.model.gf).encode(TEXT)[:N_TOKENS]
    model = ReferenceModel(right.model.gf, _without(right.config, switch))
    wrong = ReferenceBackend(model, N_TOKENS)
    diff = np.abs(right.forward(tokens, all_logits=True) - wrong.forward(tokens, all_logits=True)).max()
    assert diff >= MIN_SWITCH_EFFECT


def test_families_load_in_every_quant_type_on_webgpu(folder):
    """The families this file added, in each quant type the GPU reads (llama and gemma3 are covered
    by test_gpu_runtime.py): webgpu matches the reference (teacher-forced, 16 positions) within the
    same bound."""
    tokens = list(range(1, 17))
    for family, shape in [("qwen2", {}), ("qwen3", {}), ("phi3", {"sliding_window": 8}),
                          ("gemma2", {"tied_embeddings": True, "sliding_window": 8})]:
        for qtype in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"):
            preset = "tiny256" if "K" in qtype else "tiny"
            path = write_synthetic_gguf(folder / f"{family}-{qtype}.gguf", family, {"preset": preset, **shape},
                                        qtype, seed=2)
            model = open_model(path)
            want = ReferenceBackend.load(model, RunOptions(n_ctx=16)).forward(tokens, all_logits=True)
            got = WebGPUBackend.load(model, RunOptions(n_ctx=16)).forward(tokens, all_logits=True)
            assert np.abs(got - want).max() <= MAX_DIFF, (family, qtype)
            assert (got.argmax(-1) == want.argmax(-1)).all(), (family, qtype)
