#!/usr/bin/env python3
"""What a traced token would take with dependency flags instead of grid barriers: each task
started as soon as its worker is free and its producers have ended plus a signal latency, with the
task times the trace measured (a model, not a run; no weights move). Only the attention tasks need
part of a wave (the QKV tasks holding their rows); every other wave reads whole vectors.

    python3 dev/megakernel/dependency_model.py PACKAGE TRACE.json [--signal-ns 930]

TRACE.json: a traced token with its plan's fingerprint (the device check's bench section writes
trace_ctx1.json into its --out folder, for the package in its --work folder).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from airframe.megakernel.plan.opcodes import Op  # noqa: E402
from airframe.megakernel.plan.validator import head_qkv_rows  # noqa: E402


def attention_producers(plan, index: int, qkv_tasks: np.ndarray) -> np.ndarray:
    """The QKV tasks (of `qkv_tasks`) whose rows hold the q, k or v rows that ATTN task `index` reads."""
    t = plan.tasks
    lo, hi = t["row_start"][qkv_tasks], t["row_start"][qkv_tasks] + t["row_count"][qkv_tasks]
    hit = np.zeros(len(qkv_tasks), dtype=bool)
    for start, n in head_qkv_rows(plan.consts, int(t["head"][index])):
        hit |= (lo < start + n) & (hi > start)
    return qkv_tasks[hit]


def dependency_model(trace: dict, plan, signal_ns: float, partial: bool = True) -> float:
    """What the traced token would take, in us, with the task times it measured, if a task
    started as soon as its worker is free and its producers have ended plus `signal_ns` (dependency
    flags instead of grid barriers; no weights moved). Producers: every task of the previous wave
    (x, h and the merged attention are whole vectors), except that with `partial` an attention
    task waits only for the QKV tasks holding its rows. Waves the worker skipped (every task 0 ns
    in the trace: the FFN reduce) are left out. partial=False with the barrier's latency models the
    grid barrier itself."""
    t = plan.tasks
    tasks = np.array(trace["tasks"], dtype=np.float64).reshape(-1, 3)
    took = np.zeros(len(t))
    took[tasks[:, 0].astype(np.int64)] = tasks[:, 2] - tasks[:, 1]
    done = np.zeros(len(t))
    free = np.zeros(int(t["worker"].max()) + 1)
    before = None
    for wave in np.unique(t["wave"]):
        mine = np.flatnonzero(t["wave"] == wave)
        if not took[mine].any():
            continue
        for i in mine:  # tasks.bin order: a worker's tasks of a wave run one after another
            if before is None:
                ready = 0.0
            elif partial and t["opcode"][i] == int(Op.ATTN) and t["opcode"][before[0]] == int(Op.QKV):
                ready = done[attention_producers(plan, i, before)].max() + signal_ns
            else:
                ready = done[before].max() + signal_ns
            w = t["worker"][i]
            done[i] = max(free[w], ready) + took[i]
            free[w] = done[i]
        before = mine
    return float(done.max()) / 1e3


def main(argv=None) -> int:
    from airframe.megakernel.plan.package import Package

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", type=Path)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--signal-ns", type=float, default=930.0,
                    help="latency of one signal (default: the grid barrier's release, measured on the H200)")
    args = ap.parse_args(argv)
    plan = Package.load(args.package).plan
    trace = json.loads(args.trace.read_text())
    if trace.get("fingerprint") != plan.fingerprint.get("fingerprint"):
        raise SystemExit(f"{args.trace}: traced for another plan than {args.package}'s")
    whole = dependency_model(trace, plan, args.signal_ns, partial=False)
    partial = dependency_model(trace, plan, args.signal_ns, partial=True)
    print(f"grid-barrier model {whole:.1f} us, dependency flags {partial:.1f} us: {whole - partial:.1f} us saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
