"""The measurement experiments of dev/megakernel/ where checking them is cheap: the latency probe's
kernels compile, the spread script redraws a saved H200 run (and that run says what
docs/MEGAKERNEL.md says it measured), and the dependency model replays a trace as designed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from airframe.megakernel.cuda import build
from airframe.megakernel.plan.opcodes import Op
from airframe.megakernel.plan.planner import make_plan
from airframe.megakernel.plan.target import NAMED_TARGETS
from test_megakernel_cuda import SMOL, fake_trace

ROOT = Path(__file__).resolve().parent.parent
DEV = ROOT / "dev" / "megakernel"
SAVED_SPREAD = Path(__file__).resolve().parent / "data" / "megakernel" / "h200_spread.json"


def load_dev(name: str):
    spec = importlib.util.spec_from_file_location(f"dev_megakernel_{name}", DEV / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_latency_probe_kernels_compile(tmp_path):
    nvcc = build.find_nvcc()
    assert nvcc, "nvcc is expected on PATH (CI has CUDA 13)"
    probe = load_dev("latency_probe")
    out = tmp_path / "probe.cubin"
    done = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-O3", str(probe.SOURCE_PATH), "-o", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cubin = out.read_bytes()
    for kernel in (b"probe", b"pages", b"icache", b"clocks", b"sums", b"barriers", b"csums"):  # main()'s names
        assert b".text." + kernel + b"\0" in cubin


def test_context_curves_are_drawn_from_rounds_and_empty_input_is_refused(tmp_path):
    spread = load_dev("spread")
    times = {"a": {1: [0.84, 0.85], 512: [0.96, 0.97]}, "b": {1: [0.84], 512: [1.05, 1.06, 1.07]}}
    path = spread.draw_context_curves(times, tmp_path / "curves.png", "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no timings"):
        spread.draw_context_curves({"a": {}}, tmp_path / "empty.png", "title")


def test_the_saved_spread_run_redraws(tmp_path):
    """The H200 run of three rules of the spread on one runtime (`spread.py --draw`)."""
    out = tmp_path / "picture.png"
    done = subprocess.run([sys.executable, str(DEV / "spread.py"), "--draw", str(SAVED_SPREAD), "-o", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(SAVED_SPREAD.read_text())
    median = {name: {int(c): np.median(r) for c, r in rounds.items()} for name, rounds in data["times"].items()}
    # what the docs say the run measured: the default never slower than stopping at four chunks
    # (within 0.5 us), 4-8% faster at 1,024-2,048 positions, and faster than fixed chunks at 512
    assert all(median["spread"][c] <= median["narrow"][c] + 5e-4 for c in median["spread"])
    assert all(0.04 < 1 - median["spread"][c] / median["narrow"][c] < 0.08 for c in (1024, 1280, 1536, 2048))
    assert median["spread"][512] < median["fixed"][512]
    assert data["rules"]["spread"]["attn_wide"] == 16 and data["rules"]["narrow"]["attn_wide"] == 0


def test_dependency_model_of_a_trace():
    model = load_dev("dependency_model")
    plan = make_plan(replace(SMOL, n_layers=2), replace(NAMED_TARGETS["rtx3050"], workers=20), ctx=256)
    trace = fake_trace(plan, 20)
    t = plan.tasks
    # with every wave waiting for all of the previous one (the grid barrier's model), a wave ends
    # its worker's tasks one after another (1 us each) and the next starts `signal` later
    per_wave = [np.bincount(t["worker"][t["wave"] == w]).max() for w in range(plan.consts["n_waves"])]
    barrier = sum(per_wave) * 1.0 + (len(per_wave) - 1) * 0.5
    assert model.dependency_model(trace, plan, 500, partial=False) == pytest.approx(barrier)
    # an attention task waits for the QKV tasks holding its heads' q, k and v rows, and only them
    k, hd = plan.consts, plan.consts["head_dim"]
    qkv = np.flatnonzero((t["opcode"] == Op.QKV) & (t["layer"] == 0))
    for i in np.flatnonzero((t["opcode"] == Op.ATTN) & (t["layer"] == 0)):
        h, g = int(t["head"][i]), k["n_head"] // k["n_head_kv"]
        rows = set()
        for j in model.attention_producers(plan, i, qkv):
            rows |= set(range(int(t["row_start"][j]), int(t["row_start"][j] + t["row_count"][j])))
        need = (set(range(h * g * hd, (h + 1) * g * hd)) | set(range(k["n_head"] * hd + h * hd, k["n_head"] * hd + (h + 1) * hd))
                | set(range((k["n_head"] + k["n_head_kv"] + h) * hd, (k["n_head"] + k["n_head_kv"] + h + 1) * hd)))
        assert need <= rows and len(rows - need) < 2 * int(t["row_count"][qkv].max())
    # A QKV task is read by some attention tasks, not all. When it ends 1 us late and its readers
    # take 0.1 us instead of 1, the other attention tasks need not wait for it: the attention wave
    # ends with the readers, 0.1 us after the others, and the token 0.9 us sooner. (Had its
    # readers been as long as the others, the WO wave, which waits for all of them, would have
    # given the time back.)
    attn = np.flatnonzero((t["opcode"] == Op.ATTN) & (t["layer"] == 0))
    readers = [i for i in attn if qkv[0] in model.attention_producers(plan, i, qkv)]
    assert 0 < len(readers) < len(attn)
    trace["tasks"][int(qkv[0])][2] += 1000
    for i in readers:
        trace["tasks"][i][2] = trace["tasks"][i][1] + 100
    partial, whole = (model.dependency_model(trace, plan, 500, partial=p) for p in (True, False))
    assert whole - partial == pytest.approx(0.9)
