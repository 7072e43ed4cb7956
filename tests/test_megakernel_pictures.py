"""Pictures of a plan, and the timeline of a (synthetic) traced token."""

import dataclasses
import json

import numpy as np
import pytest

from airframe.errors import ParameterError
from airframe.family import load_config
from airframe.gguf_file import GGUFFile
from airframe.megakernel.plan.pictures import TRACE_FORMAT, draw_package, ideal_ns, read_trace, timeline_summary
from airframe.megakernel.plan.planner import make_plan, wave_bytes
from airframe.megakernel.plan.target import load_target


@pytest.fixture(scope="module")
def plan(smollm2_path):
    config = dataclasses.replace(load_config(GGUFFile(smollm2_path)), n_layers=3)
    return make_plan(config, load_target("rtx3050"), ctx=64)


def synthetic_trace(plan, position, slow_worker=None):
    """Each wave starts when the slowest worker of the previous one ends (plus a 1 us barrier);
    a task takes its bytes at 1/workers of the bandwidth, the slow worker half as fast."""
    per_worker_gbs = plan.target.bandwidth_gbs / plan.target.workers
    rows, now = [], 0.0
    for w in range(plan.consts["n_waves"]):
        end_of_wave = now
        clock = {}
        for i in np.flatnonzero(plan.tasks["wave"] == w):
            t = plan.tasks[i]
            worker = int(t["worker"])
            start = clock.get(worker, now)
            nbytes = wave_bytes_of(plan, i, position)
            length = nbytes / per_worker_gbs * (2.0 if worker == slow_worker else 1.0) + 50.0
            rows.append([int(i), start, start + length])
            clock[worker] = start + length
            end_of_wave = max(end_of_wave, start + length)
        now = end_of_wave + 1000.0
    return {"format": TRACE_FORMAT, "version": 1, "fingerprint": plan.fingerprint["fingerprint"],
            "position": position, "time_unit": "ns", "tasks": rows}


def wave_bytes_of(plan, i, position):
    from airframe.megakernel.plan.planner import task_bytes

    return task_bytes(plan.tasks[i], plan.consts, position)


def test_ideal_time_is_bytes_over_bandwidth(plan):
    assert ideal_ns(plan, 10) == pytest.approx(wave_bytes(plan, 10).sum() / 212.9)
    assert ideal_ns(plan, 63) > ideal_ns(plan, 0)  # attention reads more K/V later


def test_timeline_of_a_synthetic_trace(plan, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(synthetic_trace(plan, 20)))
    trace = read_trace(path, plan)
    summary = timeline_summary(plan, trace)
    assert summary["token_ns"] > summary["ideal_ns"]  # barriers and idle workers cost time
    assert summary["busy_ns"].shape == (20,)
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(synthetic_trace(plan, 20, slow_worker=3)))
    slow_summary = timeline_summary(plan, read_trace(slow, plan))
    assert slow_summary["token_ns"] > summary["token_ns"]
    assert np.argmax(slow_summary["busy_ns"]) == 3
    written = draw_package(plan, tmp_path / "png", path)
    assert [p.name for p in written] == ["wave_bytes.png", "timeline.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_bad_traces_are_refused(plan, tmp_path):
    good = synthetic_trace(plan, 5)
    cases = [
        (dict(good, fingerprint="0" * 64), "fingerprint"),
        (dict(good, format="perfetto"), "format"),
        (dict(good, tasks=[[len(plan.tasks), 0, 1]]), "expected a task below"),
        (dict(good, tasks=[[0, 5, 1]]), "end >= start"),
        (dict(good, position=64), "position 64"),
    ]
    for data, message in cases:
        path = tmp_path / "t.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ParameterError, match=message):
            read_trace(path, plan)
