"""A megakernel package: one folder with everything one launch needs.

    plan.json    header: format version, model shape, target, fingerprint, plan constants, waves,
                 the tensor table of weights.bin, the attention chunk rule
    tasks.bin    n_tasks x 80-byte task words (opcodes.TASK_FIELDS), sorted by (wave, worker)
    weights.bin  matrices in Q8_0 when every matrix of the model is Q8_0 (its own bytes, re-laid
                 out: planner.WEIGHT_FORMATS), else as BF16 (quantized ones dequantized, then
                 rounded to nearest even); vectors and RoPE tables as F32; ffn_down transposed;
                 attn_q, attn_k, attn_v adjacent
    target.json  the target description the plan was made for

Weights are written tensor by tensor, in row blocks, so the 2.47 GB of a 1B model never sit in
memory at once. Loading maps weights.bin and validates the plan again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from tqdm import tqdm

from ...errors import AirframeError, GGUFError
from ...family import load_config
from ...gguf_file import GGUFFile, dequantize_rows
from ...rope_scaling import cos_sin
from .opcodes import CONST_NAMES, PLAN_VERSION, TASK_DTYPE
from .planner import (LLAMA_LAYER_TENSORS, Q8_BLOCK, SPLIT_DEFAULT, Plan, TensorSlot, make_plan,
                      q8_down_block_bytes, q8_row_bytes)
from .target import Target, target_from_dict, target_to_dict
from .validator import PlanError, validate
from .vm import f32_to_bf16

FORMAT = "airframe-megakernel-plan"
ROW_BLOCK_BYTES = 64 << 20  # dequantize at most this many float32 bytes at a time
ATTENTION_RULE = ("chunk c covers positions [c*S, min((c+1)*S, p+1)) and runs when c*S <= p, S = "
                  "attn_span(p) (attn_chunk when attn_spread is 0); WO merges the p // S + 1 active "
                  "chunks in order")


@dataclass
class Package:
    path: Path
    plan: Plan
    weights: np.ndarray  # uint8 view of weights.bin

    @classmethod
    def load(cls, path: str | Path, target: Target | None = None) -> "Package":
        """Read a package folder and validate it against `target` (default: its own target.json)."""
        path = Path(path)
        plan = read_plan(path)
        weights_path = path / "weights.bin"
        size = weights_path.stat().st_size if weights_path.is_file() else -1
        if size != plan.consts["weights_size"]:
            raise PlanError(f"{weights_path}: {size} bytes, expected {plan.consts['weights_size']}")
        validate(plan, target)
        weights = np.memmap(weights_path, dtype=np.uint8, mode="r")
        return cls(path, plan, weights)


def plan_to_json(plan: Plan) -> dict:
    return {
        "format": FORMAT, "version": plan.version, "model": plan.model,
        "target": target_to_dict(plan.target), "fingerprint": plan.fingerprint, "consts": plan.consts,
        "attention_rule": ATTENTION_RULE, "waves": plan.waves,
        "tensors": {name: {"offset": s.offset, "dtype": s.dtype, "shape": list(s.shape),
                           "transposed": s.transposed} for name, s in plan.tensors.items()},
    }


def plan_from_json(header: dict, tasks: np.ndarray, where: str) -> Plan:
    if header.get("format") != FORMAT or header.get("version") != PLAN_VERSION:
        raise PlanError(f"{where}: format {header.get('format')!r} version {header.get('version')!r}, "
                        f"expected {FORMAT!r} version {PLAN_VERSION}")
    consts = header.get("consts")
    missing = [name for name in CONST_NAMES if not isinstance(consts, dict) or name not in consts]
    if missing:
        raise PlanError(f"{where}: plan constants lack {', '.join(missing[:5])}"
                        f"{' and more' if len(missing) > 5 else ''}")
    try:
        tensors = {name: TensorSlot(name, t["offset"], t["dtype"], tuple(t["shape"]), t["transposed"])
                   for name, t in header["tensors"].items()}
        return Plan(header["model"], target_from_dict(header["target"], where), header["consts"],
                    header["waves"], tasks, tensors, header["fingerprint"], header["version"])
    except (KeyError, TypeError) as e:
        raise PlanError(f"{where}: malformed plan header ({type(e).__name__}: {e})") from None


def read_plan(path: Path) -> Plan:
    try:
        header = json.loads((path / "plan.json").read_text())
        raw = (path / "tasks.bin").read_bytes()
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{path}: cannot read the package ({e})") from None
    if len(raw) % TASK_DTYPE.itemsize:
        raise PlanError(f"{path / 'tasks.bin'}: {len(raw)} bytes, expected a multiple of {TASK_DTYPE.itemsize}")
    return plan_from_json(header, np.frombuffer(raw, dtype=TASK_DTYPE).copy(), str(path / "plan.json"))


def write_plan(plan: Plan, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan_to_json(plan), indent=1))
    (out / "tasks.bin").write_bytes(plan.tasks.tobytes())
    (out / "target.json").write_text(json.dumps(asdict(plan.target), indent=1))


def write_package(model_path: str | Path, target: Target, out: str | Path, ctx: int | None = None,
                  attn_chunk: int | None = None, progress: bool = True, split: bool = SPLIT_DEFAULT,
                  attn_spread: int | None = None, attn_wide: int | None = None,
                  attn_wide_min: int | None = None) -> Package:
    """Plan `model_path` for `target` and write the package folder `out` (planner.make_plan)."""
    out = Path(out)
    gf = GGUFFile(model_path)
    config = load_config(gf)
    plan = make_plan(config, target, ctx, attn_chunk, split=split, attn_spread=attn_spread,
                     attn_wide=attn_wide, attn_wide_min=attn_wide_min, weights=weight_format(gf, config))
    plan.model["source"] = str(model_path)
    validate(plan, target)
    write_plan(plan, out)
    try:
        _write_weights(gf, plan, out / "weights.bin", progress)
    except OSError as e:
        raise AirframeError(f"{out / 'weights.bin'}: cannot write ({e.strerror or e})") from None
    return Package.load(out, target)


def weight_format(gf: GGUFFile, config) -> str:
    """"q8_0" when every matrix the plan stores is Q8_0 in the GGUF (a Q8_0 model keeps its own
    weights and half BF16's bytes), else "bf16"."""
    names = ["token_embd.weight"] + ([] if config.tied_embeddings else ["output.weight"])
    names += [f"blk.{i}.{name}" for i in range(config.n_layers) for name in LLAMA_LAYER_TENSORS
              if not name.endswith("norm.weight")]
    q8 = all(gf.tensor(name).qtype == GGMLQuantizationType.Q8_0 for name in names)
    return "q8_0" if q8 else "bf16"


def _write_weights(gf: GGUFFile, plan: Plan, path: Path, progress: bool) -> None:
    total = plan.consts["weights_size"]
    with open(path, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, desc="packing weights",
                                      disable=not progress, leave=False) as bar:
        for slot in sorted(plan.tensors.values(), key=lambda s: s.offset):
            f.seek(slot.offset)
            for block in _tensor_blocks(gf, plan, slot):
                f.write(block.tobytes())
                bar.update(block.nbytes)
        f.truncate(total)
        bar.update(total - bar.n)


def _tensor_blocks(gf: GGUFFile, plan: Plan, slot: TensorSlot):
    """The bytes of one tensor slot, in row blocks."""
    if slot.name in ("rope_cos", "rope_sin"):
        yield _rope_table(gf, plan, slot)
        return
    info = gf.tensor(slot.name)
    found = tuple(reversed(info.shape))
    if (found[::-1] if slot.transposed else found) != slot.shape:
        raise GGUFError(f"{gf.path}: tensor {slot.name} has shape {list(found)}, expected "
                        f"{list(slot.shape[::-1] if slot.transposed else slot.shape)} for this model")
    if slot.dtype == "f32":
        yield gf.dequantize(slot.name).astype(np.float32).reshape(-1)
        return
    raw = gf.raw(slot.name)
    if slot.dtype == "q8_0":
        yield from (_q8_down(raw) if slot.transposed else _q8_rows(raw))
        return
    if slot.transposed:
        yield np.ascontiguousarray(_bf16_rows(raw, info.qtype).T)
        return
    rows_per_block = max(1, ROW_BLOCK_BYTES // (4 * info.shape[0]))
    for first in range(0, info.n_rows, rows_per_block):
        yield _bf16_rows(raw[first:first + rows_per_block], info.qtype)


def _q8_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 rows (rows, blocks * 34 bytes: an f16 scale, then 32 int8) -> (quants (rows, cols)
    uint8, scales (rows, blocks) as f16 bytes (rows, 2 * blocks))."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 2 + Q8_BLOCK)
    return blocks[:, :, 2:].reshape(rows, -1), blocks[:, :, :2].reshape(rows, -1)


def _q8_rows(raw: np.ndarray):
    """Rows in the Q8_0 row layout (planner.WEIGHT_FORMATS): quants, scales, padding."""
    cols = raw.shape[1] // (2 + Q8_BLOCK) * Q8_BLOCK
    stride = q8_row_bytes(cols)
    rows_per_block = max(1, ROW_BLOCK_BYTES // stride)
    for first in range(0, raw.shape[0], rows_per_block):
        quants, scales = _q8_blocks(raw[first:first + rows_per_block])
        out = np.zeros((quants.shape[0], stride), np.uint8)
        out[:, :cols] = quants
        out[:, cols:cols + scales.shape[1]] = scales
        yield out


def _q8_down(raw: np.ndarray):
    """ffn_down (n_embd rows of n_ff) transposed into blocks of 32 n_ff rows: each block's quants
    (32 rows of n_embd), then its n_embd scales."""
    quants, scales = _q8_blocks(raw)  # (n_embd, n_ff), (n_embd, 2 * n_ff / 32)
    e = quants.shape[0]
    for b in range(quants.shape[1] // Q8_BLOCK):
        block = np.empty(q8_down_block_bytes(e), np.uint8)
        block[:Q8_BLOCK * e] = quants[:, b * Q8_BLOCK:(b + 1) * Q8_BLOCK].T.reshape(-1)
        block[Q8_BLOCK * e:] = scales[:, 2 * b:2 * b + 2].reshape(-1)
        yield block


def _bf16_rows(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(rows, row_bytes) GGUF bytes -> (rows, row_length) BF16 bits; BF16 is taken as it is."""
    if qtype == GGMLQuantizationType.BF16:
        return raw.view(np.uint16)
    return f32_to_bf16(dequantize_rows(raw, qtype))


def _rope_table(gf: GGUFFile, plan: Plan, slot: TensorSlot) -> np.ndarray:
    config = plan.config
    factors = gf.dequantize("rope_freqs.weight") if "rope_freqs.weight" in gf.tensors else None
    cos, sin = cos_sin(np.arange(plan.consts["ctx"]), config.rope_dim, config.rope_base,
                       config.rope_scaling, factors)  # float64, the reference's own tables
    return (cos if slot.name == "rope_cos" else sin).astype(np.float32)
