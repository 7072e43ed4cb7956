"""Pictures of a plan (matplotlib, PNG): bytes per worker per wave, and a traced token's timeline.

Trace format (written by cuda/bench.trace_token; `read_trace` checks it):

    {"format": "airframe-megakernel-trace", "version": 1,
     "fingerprint": "<plan.json fingerprint.fingerprint>",
     "position": 17,                       # the token's position p
     "time_unit": "ns",                    # start/end are ns from the launch's first task start
     "tasks": [[task_index, start, end], ...]}

task_index is the task's index in tasks.bin; its worker, wave and opcode come from the plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import ParameterError
from .opcodes import Op
from .planner import Plan, wave_bytes

TRACE_FORMAT = "airframe-megakernel-trace"
COLORS = {Op.EMBED: "#8c564b", Op.QKV: "#1f77b4", Op.ATTN: "#d62728", Op.WO: "#9467bd",
          Op.FFN: "#2ca02c", Op.FFN_REDUCE: "#bcbd22", Op.FINAL_NORM: "#7f7f7f", Op.LM_HEAD: "#ff7f0e"}


@dataclass
class Trace:
    position: int
    tasks: np.ndarray  # (n, 3): task index, start ns, end ns


def read_trace(path: str | Path, plan: Plan) -> Trace:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ParameterError(f"{path}: cannot read the trace ({e})") from None
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT or data.get("version") != 1:
        raise ParameterError(f"{path}: expected a JSON object with format {TRACE_FORMAT!r} and version 1")
    if data.get("fingerprint") != plan.fingerprint.get("fingerprint"):
        raise ParameterError(f"{path}: fingerprint {data.get('fingerprint')}, expected the package's "
                             f"{plan.fingerprint.get('fingerprint')}")
    rows = np.asarray(data.get("tasks", []), dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] != 3 or len(rows) == 0:
        raise ParameterError(f"{path}: tasks of shape {rows.shape}, expected a list of [task, start, end]")
    bad = (rows[:, 0] < 0) | (rows[:, 0] >= len(plan.tasks)) | (rows[:, 2] < rows[:, 1])
    if bad.any():
        raise ParameterError(f"{path}: entry {int(np.flatnonzero(bad)[0])} = {rows[bad][0].tolist()}, expected "
                             f"a task below {len(plan.tasks)} and end >= start")
    position = data.get("position")
    if not isinstance(position, int) or not 0 <= position < plan.consts["ctx"]:
        raise ParameterError(f"{path}: position {position!r}, expected 0..{plan.consts['ctx'] - 1}")
    return Trace(position, rows)


def ideal_ns(plan: Plan, position: int) -> float:
    """The token's weight and K/V bytes at the target's streaming bandwidth, in ns."""
    return float(wave_bytes(plan, position).sum()) / plan.target.bandwidth_gbs


def timeline_summary(plan: Plan, trace: Trace) -> dict:
    """Token time, ideal streaming time, and the busy time of each worker."""
    workers = plan.tasks["worker"][trace.tasks[:, 0].astype(int)]
    busy = np.zeros(plan.target.workers)
    np.add.at(busy, workers, trace.tasks[:, 2] - trace.tasks[:, 1])
    token = float(trace.tasks[:, 2].max() - trace.tasks[:, 1].min())
    ideal = ideal_ns(plan, trace.position)
    return {"token_ns": token, "ideal_ns": ideal, "share_of_ideal": ideal / token if token else 0.0,
            "busy_ns": busy}


def draw_package(plan: Plan, out: Path, trace_path: str | Path | None = None, layer: int = 0) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [draw_wave_bytes(plan, out / "wave_bytes.png", layer)]
    if trace_path is not None:
        paths.append(draw_timeline(plan, read_trace(trace_path, plan), out / "timeline.png"))
    return paths


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_wave_bytes(plan: Plan, path: Path, layer: int = 0) -> Path:
    """One panel per wave of `layer` plus lm_head: MB each worker streams (grey: no task)."""
    plt = _pyplot()
    per_wave = wave_bytes(plan)
    chosen = [w for w, info in enumerate(plan.waves)
              if info["name"].startswith(f"L{layer}.") or info["name"] == "lm_head"]
    fig, axes = plt.subplots(len(chosen), 1, figsize=(10, 1.6 * len(chosen)), sharex=True, squeeze=False)
    workers = np.arange(plan.target.workers)
    for ax, w in zip(axes[:, 0], chosen):
        info, row = plan.waves[w], per_wave[w] / 1e6
        has_task = np.isin(workers, plan.tasks["worker"][plan.tasks["wave"] == w])
        ax.bar(workers[has_task], row[has_task], color=COLORS[Op[info["opcode"]]], width=0.8)
        ax.bar(workers[~has_task], np.full((~has_task).sum(), row.max() * 0.05 + 1e-9), color="0.8", width=0.8)
        ax.set_ylabel("MB")
        ax.set_title(f"{info['name']} ({info['opcode']}): max {row.max():.3f} MB, mean {row.mean():.3f} MB",
                     fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("worker")
    fig.suptitle(f"bytes per worker, {plan.target.name}, context {plan.consts['ctx']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_timeline(plan: Plan, trace: Trace, path: Path) -> Path:
    """Each worker's tasks over one token, coloured by opcode, with the ideal streaming time."""
    plt = _pyplot()
    summary = timeline_summary(plan, trace)
    t0 = trace.tasks[:, 1].min()
    fig, ax = plt.subplots(figsize=(12, 0.25 * plan.target.workers + 1.5))
    for index, start, end in trace.tasks:
        t = plan.tasks[int(index)]
        ax.barh(int(t["worker"]), (end - start) / 1e3, left=(start - t0) / 1e3, height=0.8,
                color=COLORS[Op(int(t["opcode"]))], linewidth=0)
    ax.axvline(summary["ideal_ns"] / 1e3, color="k", linestyle="--",
               label=f"ideal streaming {summary['ideal_ns'] / 1e3:.1f} us")
    ax.set_xlabel("us")
    ax.set_ylabel("worker")
    if plan.target.workers <= 40:
        ax.set_yticks(range(plan.target.workers))
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles + ax.get_legend_handles_labels()[0],
               [op.name for op in COLORS] + ax.get_legend_handles_labels()[1], fontsize=7, ncol=9, loc="lower center")
    ax.set_title(f"one token at position {trace.position}: {summary['token_ns'] / 1e3:.1f} us, "
                 f"{100 * summary['share_of_ideal']:.0f}% of ideal", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

