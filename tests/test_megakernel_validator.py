"""The validator accepts what the planner writes and rejects every corrupted plan."""

import copy
import dataclasses

import numpy as np
import pytest

from airframe.family import load_config
from airframe.gguf_file import GGUFFile
from airframe.megakernel.plan.opcodes import Op
from airframe.megakernel.plan.planner import make_plan
from airframe.megakernel.plan.target import load_target
from airframe.megakernel.plan.validator import PlanError, task_ranges, validate

N_CASES = 25  # corruptions per kind and target


# (target, workers, split): whole rows on both targets; split-K QKV/WO pieces on the H200; and
# 127 workers, where SmolLM2's leftover FFN rows are shared too (ffn_parts > workers)
PLANS = [("rtx3050", None, False), ("h200", None, False), ("h200", None, True), ("h200", 127, True)]


@pytest.fixture(scope="module", params=PLANS, ids=lambda p: f"{p[0]}-{p[1] or 'all'}-{'split' if p[2] else 'rows'}")
def plan(request, smollm2_path):
    """A two-layer SmolLM2-shaped plan: small enough to validate hundreds of corruptions."""
    config = dataclasses.replace(load_config(GGUFFile(smollm2_path)), n_layers=2)
    name, workers, split = request.param
    return make_plan(config, load_target(name, workers), ctx=96, split=split)


def _with_tasks(plan, tasks):
    bad = copy.copy(plan)
    order = np.argsort(tasks["wave"], kind="stable")
    bad.tasks = tasks[order]
    return bad


def _rows_of(plan, op):
    return np.flatnonzero(plan.tasks["opcode"] == op)


def test_planner_output_is_accepted(plan):
    validate(plan)


def test_smollm2_full_plans_are_accepted(smollm2_path):
    config = load_config(GGUFFile(smollm2_path))
    for name in ("rtx3050", "h200"):
        for split in (False, True):
            validate(make_plan(config, load_target(name), ctx=256, split=split))


def _corrupt_range(plan, rng):
    tasks = plan.tasks.copy()
    i = int(rng.integers(len(tasks)))
    field = rng.choice(["row_start", "row_count", "weight0", "norm"])
    if Op(int(tasks[i]["opcode"])) in (Op.FFN_REDUCE, Op.ATTN) and field in ("weight0", "norm"):
        field = "row_start"
    if field in ("weight0", "norm") and tasks[i][field] == 0:
        field = "row_count"
    delta = int(rng.choice([-1, 1, 2, 7, 1 << 20, 1 << 40])) if field in ("weight0", "norm") else int(rng.choice([-1, 1, 3, 1000]))
    tasks[i][field] = (int(tasks[i][field]) + delta) % (1 << (64 if field in ("weight0", "norm") else 32))
    return _with_tasks(plan, tasks)


def _corrupt_wave(plan, rng):
    tasks = plan.tasks.copy()
    i = int(rng.integers(len(tasks)))
    shift = int(rng.choice([-2, -1, 1, 2]))
    tasks[i]["wave"] = int(np.clip(int(tasks[i]["wave"]) + shift, 0, plan.consts["n_waves"] - 1))
    if tasks[i]["wave"] == plan.tasks[i]["wave"]:
        tasks[i]["wave"] += 1 if tasks[i]["wave"] == 0 else -1
    return _with_tasks(plan, tasks)


def _duplicate_writer(plan, rng):
    tasks = plan.tasks.copy()
    op = rng.choice([Op.QKV, Op.WO, Op.FFN_REDUCE, Op.LM_HEAD, Op.FFN, Op.EMBED])
    rows = _rows_of(plan, op)
    i, j = rng.choice(rows, size=2, replace=False)
    for field in ("row_start", "row_count", "slot", "head", "layer", "wave"):
        tasks[i][field] = tasks[j][field]
    return _with_tasks(plan, tasks)


def _read_inside_wave(plan, rng):
    """Move a consumer into its producer's wave: it now reads rows written beside it."""
    tasks = plan.tasks.copy()
    consumer = rng.choice([Op.ATTN, Op.WO, Op.FFN, Op.FFN_REDUCE, Op.QKV, Op.LM_HEAD])
    i = int(rng.choice(_rows_of(plan, consumer)))
    tasks[i]["wave"] = int(tasks[i]["wave"]) - 1
    return _with_tasks(plan, tasks)


def _wrong_fingerprint(plan, rng):
    bad = copy.copy(plan)
    bad.fingerprint = dict(plan.fingerprint, fingerprint="%064x" % int(rng.integers(1 << 62)))
    return bad


def _wrong_worker_or_opcode(plan, rng):
    tasks = plan.tasks.copy()
    i = int(rng.integers(len(tasks)))
    if rng.random() < 0.5:
        tasks[i]["worker"] = plan.target.workers + int(rng.integers(5))
    else:
        tasks[i]["opcode"] = int(rng.choice([0, 9, 200]))
    return _with_tasks(plan, tasks)


def _corrupt_part(plan, rng):
    """Move, resize or re-route a QKV/WO/FFN task's part (a split-K piece where the plan has them)."""
    tasks = plan.tasks.copy()
    op = rng.choice([Op.QKV, Op.WO, Op.FFN])
    rows = _rows_of(plan, op)
    split = rows[tasks["part_start"][rows] > 0]
    i = int(rng.choice(split if split.size and rng.random() < 0.7 else rows))
    field = rng.choice(["part_start", "part_count", "side", "pad"])
    if field == "side":
        tasks[i]["side"] = 1 - int(tasks[i]["side"]) if op != Op.FFN else 1
    else:
        delta = int(rng.choice([-8, 8, 16, 3]))
        tasks[i][field] = max(0, int(tasks[i][field]) + delta) if field != "pad" else 1
        if tasks[i][field] == plan.tasks[i][field]:
            tasks[i][field] += 8
    return _with_tasks(plan, tasks)


CORRUPTIONS = [_corrupt_range, _corrupt_wave, _duplicate_writer, _read_inside_wave, _wrong_fingerprint,
               _wrong_worker_or_opcode, _corrupt_part]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_fuzzed_plans_are_rejected(plan, corrupt):
    rng = np.random.default_rng(CORRUPTIONS.index(corrupt))
    for case in range(N_CASES):
        bad = corrupt(plan, rng)
        with pytest.raises(PlanError):
            validate(bad)


def test_errors_name_task_wave_and_range(plan):
    tasks = plan.tasks.copy()
    i = int(_rows_of(plan, Op.WO)[1])
    tasks[i]["row_start"] = tasks[i - 1]["row_start"]
    with pytest.raises(PlanError, match=r"task \d+ \(WO, wave \d+ L0.wo, worker \d+.*act\[\d+:\d+\]"):
        validate(_with_tasks(plan, tasks))
    tasks = plan.tasks.copy()
    i = int(_rows_of(plan, Op.FFN_REDUCE)[0])
    tasks[i]["wave"] -= 1
    with pytest.raises(PlanError, match="writes in the same wave"):
        validate(_with_tasks(plan, tasks))


def test_a_different_target_is_refused(plan):
    other = load_target(plan.target.name, workers=plan.target.workers + 1)
    with pytest.raises(PlanError, match="made for target"):
        validate(plan, other)


@pytest.mark.parametrize("spread", [0, None])
def test_ranges_of_attention_stay_inside_the_chunk(smollm2_path, spread):
    """Fixed chunks read their own positions of the cache; spread chunks (whose positions move with
    the position) any of their K/V head's; only chunk 0 writes the current row."""
    config = dataclasses.replace(load_config(GGUFFile(smollm2_path)), n_layers=2)
    plan = make_plan(config, load_target("rtx3050", 9), ctx=96, attn_spread=spread)
    k = plan.consts
    assert k["attn_chunks"] == 3 and (k["attn_spread"] == 0) == (spread == 0)
    for t in plan.tasks[plan.tasks["opcode"] == Op.ATTN]:
        reads, writes = task_ranges(t, k)
        past = [b for b in reads if b.buf == "kcache"][0]
        lh = int(t["layer"]) * k["n_head_kv"] + int(t["head"])
        first = int(t["slot"]) * k["attn_chunk"] if spread == 0 else 0
        assert past.start == (lh * k["ctx"] + first) * k["head_dim"]
        assert past.end <= (lh + 1) * k["ctx"] * k["head_dim"]
        assert any(b.buf == "know" for b in writes) == (int(t["slot"]) == 0)


@pytest.mark.parametrize("field,message", [("attn_min", "attn_min 0"), ("attn_wide_min", "attn_wide_min 0")])
def test_spread_minimums_must_be_positive(plan, field, message):
    bad = dataclasses.replace(plan, consts=dict(plan.consts, **{field: 0}))
    assert bad.consts["attn_spread"] and bad.consts["attn_wide"]
    with pytest.raises(PlanError, match=message):
        validate(bad)


def test_split_pieces_are_two_per_row_at_most_and_tile_it(plan):
    k = plan.consts
    for op, width in ((Op.QKV, k["n_embd"]), (Op.WO, k["n_head"] * k["head_dim_v"])):
        tasks = plan.tasks[(plan.tasks["opcode"] == op) & (plan.tasks["layer"] == 0)]
        pieces = tasks[tasks["part_count"] < width]
        assert np.all(pieces["row_count"] == 1)
        for row in np.unique(pieces["row_start"]):
            parts = sorted((int(t["part_start"]), int(t["part_count"]), int(t["side"]))
                           for t in pieces[pieces["row_start"] == row])
            assert len(parts) == 2 and parts[0][0] == 0 and parts[0][2] == 0 and parts[1][2] == 1
            assert parts[0][1] == parts[1][0] and parts[1][0] + parts[1][1] == width
        assert (pieces.size > 0) == (plan.target.name == "h200" and bool(plan.tasks["side"].any()))
