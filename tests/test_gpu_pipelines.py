"""What the Python side knows of each shader comes from the shader (airframe/gpu/pipelines.py): its
binding kinds and its Params fields are read from the WGSL. Every variant of a program (each quant
type, each gemv unit, each reduction, each tile) must have the signature read from the generic one,
every program must compile on this adapter, and Params must pack as the WGSL lays it out."""

import re
import struct

import pytest

from airframe.gpu import pipelines as pl
from airframe.gpu.layer import MIXED_UNITS
from airframe.gpu.device import get_context
from airframe.gpu.shaders import load_wgsl
from airframe.quants import SUPPORTED, quant
from airframe.resources import data_dir

PROGRAMS = sorted(p.stem for p in data_dir("shaders").glob("*.wgsl") if "fn main(" in p.read_text())
MATMULS = ("gemv", "gemm", "gemm_rows")
SHAPE = {"ATTN_GROUP": 4, "ATTN_HEAD_DIM": 64, "ATTN_BLOCK": 128, "ATTN_KEYS": 32,
         "GEMV_ROWS_WG": 8, "GEMV_TOKENS": 1, "GEMV_SUBGROUPS": 8, "GEMV_STAGE_X": 1, "GEMV_XBLOCKS": 16, "GEMV_ROUND_FLOATS": 8, "GEMV_SPLIT_QUADS": 2, "ARGMAX_STAGE": 1, "CANDIDATES_STAGE": 1,
         "ROWS_TOKENS": 8,
         # every mode bit, so that every fusion's code is compiled (gemv.wgsl drops the ones its MODE lacks)
         "GEMV_MODE": pl.MODE_NORM | pl.MODE_ACCUMULATE | pl.MODE_GATED | pl.MODE_GELU | pl.MODE_X_STEP
                      | pl.MODE_ROUND_OUT}


def variants(program):
    """(quant or None, placeholders) of every variant of a program that the runtime builds."""
    text = (data_dir("shaders") / f"{program}.wgsl").read_text()
    if "{QUANT}" in text or "{GEMV_UNIT}" in text:
        for qtype in SUPPORTED:
            q = quant(qtype)
            yield q, {**SHAPE, "GEMV_UNIT": q.shader}
        if "{GEMV_UNIT}" in text:  # the units that take two types in one dispatch (layer.MIXED_UNITS)
            for (first, _), unit in MIXED_UNITS.items():
                yield next(quant(t) for t in SUPPORTED if quant(t).shader == first), {**SHAPE, "GEMV_UNIT": unit}
    else:
        yield None, SHAPE


def test_every_program_is_found():
    assert {"gemv", "gemm", "gemm_rows", "attention_decode", "attention_prefill", "rope",
            "rmsnorm", "embedding", "argmax", "stream_read", "dequant", "split_sum"} <= set(PROGRAMS)


# dequant.wgsl takes its decoder file as a placeholder and builds its own pipelines: tests/test_dequant.py
# and tests/test_gpu_quant_decoders.py run it for every type
@pytest.mark.parametrize("program", [p for p in PROGRAMS if p != "dequant"])
@pytest.mark.parametrize("reduce", ["subgroup", "shared"])
def test_every_variant_has_the_signature_and_compiles(program, reduce):
    want = pl.signature(program)
    pipes = pl.Pipelines(get_context(), matmul="tiled", reduce=reduce)
    for q, shape in variants(program):
        source = load_wgsl(f"{program}.wgsl", {**{k: str(v) for k, v in shape.items()}, "REDUCE": reduce,
                                               "QUANT": q.shader if q else "f32", "HALF": "f16"})
        assert pl.read_signature(source) == want, (program, q and q.name)
        pipes.pipeline(program, q, shape)  # compiles on this adapter


def test_the_matmul_programs_share_one_layout():
    """One bind group serves gemv, gemm and gemm_rows: the same binding kinds and Params."""
    assert len({pl.signature(p) for p in MATMULS}) == 1


def test_pack_params_follows_the_wgsl():
    fields = pl.signature("rmsnorm").params
    assert fields == (("n", "u32"), ("norm_w", "u32"), ("eps", "f32"), ("add", "u32"), ("x_stride", "u32"),
                      ("y_stride", "u32"), ("splits", "u32"))
    packed = pl.pack_params("rmsnorm", n=576, norm_w=64, eps=1e-6, add=1, x_stride=576, y_stride=576, splits=0)
    assert len(packed) == 32 and struct.unpack("<IIfIII", packed[:24])[:2] == (576, 64)
    with pytest.raises(AssertionError, match="unknown {'nope'}"):
        pl.pack_params("rmsnorm", n=1, norm_w=0, eps=0.0, add=0, x_stride=1, y_stride=1, splits=0, nope=2)
    with pytest.raises(AssertionError, match="missing {'y_stride'}"):
        pl.pack_params("rmsnorm", n=1, norm_w=0, eps=0.0, add=0, x_stride=1, splits=0)


def test_mode_bits_are_the_shaders():
    text = (data_dir("shaders") / "activation.wgsl").read_text()
    for name in ("MODE_NORM", "MODE_ACCUMULATE", "MODE_GATED", "MODE_GELU", "MODE_X_STEP"):
        value = int(re.search(rf"const {name}: u32 = (\d+)u;", text).group(1))
        assert getattr(pl, name) == value


def test_the_step_struct_is_what_pack_step_writes():
    text = (data_dir("shaders") / "step.wgsl").read_text()
    fields = re.findall(r"(\w+): u32,", re.search(r"struct Step \{(.*?)\}", text, re.S).group(1))
    assert fields == ["n_past", "n_tokens", "lm_first", "split_len"]
    assert struct.unpack("<4I", pl.pack_step(7, 3, 2, 64)) == (7, 3, 2, 64)
    assert len(pl.pack_step(0, 1)) == pl.STEP_BYTES


def test_gemv_units_declare_their_size():
    """decode_matmul reads UNIT from the unit file; every unit the registry names exists."""
    for qtype in SUPPORTED:
        q = quant(qtype)
        assert pl.shader_constant(f"gemv/{q.shader}.wgsl", "UNIT") in (16, 32)
