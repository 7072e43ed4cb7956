"""`airframe quant-verify`: the real models and the synthetic tensors pass, a broken decoder fails."""

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFWriter

from airframe import quant_verify
from airframe.cli import main, quant_verify_main
from airframe.gguf_file import GGUFFile
from airframe.quants import SUPPORTED
from airframe.models import resolve_model
from airframe.resources import shader_path

# The nibble choice of each decoder, and the same line reading the other nibble.
WRONG_NIBBLE = {
    T.Q4_0: ("let s = (i >> 2u) * 4u;", "let s = (1u - (i >> 2u)) * 4u;"),
    T.Q4_K: ("let s = ((i >> 3u) & 1u) * 4u;", "let s = (1u - ((i >> 3u) & 1u)) * 4u;"),
}


@pytest.fixture
def broken_decoder(tmp_path, monkeypatch):
    """Point AIRFRAME_QUANT_DECODER at a copy of a decoder that reads the wrong nibble."""
    def make(qtype):
        right, wrong = WRONG_NIBBLE[qtype]
        text = shader_path(f"quant/{qtype.name.lower()}.wgsl").read_text()
        assert right in text
        path = tmp_path / f"broken_{qtype.name.lower()}.wgsl"
        path.write_text(text.replace(right, wrong))
        monkeypatch.setenv("AIRFRAME_QUANT_DECODER", f"{qtype.name}={path}")
    return make


def run_json(capsys, *args):
    code = main(["quant-verify", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_synthetic_tensors_of_every_type_decode_exactly(capsys):
    code, report = run_json(capsys, "--rows", "8")
    assert code == 0 and report["ok"] and report["source"] == "synthetic"
    assert [t["qtype"] for t in report["types"]] == [q.name for q in SUPPORTED]
    for t in report["types"]:
        assert t["tensors"] == 2 and t["elements"] == 2 * 8 * quant_verify.SYNTHETIC_COLS
        assert t["exact_share"] == 1.0 and t["max_abs_error"] == 0.0


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_models_decode_exactly(capsys, name):
    code, report = run_json(capsys, name, "--rows", "4")
    assert code == 0 and report["ok"]
    gguf = GGUFFile(resolve_model(name))
    in_file = {t.qtype.name for t in gguf.tensors.values()}
    checked = {t["qtype"]: t for t in report["types"]}
    assert set(checked) == in_file
    assert sum(t["tensors"] for t in checked.values()) == len(gguf.tensors)
    assert all(t["mismatches"] == 0 and t["exact"] == t["elements"] > 0 for t in checked.values())


def test_table_names_every_type(capsys):
    assert quant_verify_main(["smollm2-135m", "--rows", "2", "-q"]) == 0
    out = capsys.readouterr().out
    for name in ("F32", "Q4_1", "Q8_0"):
        assert any(line.startswith(name) and line.endswith("ok") for line in out.splitlines())
    assert "all types decode exactly" in out


def test_broken_q4_0_decoder_fails_naming_the_type(capsys, broken_decoder):
    broken_decoder(T.Q4_0)
    code = main(["quant-verify", "--rows", "4", "-q"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAILED: Q4_0" in out
    q4_0 = next(line for line in out.splitlines() if line.startswith("Q4_0"))
    assert "FAIL" in q4_0 and "values differ" in q4_0
    assert all(line.endswith("ok") for line in out.splitlines() if line.startswith(("Q8_0", "Q4_K")))


def test_broken_q4_k_decoder_fails_on_the_real_model(capsys, broken_decoder):
    broken_decoder(T.Q4_K)
    code, report = run_json(capsys, "gemma3-270m", "--rows", "2")
    assert code == 1 and not report["ok"]
    failed = [t["qtype"] for t in report["types"] if not t["ok"]]
    assert failed == ["Q4_K"]
    q4_k = next(t for t in report["types"] if t["qtype"] == "Q4_K")
    assert q4_k["mismatches"] > 0 and q4_k["max_abs_error"] > 0


@pytest.mark.parametrize("args, message", [
    (["--rows", "0"], "at least 1 row"),
    (["no-such-model-xyz"], "no-such-model-xyz"),
])
def test_usage_errors_exit_2(capsys, args, message):
    assert main(["quant-verify", *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_decoder_hook_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("AIRFRAME_QUANT_DECODER", "Q9_9=/tmp/x.wgsl")
    assert main(["quant-verify"]) == 2
    assert "'Q9_9' is not a quant type" in capsys.readouterr().err


def test_full_mode_checks_every_row_in_windows(monkeypatch):
    monkeypatch.setattr(quant_verify, "FULL_WINDOW_VALUES", 3 * 256)  # 3 rows of 256 per window
    raw = quant_verify.random_bytes(T.Q6_K, 10, 256, np.random.default_rng(5))
    result = quant_verify.TypeResult("Q6_K")
    quant_verify.check_full(result, raw, T.Q6_K, None)
    assert result.elements == 10 * 256 and result.exact == result.elements and result.ok


def test_sample_rows_spreads_evenly_with_first_and_last():
    rows = quant_verify.sample_rows(1000, 5)
    assert rows.tolist() == [0, 250, 500, 749, 999]
    assert quant_verify.sample_rows(3, 64).tolist() == [0, 1, 2]
    assert quant_verify.sample_rows(7, 1).tolist() == [0]


def test_comparison_counts_nan_payloads_apart_and_nan_against_numbers_as_errors():
    want = np.array([1.0, np.nan, np.nan, 2.0, np.inf], dtype=np.float32)
    got = want.copy()
    got.view(np.uint32)[1] |= 1  # another NaN payload
    got[2] = 3.0  # a number where numpy has NaN
    got[3] = 2.5
    result = quant_verify.TypeResult("F32")
    result.add(got, want)
    assert (result.exact, result.nan_bit_differences, result.mismatches) == (2, 1, 2)
    assert result.max_abs_error == np.inf and not result.ok


def test_unsupported_type_in_a_model_fails(tmp_path, capsys):
    path = tmp_path / "q2k.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("norm.weight", np.ones(256, dtype=np.float32))
    q2_k = np.random.default_rng(6).integers(0, 256, size=(2, 84), dtype=np.uint8)
    writer.add_tensor("blk.0.ffn_down.weight", q2_k, raw_dtype=T.Q2_K)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    code, report = run_json(capsys, str(path))
    assert code == 1
    by_type = {t["qtype"]: t for t in report["types"]}
    assert by_type["F32"]["ok"] and not by_type["Q2_K"]["ok"]
    assert "Q2_K has no GPU decoder" in by_type["Q2_K"]["unsupported"]
