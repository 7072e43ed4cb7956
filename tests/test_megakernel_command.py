"""`airframe megakernel plan|show|stats` end to end on SmolLM2."""

import json

import pytest

from airframe.cli import main
from airframe.megakernel.plan.package import Package


def test_plan_then_show(smollm2_path, tmp_path, capsys):
    out = tmp_path / "pkg"
    assert main(["megakernel", "plan", str(smollm2_path), "--target", "rtx3050", "--workers", "6",
                 "--ctx", "64", "-o", str(out), "-q"]) == 0
    printed = capsys.readouterr().out
    assert "tasks in 153 waves on 6 workers" in printed
    package = Package.load(out)
    assert package.plan.target.workers == 6 and package.plan.consts["ctx"] == 64
    assert main(["megakernel", "show", str(out), "-o", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "wave_bytes.png").stat().st_size > 10_000


def test_stats_json(smollm2_path, capsys):
    assert main(["megakernel", "stats", str(smollm2_path), "--target", "h200", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["workers"] == 132 and stats["waves"] == 1 + 5 * 30 + 2
    assert len(stats["per_wave"]) == stats["waves"]


@pytest.mark.parametrize("argv,message", [
    (["--target", "rtx3050", "--workers", "0"], "--workers 0"),
    (["--target", "gpu9000"], "neither a named target"),
    (["--target", "rtx3050", "--ctx", "-5"], "--ctx -5"),
    (["--target", "h200", "--attn-wide", "-1"], "--attn-wide -1"),
])
def test_bad_arguments_are_reported(smollm2_path, capsys, argv, message):
    assert main(["megakernel", "stats", str(smollm2_path), *argv]) == 1
    assert message in capsys.readouterr().err


def test_gemma3_is_refused(gemma3_path, capsys):
    assert main(["megakernel", "stats", str(gemma3_path), "--target", "h200"]) == 1
    assert "Llama layout only" in capsys.readouterr().err
