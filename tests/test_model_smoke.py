"""scripts/model_smoke_test.py as CI runs it: every verified model on WebGPU (lavapipe here), one
subprocess each, checked through the exit code and the result table; and that the smoke test
itself notices a wrong expectation and a file that is not a model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LARGE_MODELS
from scripts_loader import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "model_smoke_test.py"
GOLDEN = Path(__file__).resolve().parent / "data" / "golden"

smoke = load_script("model_smoke_test")


def run_smoke(*args: str, timeout: int = 600) -> tuple[int, str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout


def table_row(stdout: str, name: str) -> dict[str, str]:
    """check -> "pass" / "FAIL" / "skip" from the model's row of the table."""
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("model "))
    row = next(line for line in lines if line.split()[:1] == [name])
    cells = {}
    for check in smoke.CHECKS:
        start = header.index(check)
        cells[check] = row[start:start + 16].split()[0]
    return cells


def test_verified_models_cover_the_real_models_and_every_family():
    family_files = {p.stem for p in (SCRIPT.parent.parent / "family").glob("*.toml")}
    assert set(smoke.REAL_MODELS) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert {f"synthetic-{f}" for f in family_files} <= set(smoke.VERIFIED_MODELS)


@pytest.mark.parametrize("model", smoke.REAL_MODELS)
def test_golden_files_come_from_the_reference_backend(model):
    golden = json.loads((GOLDEN / f"{model}.json").read_text())
    assert golden["model"] == model
    assert "reference" in golden["generated_by"]
    assert len(golden["ids"]) == len(golden["margins"]) == smoke.GOLDEN_TOKENS
    assert golden["prompt"] == smoke.prompt_of(model)
    # every golden token is a clear choice of the reference, so any backend must reproduce it
    assert min(golden["margins"]) >= smoke.NEAR_TIE


def _marks(model: str) -> tuple:
    if model in LARGE_MODELS:
        return pytest.mark.slow, pytest.mark.large_model
    return (pytest.mark.slow,) if model in smoke.REAL_MODELS else ()


@pytest.mark.parametrize("model", [pytest.param(m, marks=_marks(m)) for m in smoke.VERIFIED_MODELS])
def test_every_check_passes_on_webgpu(model):
    rc, out = run_smoke("--only", model)
    assert rc == 0, out
    assert table_row(out, model) == {check: "pass" for check in smoke.CHECKS}, out
    assert "1 of 1 models passed every check" in out


def test_discrete_gpu_kernels_on_synthetic_models():
    """lavapipe runs gemm_rows.wgsl for every token count; the tiled gemv/gemm pair that GPUs run
    is checked here too, where decode (gemv) and prefill (gemm) really are different kernels."""
    rc, out = run_smoke("--family", "llama", "--family", "gemma3", "--skip-server", "--matmul", "tiled")
    assert rc == 0, out
    for name in ("synthetic-llama", "synthetic-gemma3"):
        row = table_row(out, name)
        assert row == {**{check: "pass" for check in smoke.CHECKS}, "server": "skip"}, out


def test_a_wrong_golden_fails_and_names_the_token(tmp_path):
    rc, out = run_smoke("--family", "llama", "--golden-dir", str(tmp_path), "--write-golden")
    assert rc == 0, out
    path = tmp_path / "synthetic-llama.json"
    golden = json.loads(path.read_text())
    assert golden["ids"] and "reference" in golden["generated_by"]

    rc, out = run_smoke("--family", "llama", "--golden-dir", str(tmp_path), "--skip-server")
    assert rc == 0, out
    assert "golden " + str(path) in out

    golden["ids"][2] = (golden["ids"][2] + 1) % 512
    golden["margins"][2] = 1.0  # a clear choice: parting here cannot be excused as a near tie
    path.write_text(json.dumps(golden))
    rc, out = run_smoke("--family", "llama", "--golden-dir", str(tmp_path), "--skip-server")
    assert rc == 1, out
    row = table_row(out, "synthetic-llama")
    assert row["golden"] == "FAIL" and row["load"] == row["prefill/decode"] == "pass", out
    assert "token 2: got" in out
    assert row["server"] == "skip"


def test_a_file_that_is_not_a_model_fails_at_load(tmp_path):
    bogus = tmp_path / "notes.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    rc, out = run_smoke("--model", str(bogus), "--skip-server")
    assert rc == 1, out
    row = table_row(out, "notes")
    assert row["load"] == "FAIL"
    assert all(row[c] == "skip" for c in smoke.CHECKS if c != "load"), out
    assert "0 of 1 models passed every check" in out


def test_unknown_only_names_the_choices():
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", "nope"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "unknown --only nope" in done.stderr and "smollm2-135m" in done.stderr
