"""load_wgsl: includes resolved once each, placeholders filled, and clear errors."""

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
    text = shaders.load_wgsl("gemv.wgsl", {"QUANT": "q4_0", "REDUCE": "subgroup", "GEMV_UNIT": "generic",
                                           "GEMV_ROWS_WG": "8", "GEMV_TOKENS": "1", "GEMV_SUBGROUPS": "8"})
    assert "fn dq4(" in text and "subgroupAdd" in text and "{" + "QUANT}" not in text


def test_a_default_fills_the_placeholders_defines_lack(shader_dir):
    (shader_dir / "main.wgsl").write_text("const N: u32 = {ROWS}u;\nconst M: u32 = {COLS}u;\n")
    text = shaders.load_wgsl("main.wgsl", {"ROWS": "4"}, default=lambda name: "7")
    assert "N: u32 = 4u" in text and "M: u32 = 7u" in text
