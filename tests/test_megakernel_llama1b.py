"""The megakernel on the Llama 3.2 1B shape: all 16 layers, 128,256-entry vocabulary.

A synthetic BF16 file (random weights, `fast`: every layer repeats layer 0's values) is planned
for the RTX 3050 with a 4-position cache cut into two 2-position chunks, so positions 0..3 cross
from one attention chunk to two. BF16 weights are the same bits in the package and in the
reference, so only summation order differs. (The VM takes ~6 s per position on this shape.)
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from airframe.cli import main
from airframe.family import load_config
from airframe.gguf_file import GGUFFile
from airframe.megakernel.plan.package import write_package
from airframe.megakernel.plan.target import load_target
from airframe.megakernel.plan.vm import VM, bf16_to_f32
from airframe.reference import ReferenceBackend, ReferenceModel
from airframe.synthetic import write_synthetic_gguf

TOKENS = [1, 500, 128000, 77]
LOGIT_TOLERANCE = 1e-3


class UncachedReferenceModel(ReferenceModel):
    """Dequantizes each layer when it is used: a forward over all positions needs each layer once,
    and 16 float32 layers (4 GB) never sit in memory together."""

    def __init__(self, gf, config):
        gf.dequantize = lambda name: _bf16_tensor(gf, name)
        super().__init__(gf, config)

    def layer(self, i):
        return {name.removesuffix(".weight"): self.gf.dequantize(f"blk.{i}.{name}")
                for name in self.config.layer_tensors}


def _bf16_tensor(gf, name):
    """BF16 widened to float32 (exact, as gguf's dequantizer does, 10x faster); F32 as stored."""
    info = gf.tensor(name)
    raw = gf.raw(name)
    values = raw.view(np.float32) if info.qtype == GGMLQuantizationType.F32 else bf16_to_f32(raw.view(np.uint16))
    return values.reshape(tuple(reversed(info.shape)))


@pytest.fixture(scope="module")
def llama1b_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama1b") / "llama3.2-1b-bf16.gguf"
    return write_synthetic_gguf(path, "llama", "llama3.2-1b", "BF16", fast=True)


def test_vm_matches_the_reference_across_the_chunk_boundary(llama1b_path, tmp_path):
    package = write_package(llama1b_path, load_target("rtx3050"), tmp_path / "pkg", ctx=4, progress=False)
    k = package.plan.consts
    assert (k["n_layers"], k["vocab"], k["attn_chunk"], k["attn_chunks"]) == (16, 128256, 2, 2)
    vm = VM(package.plan, package.weights)
    got = vm.forward(TOKENS, all_logits=True)
    gf = GGUFFile(llama1b_path)
    want = ReferenceBackend(UncachedReferenceModel(gf, load_config(gf)), 4).forward(TOKENS, all_logits=True)
    assert np.abs(got - want).max() < LOGIT_TOLERANCE
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))


def test_h200_split_plan_matches_the_reference(llama1b_path, tmp_path):
    """Split-K QKV/WO pieces and shared FFN rows (132 workers) on the full 1B shape, 2 positions."""
    package = write_package(llama1b_path, load_target("h200"), tmp_path / "pkg", ctx=4, progress=False, split=True)
    assert package.plan.tasks["side"].any() and package.plan.consts["ffn_parts"] == 164
    got = VM(package.plan, package.weights).forward(TOKENS[:2], all_logits=True)
    gf = GGUFFile(llama1b_path)
    want = ReferenceBackend(UncachedReferenceModel(gf, load_config(gf)), 4).forward(TOKENS[:2], all_logits=True)
    assert np.abs(got - want).max() < LOGIT_TOLERANCE
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))


@pytest.mark.parametrize("target,workers,waves", [("rtx3050", 20, 83), ("h200", 132, 83)])
def test_stats_command_on_both_targets(llama1b_path, capsys, target, workers, waves):
    assert main(["megakernel", "stats", str(llama1b_path), "--target", target, "--ctx", "4096"]) == 0
    out = capsys.readouterr().out
    assert f"{workers} workers, ctx 4096" in out
    assert f"waves {waves}," in out
    for wave in ("embed", "L0.qkv", "L0.attn", "L0.wo", "L0.ffn", "L0.ffn_reduce", "final_norm", "lm_head"):
        assert f"\n{wave} " in out
