"""The planner: waves, the task split, byte balance and the attention chunk rule."""

import dataclasses
import json

import numpy as np
import pytest

from airframe.errors import ParameterError, UnsupportedError
from airframe.family import load_config
from airframe.gguf_file import GGUFFile
from airframe.megakernel.plan.opcodes import Op, attn_span
from airframe.megakernel.plan.planner import (SPLIT_COLS, _matrix_wave, ffn_sharing, make_plan, plan_is_split,
                                         plan_stats, split_rows, wave_bytes)
from airframe.megakernel.plan.target import NAMED_TARGETS, fingerprint, load_target, target_to_dict
from airframe.megakernel.plan.validator import validate


@pytest.fixture(scope="module")
def smollm2_config(smollm2_path):
    return load_config(GGUFFile(smollm2_path))


@pytest.fixture(scope="module")
def llama1b_config(smollm2_config):
    """Llama 3.2 1B's shape (the planner needs only the config)."""
    return dataclasses.replace(smollm2_config, n_layers=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8,
                               head_dim=64, head_dim_v=64, rope_dim=64, rope_base=500000.0,
                               vocab_size=128256, ctx_train=131072)


@pytest.mark.parametrize("total,parts", [(3072, 20), (2048, 132), (7, 20), (49152, 132), (1, 1)])
def test_split_rows_covers_every_row_once_with_counts_one_apart(total, parts):
    pieces = split_rows(total, parts)
    assert len(pieces) == min(total, parts)
    assert [s for s, _ in pieces] == list(np.cumsum([0] + [n for _, n in pieces[:-1]]))
    counts = [n for _, n in pieces]
    assert sum(counts) == total and max(counts) - min(counts) <= 1


@pytest.mark.parametrize("target", ["rtx3050", "h200"])
def test_llama1b_plan_waves_and_tasks(llama1b_config, target):
    plan = make_plan(llama1b_config, load_target(target), ctx=4096)
    assert plan.consts["n_waves"] == len(plan.waves) == 1 + 5 * 16 + 2
    names = [w["name"] for w in plan.waves]
    assert names[:6] == ["embed", "L0.qkv", "L0.attn", "L0.wo", "L0.ffn", "L0.ffn_reduce"]
    assert names[-2:] == ["final_norm", "lm_head"]
    workers = NAMED_TARGETS[target].workers
    assert plan.tasks["worker"].max() < workers
    assert np.all(np.diff(plan.tasks["wave"].astype(int)) >= 0)
    # the attention wave has one task per K/V head and chunk, and the chunks cover the context
    attn = plan.tasks[plan.tasks["opcode"] == Op.ATTN]
    assert len(attn) == 16 * 8 * plan.consts["attn_chunks"]
    assert plan.consts["attn_chunk"] * plan.consts["attn_chunks"] >= 4096
    assert plan.consts["attn_chunks"] * 8 <= workers  # every attention task has its own worker
    validate(plan)


def test_llama1b_weight_waves_balance_bytes_within_one_percent_on_rtx3050(llama1b_config):
    stats = plan_stats(make_plan(llama1b_config, load_target("rtx3050"), ctx=4096))
    assert stats["tasks"] == 20 + 16 * (20 + 16 + 20 + 20 + 20) + 20 + 20  # 16 attention tasks
    assert stats["max_weight_wave_imbalance"] < 0.01
    for wave in stats["per_wave"]:
        if wave["opcode"] in ("QKV", "WO", "FFN", "LM_HEAD"):
            assert wave["busy_workers"] == 20


def test_h200_imbalance_is_row_granularity(llama1b_config):
    """132 workers: 3072 QKV rows are 23.3 per worker, so one 4 KB row is the imbalance."""
    plan = make_plan(llama1b_config, load_target("h200"), ctx=4096)
    per_wave = wave_bytes(plan)
    for w, info in enumerate(plan.waves):
        if info["opcode"] in ("QKV", "WO", "FFN", "LM_HEAD"):
            row = per_wave[w]
            row_bytes = {"QKV": 2048 * 2, "WO": 2048 * 2, "FFN": 3 * 2048 * 2, "LM_HEAD": 2048 * 2}[info["opcode"]]
            assert row.max() - row.min() <= row_bytes  # one row
    assert plan_stats(plan)["max_weight_wave_imbalance"] < 0.032


def test_default_chunks_fill_the_attention_wave(llama1b_config):
    for name, chunks in (("rtx3050", 2), ("h200", 16)):
        plan = make_plan(llama1b_config, load_target(name), ctx=4096)
        assert plan.consts["attn_chunks"] == chunks
        assert plan.consts["attn_chunk"] == 4096 // chunks


def test_attention_bytes_follow_the_position(llama1b_config):
    plan = make_plan(llama1b_config, load_target("rtx3050"), ctx=4096)
    attn_wave = 2
    at_zero = wave_bytes(plan, pos=0)[attn_wave]
    assert np.count_nonzero(at_zero) == 8  # one chunk active: one task per K/V head
    assert at_zero.sum() == 8 * 1 * (64 + 64) * 4  # 8 heads x 1 position x (K + V) x 4 bytes
    full = wave_bytes(plan)[attn_wave]
    assert full.sum() == 8 * 4096 * 64 * 2 * 4


def test_attention_spreads_a_shorter_context_over_more_chunks(llama1b_config):
    plan = make_plan(llama1b_config, load_target("h200"), ctx=4096)  # 16 chunks of at most 256
    k = plan.consts
    assert (k["attn_spread"], k["attn_min"], k["attn_wide"], k["attn_wide_min"]) == (4, 32, 16, 128)
    positions = (0, 94, 95, 127, 128, 383, 384, 511, 639, 767, 1023, 1024, 2047, 3071, 4095)
    assert [attn_span(k, pos) for pos in positions] == [256, 256, 32, 32, 33, 96, 97, 128, 128, 128, 128, 129,
                                                        128, 192, 256]
    for pos in range(4096):  # the planned chunks cover every position; spread means 3 to 16 of them
        span = attn_span(k, pos)
        active = pos // span + 1
        assert active <= k["attn_chunks"] and active * span > pos
        assert span == k["attn_chunk"] or 3 <= active <= 16
        if active > 4:  # the wide regime: chunks of ATTN_WIDE_MIN positions at least
            assert span >= 128
    at_511 = wave_bytes(plan, pos=511)[2]  # four tasks of 128 positions per K/V head
    assert np.count_nonzero(at_511) == 8 * 4 and at_511.max() == 128 * (64 + 64) * 4
    fixed = make_plan(llama1b_config, load_target("h200"), ctx=4096, attn_spread=0).consts
    assert {attn_span(fixed, pos) for pos in (0, 511, 1023, 4095)} == {256}
    narrow = make_plan(llama1b_config, load_target("h200"), ctx=4096, attn_wide=0).consts  # up to four chunks
    assert [attn_span(narrow, pos) for pos in (511, 1023, 3071)] == [128, 256, 256]
    rtx = make_plan(llama1b_config, load_target("rtx3050"), ctx=4096).consts  # two chunks: never spread
    assert {attn_span(rtx, pos) for pos in (0, 511, 2047, 4095)} == {2048}


def test_gemma3_is_refused_with_the_switches_it_needs(gemma3_path):
    with pytest.raises(UnsupportedError, match="qk_norm"):
        make_plan(load_config(GGUFFile(gemma3_path)), load_target("rtx3050"))


def test_target_file_and_worker_override(tmp_path):
    data = dict(target_to_dict(NAMED_TARGETS["h200"]), name="probed", binary_sha256="ab" * 32)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    target = load_target(str(path), workers=100)
    assert target.workers == 100 and target.name == "probed"
    # a probed binary's hash replaces the target description in the fingerprint
    assert fingerprint(target)["binary_sha256"] == "ab" * 32
    assert fingerprint(target)["fingerprint"] != fingerprint(NAMED_TARGETS["h200"])["fingerprint"]
    path.write_text('{"name": "x", "workers": 0}')
    with pytest.raises(ParameterError, match="missing fields"):
        load_target(str(path))
    with pytest.raises(ParameterError, match="neither a named target"):
        load_target("no-such-gpu")


def test_split_plan_brings_every_h200_weight_wave_within_one_percent(llama1b_config):
    whole = make_plan(llama1b_config, load_target("h200"), ctx=4096, split=False)
    split = make_plan(llama1b_config, load_target("h200"), ctx=4096, split=True)
    validate(split)
    stats = plan_stats(split)
    assert stats["max_weight_wave_imbalance"] < 0.01
    # the busiest worker of every weight wave streams no more than with whole rows
    for a, b in zip(plan_stats(whole)["per_wave"], stats["per_wave"]):
        if a["opcode"] in ("QKV", "WO", "FFN", "LM_HEAD"):
            assert b["max_bytes"] <= a["max_bytes"]
    # 8 leftover FFN rows shared by 4 workers each: their gate and up rows are the only extra bytes
    assert ffn_sharing(8192, 2048, 132, True) == 4 and split.consts["ffn_parts"] == 132 + 8 * 4
    assert stats["bytes_per_token"] - plan_stats(whole)["bytes_per_token"] == 16 * 8 * 3 * 2 * 2048 * 2


def test_split_changes_nothing_where_whole_rows_are_even(llama1b_config):
    whole = make_plan(llama1b_config, load_target("rtx3050"), ctx=4096, split=False)
    split = make_plan(llama1b_config, load_target("rtx3050"), ctx=4096, split=True)
    assert whole.tasks.tobytes() == split.tasks.tobytes()


def test_split_k_fixed_small_case():
    """5 rows of 2 pieces each over 3 workers: runs of 4, 3, 3 pieces."""
    tasks = _matrix_wave(Op.QKV, 5, 2 * SPLIT_COLS, 3, True)
    got = [(t.worker, t.row_start, t.row_count, t.part_start // SPLIT_COLS, t.part_count // SPLIT_COLS, t.side)
           for t in tasks]
    assert got == [(0, 0, 2, 0, 2, 0),                     # rows 0-1
                   (1, 2, 1, 0, 2, 0), (1, 3, 1, 0, 1, 0),  # row 2, first half of row 3
                   (2, 3, 1, 1, 1, 1), (2, 4, 1, 0, 2, 0)]  # second half of row 3 (side), row 4
    assert _matrix_wave(Op.QKV, 5, 2 * SPLIT_COLS, 3, False)[1].part_count == 2 * SPLIT_COLS


@pytest.mark.parametrize("split", [False, True])
def test_plan_is_split_tells_the_two_plans_apart(llama1b_config, split):
    plan = make_plan(llama1b_config, load_target("h200"), ctx=4160, split=split)
    assert plan_is_split(plan) is split
