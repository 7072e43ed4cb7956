"""Packages: what is written is what the plan says, loading validates again, bad folders are refused."""

import json

import numpy as np
import pytest

from airframe.gguf_file import GGUFFile
from airframe.megakernel.plan.opcodes import TASK_DTYPE
from airframe.megakernel.plan.package import Package, write_package
from airframe.megakernel.plan.target import load_target
from airframe.megakernel.plan.validator import PlanError
from airframe.megakernel.plan.vm import bf16_to_f32, f32_to_bf16
from airframe.reference import rope_angles


@pytest.fixture(scope="module")
def package(smollm2_path, tmp_path_factory):
    return write_package(smollm2_path, load_target("h200"), tmp_path_factory.mktemp("pkg"), ctx=32, progress=False)


def _tensor(package, name):
    slot = package.plan.tensors[name]
    raw = package.weights[slot.offset:slot.offset + slot.n_bytes]
    if slot.dtype == "f32":
        return raw.view(np.float32).reshape(slot.shape)
    return bf16_to_f32(raw.view(np.uint16)).reshape(slot.shape)


def test_files_and_sizes(package):
    names = sorted(p.name for p in package.path.iterdir())
    assert names == ["plan.json", "target.json", "tasks.bin", "weights.bin"]
    assert (package.path / "tasks.bin").stat().st_size == TASK_DTYPE.itemsize * package.plan.consts["n_tasks"]
    assert json.loads((package.path / "target.json").read_text())["workers"] == 132


def test_weights_are_the_gguf_tensors_rounded_to_bf16(package, smollm2_path):
    gf = GGUFFile(smollm2_path)
    for name in ("blk.3.attn_q.weight", "blk.3.attn_v.weight", "token_embd.weight"):
        want = bf16_to_f32(f32_to_bf16(gf.dequantize(name))).reshape(gf.dequantize(name).shape)
        assert np.array_equal(_tensor(package, name), want), name
    down = _tensor(package, "blk.0.ffn_down.weight")  # stored transposed: (n_ff, n_embd)
    assert np.array_equal(down.T, bf16_to_f32(f32_to_bf16(gf.dequantize("blk.0.ffn_down.weight"))).reshape(down.T.shape))
    assert np.array_equal(_tensor(package, "blk.0.ffn_norm.weight"), gf.dequantize("blk.0.ffn_norm.weight"))


def test_qkv_is_one_stacked_matrix(package):
    t = package.plan.tensors
    q, k, v = (t[f"blk.5.attn_{x}.weight"] for x in "qkv")
    assert q.offset + q.n_bytes == k.offset and k.offset + k.n_bytes == v.offset


def test_rope_tables(package):
    config = package.plan.config
    theta = rope_angles(np.arange(32), config.rope_dim, config.rope_base)  # SmolLM2 has no RoPE scaling
    assert np.array_equal(_tensor(package, "rope_cos"), np.cos(theta).astype(np.float32))
    assert np.array_equal(_tensor(package, "rope_sin"), np.sin(theta).astype(np.float32))
    assert package.plan.config.rope_scaling == config.rope_scaling


def test_loading_validates_again(package, tmp_path):
    again = Package.load(package.path)
    assert again.plan.tasks.tobytes() == package.plan.tasks.tobytes()
    with pytest.raises(PlanError, match="made for target"):
        Package.load(package.path, load_target("rtx3050"))
    # a corrupted task word in a copy of the package
    for name in ("plan.json", "target.json", "weights.bin"):
        (tmp_path / name).symlink_to(package.path / name)
    tasks = np.frombuffer((package.path / "tasks.bin").read_bytes(), dtype="<u4").copy().reshape(-1, TASK_DTYPE.itemsize // 4)
    tasks[10, 4] += 1  # row_start of an embedding task
    (tmp_path / "tasks.bin").write_bytes(tasks.tobytes())
    with pytest.raises(PlanError, match="task 10"):
        Package.load(tmp_path)


def test_truncated_weights_and_bad_header_are_refused(package, tmp_path):
    (tmp_path / "plan.json").write_text((package.path / "plan.json").read_text())
    (tmp_path / "tasks.bin").write_bytes((package.path / "tasks.bin").read_bytes())
    (tmp_path / "weights.bin").write_bytes(b"\0" * 100)
    with pytest.raises(PlanError, match="100 bytes, expected"):
        Package.load(tmp_path)
    header = json.loads((package.path / "plan.json").read_text())
    del header["consts"]["act_size"]
    (tmp_path / "plan.json").write_text(json.dumps(header))
    with pytest.raises(PlanError, match="plan constants lack act_size"):
        Package.load(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps({"format": "something else", "version": 1}))
    with pytest.raises(PlanError, match="expected 'airframe-megakernel-plan'"):
        Package.load(tmp_path)
    (tmp_path / "tasks.bin").write_bytes(b"\0" * 81)
    with pytest.raises(PlanError, match="multiple of 80"):
        Package.load(tmp_path)
