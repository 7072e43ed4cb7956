"""load_wgsl: includes resolved once each, placeholders filled, and clear errors; and a rule every
shader keeps: a var inside a block has an initializer."""

import re

import pytest

from airframe.errors import AirframeError
from airframe.gpu import shaders


@pytest.fixture
def shader_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shaders, "data_dir", lambda name: tmp_path)
    shaders._read.cache_clear()
    yield tmp_path
    shaders._read.cache_clear()


def test_includes_once_and_placeholders(shader_dir):
    (shader_dir / "quant").mkdir()
    (shader_dir / "quant" / "q8_0.wgsl").write_text('#include "common.wgsl"\nfn dq4() {}\n')
    (shader_dir / "common.wgsl").write_text("const C: u32 = {WG}u;\n")
    (shader_dir / "main.wgsl").write_text('#include "common.wgsl"\n#include "quant/{QUANT}.wgsl"\nfn main() {}\n')
    text = shaders.load_wgsl("main.wgsl", {"QUANT": "q8_0", "WG": "64"})
    assert text.count("const C: u32 = 64u;") == 1
    assert "fn dq4() {}" in text and "fn main() {}" in text and "#include" not in text


def test_missing_placeholder_names_it(shader_dir):
    (shader_dir / "main.wgsl").write_text("const N: u32 = {ROWS}u;\n")
    with pytest.raises(AirframeError, match=r"placeholder \{ROWS\} has no value"):
        shaders.load_wgsl("main.wgsl", {})


def test_missing_include_names_the_file(shader_dir):
    (shader_dir / "main.wgsl").write_text('#include "nowhere.wgsl"\n')
    with pytest.raises(AirframeError, match="shader 'nowhere.wgsl' not found"):
        shaders.load_wgsl("main.wgsl")


def test_real_shaders_load_for_every_variant():
    text = shaders.load_wgsl("gemv.wgsl", {"QUANT": "q4_0", "REDUCE": "subgroup", "GEMV_UNIT": "q4_0",
                                           "GEMV_ROWS_WG": "8", "GEMV_TOKENS": "1", "GEMV_SUBGROUPS": "8",
                                           "GEMV_STAGE_X": "0", "GEMV_XBLOCKS": "1", "GEMV_MODE": "0",
                                           "GEMV_ROUND_FLOATS": "1", "GEMV_SPLIT_QUADS": "2"})
    assert "fn block_dot(" in text and "subgroupAdd" in text and "{" + "QUANT}" not in text


def test_a_default_fills_the_placeholders_defines_lack(shader_dir):
    (shader_dir / "main.wgsl").write_text("const N: u32 = {ROWS}u;\nconst M: u32 = {COLS}u;\n")
    text = shaders.load_wgsl("main.wgsl", {"ROWS": "4"}, default=lambda name: "7")
    assert "N: u32 = 4u" in text and "M: u32 = 7u" in text


def uninitialized_block_vars(text: str) -> list[str]:
    """`var name: T;` lines inside a block of a function (brace depth 2 or more): a loop body's
    such var keeps its value from one iteration to the next in wgpu 0.32's naga (gfx-rs/wgpu#9489),
    where WGSL makes it zero each time, so the shaders give every such var an initializer."""
    found, depth = [], 0
    for line in text.splitlines():
        code = line.split("//")[0]
        if depth >= 2 and re.match(r"\s*var\s+\w+\s*:[^=]*;", code):
            found.append(line.strip())
        depth += code.count("{") - code.count("}")
    return found


def test_uninitialized_block_vars_are_found():
    text = "fn f() {\n    var a: u32;\n    for (;;) {\n        var s: S;\n        var t = S();\n    }\n}\n"
    assert uninitialized_block_vars(text) == ["var s: S;"]


def test_no_shader_declares_a_block_var_without_an_initializer():
    root = shaders.data_dir("shaders")
    found = {str(p.relative_to(root)): uninitialized_block_vars(p.read_text()) for p in sorted(root.rglob("*.wgsl"))}
    assert len(found) > 40 and "gemv.wgsl" in found
    assert {name: lines for name, lines in found.items() if lines} == {}
